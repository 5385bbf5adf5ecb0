"""Prefill and decode speed on a CPU: CPU seconds of a prefill and per decoded token, per method, one process.

Usage: python scripts/cpu_speed.py OUT.json [--size MP] [--tokens N] [--methods full,salicache,...]
Run it with PYTHONPATH pointing at another checkout to measure that code on the same machine and input
(`--code-commit` records which), e.g. to check that a change leaves the speed where it was.
Prefill: one turn with max_new_tokens=1. Decode: `--tokens` greedy single-token steps of the engine
(`Engine.extend`, what the session runs per token) on the cache the prefill left. CPU seconds are the
process's own (robust to other processes sharing the cores); wall figures depend on the load.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--model", default="bench-qwen2.5-vl")
    p.add_argument("--size", type=float, default=1.0, help="megapixels of the synthetic image")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--methods", default="", help="comma-separated subset of the configurations (default: all)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: CPU seconds are not inflated by spinning)")
    p.add_argument("--code-commit", default="", help="the commit of the checkout measured (recorded in the JSON)")
    args = p.parse_args()
    from visualkv.bench.provenance import start

    prov = start()

    import visualkv
    from visualkv.bench.synthetic import image_media, megapixel_size
    from visualkv.models.registry import load_model
    from visualkv.runtime.session import ChatSession, SessionConfig

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    adapter = load_model(args.model, device="cpu", dtype="auto")
    media = image_media(*megapixel_size(args.size))
    configs = {
        "full": {"method": "full"},
        "blockwise-snapkv": {"method": "blockwise-snapkv", "budget": args.budget, "prefill": "blockwise"},
        "hybrid-keydiff": {"method": "blockwise-keydiff", "budget": args.budget, "prefill": "hybrid"},
        "lightkv": {"method": "lightkv"},
        "salicache": {"method": "salicache"},
    }
    if args.methods:
        configs = {name: cfg for name, cfg in configs.items() if name in args.methods.split(",")}
    rows: dict[str, dict] = {}
    for _ in range(args.repeats):
        for name, cfg in configs.items():
            # prefill (+ first token): one turn with max_new_tokens=1
            session = ChatSession(adapter, SessionConfig(max_new_tokens=1, **cfg))
            c0, w0 = time.process_time(), time.perf_counter()
            record = session.ask("Describe the image.", media)
            prefill_cpu, prefill_wall = time.process_time() - c0, time.perf_counter() - w0
            # decode: `--tokens` single-token steps on the compressed cache (the engine's decode step)
            cache, token = session.cache, record.token_ids[0] if record.token_ids else 0
            if hasattr(cache, "reserve"):
                cache.reserve(args.tokens)
            pos, seq = session.state.next_position, session.state.seq_len
            c0, w0 = time.process_time(), time.perf_counter()
            for i in range(args.tokens):
                logits = session.engine.extend(torch.tensor([token]), pos + i, seq + i, cache)
                token = int(logits.argmax())
            decode_cpu, decode_wall = time.process_time() - c0, time.perf_counter() - w0
            row = rows.setdefault(
                name,
                {
                    k: []
                    for k in (
                        "prefill_cpu_seconds",
                        "prefill_wall_seconds",
                        "decode_cpu_ms_per_token",
                        "decode_tokens_per_second",
                    )
                },
            )
            row["prefill_cpu_seconds"].append(prefill_cpu)
            row["prefill_wall_seconds"].append(prefill_wall)
            row["decode_cpu_ms_per_token"].append(1000 * decode_cpu / args.tokens)
            row["decode_tokens_per_second"].append(args.tokens / decode_wall)
            row["kv_entries_layer0"] = cache.entries_per_layer()[0]
            row["final_kv_bytes"] = cache.kv_bytes()
            row["peak_kv_bytes"] = cache.peak_kv_bytes
            for extra in ("allocated_bytes", "dequant_bytes"):
                if hasattr(cache, extra):
                    row[extra] = getattr(cache, extra)()
            if hasattr(cache, "peak_device_bytes"):
                row["peak_device_bytes"] = cache.peak_device_bytes
            print(name, {k: (round(v[-1], 3) if isinstance(v, list) else v) for k, v in row.items()}, flush=True)
    out = {
        "code": visualkv.__file__,
        "code_commit": args.code_commit,
        "machine": f"{platform.machine()}, torch {torch.__version__}, {args.threads} torch thread(s)",
        "model": args.model,
        "size_mp": args.size,
        "budget": args.budget,
        "rows": rows,
    }
    from visualkv.bench.provenance import save_json  # the measured checkout's, so its load reading is recorded

    prov["command"] = "python scripts/cpu_speed.py " + " ".join(sys.argv[1:])
    save_json(out, args.out, prov)


if __name__ == "__main__":
    main()
