"""Benchmarks: `python -m visualkv bench memory|latency ...`.

memory: sweeps input size (megapixels, or frames for video) for several
methods. Every (method, size) runs in its own subprocess, because a process's
peak RSS never goes down. Saves JSON plus a Plotly chart (HTML and PNG).
latency: TTFT of full, forced block-wise and hybrid prefill measured in one
process on the same input, reported as ratios to full.
Figures are measurements of this machine; compare ratios, not absolutes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from visualkv.errors import ConfigError

DEFAULT_METHODS = "full,post-snapkv,blockwise-keydiff,blockwise-snapkv"


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("kind", choices=["memory", "latency", "one"], help="which benchmark")
    p.add_argument("--model", default="tiny-qwen2.5-vl")
    p.add_argument("--methods", default=DEFAULT_METHODS, help="comma-separated")
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--prefill", default=None, help="(one) prefill mode")
    p.add_argument("--method", default="full", help="(one) method")
    p.add_argument("--sizes", default="0.5,1,2,4,8.3", help="megapixels (image) or frame counts (video)")
    p.add_argument("--size", type=float, default=8.3, help="(one/latency) megapixels or frames")
    p.add_argument("--video", action="store_true", help="sweep video frame counts instead of megapixels")
    p.add_argument("--repeats", type=int, default=1, help="(latency) runs per mode; the minimum is kept")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--out", default="bench_out", help="output folder")
    p.add_argument("--json", dest="json_out", default=None, help="(one) write the result here")


def run_bench(args: argparse.Namespace) -> int:
    if args.kind == "one":
        result = measure_one(args.model, args.method, args.budget, args.block_size, args.prefill, args.size,
                             args.video, args.device, args.dtype)
        text = json.dumps(result)
        if args.json_out:
            with open(args.json_out, "w") as fh:
                fh.write(text)
        print(text)
        return 0
    os.makedirs(args.out, exist_ok=True)
    if args.kind == "memory":
        return bench_memory(args)
    return bench_latency(args)


def _media(size: float, video: bool):
    from visualkv.synthetic import image_media, megapixel_size, video_media

    if video:
        return video_media(int(size))
    return image_media(*megapixel_size(size))


def measure_one(model: str, method: str, budget: int | None, block_size: int | None, prefill: str | None,
                size: float, video: bool, device: str = "cpu", dtype: str = "auto") -> dict[str, Any]:
    """Prefill one synthetic input and report memory and time (meant for a fresh process)."""
    import torch

    from visualkv.models.registry import load_model
    from visualkv.session import ChatSession, SessionConfig
    from visualkv.telemetry import peak_rss_bytes, rss_bytes

    adapter = load_model(model, device=device, dtype=dtype)
    media = _media(size, video)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    base_rss, base_peak = rss_bytes(), peak_rss_bytes()
    base_cuda = torch.cuda.memory_allocated() if torch.cuda.is_available() else None
    from visualkv.methods import METHODS

    session = ChatSession(adapter, SessionConfig(
        method=method, budget=budget if METHODS[method].needs_budget else None, block_size=block_size,
        prefill=prefill, max_new_tokens=1))
    t0 = time.perf_counter()
    record = session.ask("Describe the image.", media)
    wall = time.perf_counter() - t0
    report = session.report()
    return {
        "model": model, "method": method, "budget": budget, "size": size, "video": video,
        "prefill": report["prefill"], "block_size": report["block_size"],
        "visual_tokens": report["visual_tokens"], "blocks": len(report["blocks"]),
        "peak_kv_bytes": report["peak_kv_bytes"], "final_kv_bytes": report["final_kv_bytes"],
        "full_kv_bytes": report["full_kv_bytes"],
        "rss_before_bytes": base_rss, "peak_rss_before_bytes": base_peak, "peak_rss_bytes": peak_rss_bytes(),
        "cuda_before_bytes": base_cuda, "cuda_peak_bytes": report["cuda_peak_bytes"],
        "ttft_seconds": record.ttft_seconds, "wall_seconds": wall,
    }


def _subprocess_one(args: argparse.Namespace, method: str, size: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "visualkv", "bench", "one", "--model", args.model, "--method", method,
           "--budget", str(args.budget), "--size", str(size), "--device", args.device, "--dtype", args.dtype]
    if args.block_size:
        cmd += ["--block-size", str(args.block_size)]
    if args.video:
        cmd.append("--video")
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise ConfigError(f"benchmark run {method} @ {size} failed: {tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench_memory(args: argparse.Namespace) -> int:
    from visualkv.viz import memory_sweep_figure, save_figure

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    sizes = [float(s) for s in args.sizes.split(",")]
    rows = []
    for size in sizes:
        for method in methods:
            row = _subprocess_one(args, method, size)
            rows.append(row)
            print(f"{method:18s} size {size:6g}  visual {row['visual_tokens']:6d}  "
                  f"peak KV {row['peak_kv_bytes'] / 2**20:8.2f} MiB  final KV {row['final_kv_bytes'] / 2**20:8.2f} MiB  "
                  f"peak RSS {row['peak_rss_bytes'] / 2**20:8.1f} MiB  TTFT {row['ttft_seconds']:.2f}s", flush=True)
    summary = summarize_memory(rows, methods, args.budget)
    out = {"kind": "memory", "model": args.model, "budget": args.budget, "video": args.video,
           "rows": rows, "summary": summary}
    path = os.path.join(args.out, f"memory_{'video' if args.video else 'image'}_{args.model}.json")
    with open(path, "w") as fh:
        json.dump(out, fh, indent=1)
    fig = memory_sweep_figure(rows, "frames" if args.video else "megapixels")
    saved = save_figure(fig, path[:-5])
    print(json.dumps(summary, indent=1))
    print("saved", path, *saved)
    return 0


def summarize_memory(rows: list[dict], methods: list[str], budget: int) -> dict[str, Any]:
    """Ratios at the largest size and growth of peak RSS, per method."""
    by = {m: sorted((r for r in rows if r["method"] == m), key=lambda r: r["size"]) for m in methods}
    summary: dict[str, Any] = {}
    full = by.get("full")
    for m, rs in by.items():
        if not rs:
            continue
        s = {"peak_rss_growth_bytes": rs[-1]["peak_rss_bytes"] - rs[0]["peak_rss_bytes"],
             "peak_kv_bytes_largest": rs[-1]["peak_kv_bytes"]}
        if full and m != "full":
            s["full_over_final_kv_largest"] = full[-1]["final_kv_bytes"] / max(rs[-1]["final_kv_bytes"], 1)
            s["full_over_peak_kv_largest"] = full[-1]["peak_kv_bytes"] / max(rs[-1]["peak_kv_bytes"], 1)
            fg = full[-1]["peak_rss_bytes"] - full[0]["peak_rss_bytes"]
            s["rss_growth_over_full_growth"] = s["peak_rss_growth_bytes"] / fg if fg > 0 else None
        over = [r for r in rs if r["visual_tokens"] > budget + (r["block_size"] or 0)]
        if len(over) >= 2:
            peaks = [r["peak_kv_bytes"] for r in over]
            s["peak_kv_spread_over_bound_sizes"] = (max(peaks) - min(peaks)) / max(peaks)
        summary[m] = s
    return summary


def bench_latency(args: argparse.Namespace) -> int:
    """TTFT for full (bulk), block-wise (forced) and hybrid, same process, same input."""
    from visualkv.models.registry import load_model
    from visualkv.session import ChatSession, SessionConfig

    adapter = load_model(args.model, device=args.device, dtype=args.dtype)
    media = _media(args.size, args.video)
    method = "blockwise-snapkv" if "blockwise-snapkv" in args.methods else args.methods.split(",")[-1]
    configs = {
        "full": SessionConfig(method="full", max_new_tokens=1),
        "blockwise": SessionConfig(method=method, budget=args.budget, block_size=args.block_size,
                                   prefill="blockwise", max_new_tokens=1),
        "hybrid": SessionConfig(method=method, budget=args.budget, block_size=args.block_size,
                                prefill="hybrid", max_new_tokens=1),
    }
    ttft: dict[str, float] = {}
    for _ in range(max(1, args.repeats)):
        for name, cfg in configs.items():
            record = ChatSession(adapter, cfg).ask("Describe the image.", media)
            ttft[name] = min(ttft.get(name, float("inf")), record.ttft_seconds)
            print(f"{name:10s} TTFT {record.ttft_seconds:.2f}s", flush=True)
    out = {"kind": "latency", "model": args.model, "method": method, "budget": args.budget, "size": args.size,
           "video": args.video, "ttft_seconds": ttft,
           "ratios": {"blockwise/full": ttft["blockwise"] / ttft["full"], "hybrid/full": ttft["hybrid"] / ttft["full"]}}
    path = os.path.join(args.out, f"latency_{'video' if args.video else 'image'}_{args.model}.json")
    with open(path, "w") as fh:
        json.dump(out, fh, indent=1)
    print(json.dumps(out["ratios"]), "saved", path)
    return 0
