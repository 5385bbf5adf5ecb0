"""The memory guard's estimate against measured memory, one process per method or per model (CPU).

    python scripts/guard_check.py --model bench-qwen2.5-vl --media assets/example_4k.png \\
        --methods full,blockwise-keydiff --json docs/results/memory_guard_cpu.json

In a fresh process per method (or, with `--per-process model`, per model for all its methods in turn): load
the model and the media, run a warm-up turn of each method on a small image (one-time allocations: thread
pools, kernel caches), then measure one turn per method on the media from the moment its input is prepared
(where the guard runs; the prepared input is part of the baseline) to its end:

- KV: the estimate's KV parts against the cache's `peak_kv_bytes` (bytes of K/V entries really held) and
  `peak_allocated_bytes` (of its buffers, free capacity included).
- whole: the estimate's peak against the growth of the process's RSS over the turn, sampled every
  millisecond, with glibc's mmap threshold pinned at 64 KiB (`MALLOC_MMAP_THRESHOLD_`), so every tensor
  larger than that is mapped on allocation and unmapped on free, and RSS follows the bytes alive instead
  of the allocator's retained heap.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo, run from anywhere

QUESTION = "Where is the small red star?"


def measure_runs(
    model: str, media_path: str, runs: list[tuple[str, int]], budget: int, max_frames: int | None = None
) -> list[dict]:
    """Each (method, vision_ahead) of `runs` measured in turn in this process, after a warm-up turn of each."""
    from visualkv.bench.synthetic import image_media
    from visualkv.media import FrameSampling, load_media
    from visualkv.models.registry import load_model
    from visualkv.runtime.memory_guard import MemoryGuard
    from visualkv.runtime.session import ChatSession, SessionConfig

    adapter = load_model(model)
    media = load_media(media_path, sampling=FrameSampling(max_frames=max_frames or 64))
    for method, ahead in runs:  # warm-up: one-time allocations (thread pools, kernel caches) of every run
        cfg = SessionConfig(method=method, budget=_budget(method, budget), max_new_tokens=1, vision_ahead=ahead)
        ChatSession(adapter, cfg, guard=MemoryGuard(enabled=False)).ask(QUESTION, image_media(448, 336, seed=1))
    rows = []
    for method, ahead in runs:
        gc.collect()  # the previous run's session is gone before this one's baseline
        rows.append(measure(adapter, media, method, budget, ahead))
    return rows


def _budget(method: str, budget: int) -> int | None:
    from visualkv.methods import method_traits

    return budget if method_traits(method).needs_budget else None


def measure(adapter, media, method: str, budget: int, vision_ahead: int = 1) -> dict:
    """One turn of `method` on `media`: the estimate against the cache's peaks and the growth of RSS."""
    import psutil
    import torch

    from visualkv.methods import method_traits
    from visualkv.runtime.memory_guard import MemoryGuard, estimate_prefill
    from visualkv.runtime.session import ChatSession, SessionConfig

    cfg = SessionConfig(method=method, budget=_budget(method, budget), max_new_tokens=1, vision_ahead=vision_ahead)
    unguarded = MemoryGuard(enabled=False)
    prepared = adapter.prepare(media, QUESTION)
    est = estimate_prefill(
        adapter, prepared, method_traits(method), cfg.budget, None, None, vision_ahead, cfg.cache_headroom
    )
    session = ChatSession(adapter, cfg, guard=unguarded)
    proc = psutil.Process()
    base = [proc.memory_info().rss]
    peak = [base[0]]
    done = threading.Event()
    prepare = adapter.prepare

    def prepared_then_baseline(*args, **kwargs):
        # the guard runs once the input is prepared: measure from there, the prepared input included in the base
        out = prepare(*args, **kwargs)
        gc.collect()  # the preparation's garbage in reference cycles would otherwise fall in the measured span
        base[0] = peak[0] = proc.memory_info().rss
        return out

    adapter.prepare = prepared_then_baseline
    del prepared  # the session prepares its own

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    session.ask(QUESTION, media)
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    del adapter.prepare  # back to the class's method
    growth = peak[0] - base[0]
    row = {
        "method": method,
        "vision_ahead": vision_ahead,
        "budget": cfg.budget,
        "visual_tokens": session.report()["visual_tokens"],
        "estimate": {
            "kv_bytes": est.kv_bytes,
            "kv_allocated_bytes": est.kv_allocated_bytes,
            "activation_bytes": est.activation_bytes,
            "vision_bytes": est.vision_bytes,
            "peak_bytes": est.peak_bytes,
            "media_bytes": est.media_bytes,
        },
        "measured": {
            "peak_kv_bytes": session.cache.peak_kv_bytes,
            "peak_allocated_bytes": session.cache.peak_allocated_bytes,
            "rss_growth_bytes": growth,
        },
        "kv_ratio": est.kv_bytes / session.cache.peak_kv_bytes,
        "kv_allocated_ratio": est.kv_allocated_bytes / session.cache.peak_allocated_bytes,
        "whole_ratio": est.peak_bytes / growth,
        "turn_seconds": round(seconds, 2),
        "torch_threads": torch.get_num_threads(),
    }
    del session
    return row


