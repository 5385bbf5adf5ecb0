"""Issue 11 CPU speed check: TTFT and decode tokens/s per method, one process, one input.

Usage: python scripts/bench_issue11.py OUT.json [--size MP] [--tokens N]
Run it with PYTHONPATH pointing at another checkout to measure that code on the same machine.
Decode tokens/s is taken over `--tokens` greedy tokens (EOS is masked so every run decodes them all).
"""

from __future__ import annotations

import argparse
import json
import platform
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
    args = p.parse_args()

    import visualkv
    from visualkv.models.registry import load_model
    from visualkv.session import ChatSession, SessionConfig
    from visualkv.synthetic import image_media, megapixel_size

    torch.manual_seed(0)
    adapter = load_model(args.model, device="cpu", dtype="auto")
    type(adapter).eos_token_ids = property(lambda self: set())  # decode exactly --tokens tokens
    media = image_media(*megapixel_size(args.size))
    configs = {
        "full": dict(method="full"),
        "blockwise-snapkv": dict(method="blockwise-snapkv", budget=args.budget, prefill="blockwise"),
        "hybrid-keydiff": dict(method="blockwise-keydiff", budget=args.budget, prefill="hybrid"),
        "lightkv": dict(method="lightkv"),
        "salicache": dict(method="salicache"),
    }
    rows: dict[str, dict] = {}
    for _ in range(args.repeats):
        for name, cfg in configs.items():
            session = ChatSession(adapter, SessionConfig(max_new_tokens=args.tokens, **cfg))
            c0 = time.process_time()
            record = session.ask("Describe the image.", media)
            row = rows.setdefault(name, {"ttft_seconds": [], "decode_tokens_per_second": [], "cpu_seconds": []})
            row["ttft_seconds"].append(record.ttft_seconds)
            row["decode_tokens_per_second"].append(record.decode_tokens_per_second)
            row["cpu_seconds"].append(time.process_time() - c0)
            row["tokens"] = len(record.token_ids)
            row["final_kv_bytes"] = session.cache.kv_bytes()
            row["peak_kv_bytes"] = session.cache.peak_kv_bytes
            row["answer_ids_head"] = record.token_ids[:8]
            print(name, {k: (v[-1] if isinstance(v, list) else v) for k, v in row.items()}, flush=True)
    out = {
        "command": f"python scripts/bench_issue11.py {args.out} --size {args.size} --tokens {args.tokens} "
                   f"--budget {args.budget} --repeats {args.repeats}",
        "code": visualkv.__file__,
        "machine": f"{platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
                   "2 CPU cores shared by five engineers (loaded)",
        "model": args.model, "size_mp": args.size, "budget": args.budget,
        "rows": rows,
    }
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