def _measure_batch(batch: list[tuple[str, str, int]], args, env: dict) -> list[dict]:
    """The runs of `batch` (one model's) measured in a fresh process; each row printed as it comes."""
    model = batch[0][0]
    command = [sys.executable, __file__, "--model", model, "--media", args.media, "--budget", str(args.budget)]
    command += ["--max-frames", str(args.max_frames)]
    command += ["--runs", ",".join(f"{method}@{ahead}" for _, method, ahead in batch)]
    out = subprocess.run(command, check=False, env=env, capture_output=True, text=True)
    if out.returncode != 0:  # recorded, not fatal: the other runs' figures still count
        error = (out.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"{model:22s} {batch[0][1]:36s} FAILED: {error}", flush=True)
        return [{"model": model, "method": method, "vision_ahead": ahead, "error": error} for _, method, ahead in batch]
    rows = [{"model": model, **row} for row in json.loads(out.stdout.strip().splitlines()[-1])]
    for row in rows:
        print(
            f"{model:22s} {row['method']:36s} ahead {row['vision_ahead']} KV est/measured {row['kv_ratio']:.3f}, "
            f"allocated {row['kv_allocated_ratio']:.3f}   whole est/measured {row['whole_ratio']:.3f} "
            f"({row['estimate']['peak_bytes'] / 2**20:.1f} / {row['measured']['rss_growth_bytes'] / 2**20:.1f} MiB)",
            flush=True,
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="bench-qwen2.5-vl", help="a model alias, or several joined by commas")
    parser.add_argument("--media", default="assets/example_4k.png")
    parser.add_argument(
        "--methods", default="full,blockwise-keydiff,blockwise-snapkv,post-snapkv", help="names, or 'all' registered"
    )
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--max-frames", type=int, default=64, help="a video's frames, sampled over its length")
    parser.add_argument("--json", dest="json_out", default="docs/results/memory_guard_cpu.json")
    parser.add_argument("--machine", default="", help="words for the record, e.g. '2 CPU cores, loaded'")
    parser.add_argument(
        "--vision-ahead", type=int, default=1, help="also measure each block-wise method with N blocks per tower call"
    )
    parser.add_argument(
        "--per-process",
        choices=("run", "model"),
        default="run",
        help="one process per run (default), or one per model measuring its runs in turn (their growths then "
        "include what the process's allocator kept from the runs before: up to +60 MiB seen on the tiny models)",
    )
    parser.add_argument(
        "--jobs", type=int, default=1, help="processes measuring at once (each measures only its own RSS)"
    )
    parser.add_argument(
        "--update", action="store_true", help="replace only these runs' rows in an existing JSON (a re-measure)"
    )
    parser.add_argument("--runs", help=argparse.SUPPRESS)  # internal: measure these method@ahead here
    args = parser.parse_args()
    if args.runs:
        runs = [(run.split("@")[0], int(run.split("@")[1])) for run in args.runs.split(",")]
        print(json.dumps(measure_runs(args.model, args.media, runs, args.budget, args.max_frames)))
        return 0
    from visualkv.bench.provenance import finish, save_json, start

    prov = {**start(), "command": "python " + " ".join(sys.argv)}
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if args.jobs > 1:  # the cores shared among the processes at once
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // args.jobs))
    if args.methods == "all":
        from visualkv.methods import method_names

        args.methods = ",".join(method_names())
    rows = []
    runs = []
    for model in args.model.split(","):
        for method in args.methods.split(","):
            runs.append((model, method, 1))
            if args.vision_ahead > 1 and method.startswith("blockwise"):
                runs.append((model, method, args.vision_ahead))
    if args.per_process == "run":
        batches = [[run] for run in runs]
    else:
        batches = [[run for run in runs if run[0] == model] for model in args.model.split(",")]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        measured = list(pool.map(lambda batch: _measure_batch(batch, args, env), batches))
    for rows_of_batch in measured:
        rows += rows_of_batch
    record = {
        "command": "python " + " ".join(sys.argv),
        "machine": args.machine or f"{os.cpu_count()} CPU cores",
        "platform": platform.platform(),
        "model": args.model,
        "media": os.path.basename(args.media),
        "results": rows,
    }
    if args.update and os.path.exists(args.json_out):
        return _update(args.json_out, rows, finish(prov))
    save_json(record, args.json_out, prov)  # the commit, its diff's hash and the load beside the figures
    return 0


def _update(path: str, rows: list[dict], prov: dict) -> int:
    """These runs' rows replace theirs in the committed JSON, the others kept; the file's provenance stays its
    first measure's (the oldest commit in it, which staleness checks) and `updates` lists each re-measure."""
    with open(path) as fh:
        record = json.load(fh)
    new = {(r["model"], r["method"], r["vision_ahead"]): r for r in rows}
    old = record["results"]
    keys = [(r["model"], r["method"], r["vision_ahead"]) for r in old]
    record["results"] = [new.get(key, r) for key, r in zip(keys, old)] + [r for k, r in new.items() if k not in keys]
    update = {key: prov.get(key) for key in ("command", "commit", "diff_sha256", "started", "condition")}
    update["runs"] = len(rows)
    record["updates"] = [*record.get("updates", []), update]
    with open(path, "w") as fh:
        json.dump(record, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
