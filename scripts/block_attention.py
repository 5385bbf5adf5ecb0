"""One layer's attention for a block of new tokens after cached entries, two ways, at a shape's dimensions.

Usage: python scripts/block_attention.py OUT.json [--shape shape-qwen2.5-vl-7b] [--cases 1024x8192,16x76544]
  [--repeats 5] [--dtype bfloat16] [--device cuda]

Why: every prefill block after the first, and every follow-up question, attends over a cache with a mask. Given a
mask tensor, transformers' SDPA function repeats K/V to every query head (`repeat_kv`) and PyTorch's CUDA SDPA
runs no flash kernel; `visualkv.attention.block` attends without either. This measures, for one layer, in one
process on the same random entries (cases alternate, median of the repeats):
- `transformers`: `sdpa_attention_forward` with the dense lower-right bool mask (the path before block_attention);
- `visualkv`: `block_attention.attend` (on CUDA the lower-right flash kernel, on a CPU the bool mask with
  `enable_gqa`).
Per case: median time per call (CUDA events on a GPU; perf_counter on a CPU), the transient bytes of one call
over the inputs (CUDA: the allocator's peak; CPU: the growth of the peak RSS of a fresh child process that runs
the call once, Linux's VmHWM reset before it), and the largest difference from the transformers output. Times are this machine's.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

from visualkv.bench.provenance import save_json, start
from visualkv.report.telemetry import reset_peak_rss, rss_bytes, rss_peak_since_reset

KERNELS = ("transformers", "visualkv")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def geometry(shape: str) -> dict[str, int]:
    """Query heads, KV heads and head dim of a shape (or tiny / bench) model's language model."""
    if shape.startswith("shape-"):
        from visualkv.models.synthetic.shapes import build_shape_config, build_shape_processor

        text = build_shape_config(shape, build_shape_processor(shape)).text_config
    else:
        from visualkv.models.registry import load_model

        text = load_model(shape).text_config
    heads, kv_heads = text.num_attention_heads, text.num_key_value_heads
    return {
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": getattr(text, "head_dim", None) or text.hidden_size // heads,
    }


def inputs(geo: dict[str, int], q: int, n_past: int, dtype: torch.dtype, device: str):
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(heads: int, length: int) -> torch.Tensor:
        return torch.randn(1, heads, length, geo["head_dim"], generator=gen, device=device, dtype=dtype)

    return rand(geo["heads"], q), rand(geo["kv_heads"], n_past + q), rand(geo["kv_heads"], n_past + q)


def call(kernel: str, geo: dict[str, int], query, key, value):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from visualkv.attention.block import AfterCache, attend

    module = SimpleNamespace(num_key_value_groups=geo["heads"] // geo["kv_heads"], is_causal=True, training=False)
    mask, scaling = AfterCache(query.shape[2]), geo["head_dim"] ** -0.5
    if kernel == "transformers":
        dense = mask.dense(key.shape[2], key.device)
        return sdpa_attention_forward(module, query, key, value, dense, scaling=scaling)[0]
    return attend(module, query, key, value, mask, sdpa_attention_forward, scaling=scaling)[0]


def child(args: argparse.Namespace) -> None:
    """Run one call in this fresh process and print the growth of its peak RSS over the inputs (bytes)."""
    geo = json.loads(args.child)
    q, n_past = (int(v) for v in args.cases.split("x"))
    query, key, value = inputs(geo, q, n_past, DTYPES[args.dtype], "cpu")
    call(args.kernel, geo, query[:, :, :1], key[:, :, :2], value[:, :, :2])  # load the kernels' code first
    reset_peak_rss()  # the peak RSS starts again from the current RSS
    before = rss_bytes()
    call(args.kernel, geo, query, key, value)
    print(rss_peak_since_reset() - before)


def cpu_transient(geo, kernel: str, q: int, n_past: int, dtype: str) -> int:
    cmd = [sys.executable, __file__, "-", "--child", json.dumps(geo), "--kernel", kernel, "--cases", f"{q}x{n_past}"]
    out = subprocess.run([*cmd, "--dtype", dtype], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def timed(fn, device: str) -> tuple[float, int | None]:
    """(seconds, transient bytes on CUDA, else None) of one call."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return begin.elapsed_time(end) / 1000, torch.cuda.max_memory_allocated() - base
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--shape", default="shape-qwen2.5-vl-7b")
    parser.add_argument("--cases", default="1024x8192,16x76544", help="QxN: a block of Q tokens after N entries")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--kernel", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    provenance = start()
    provenance["command"] = "python scripts/block_attention.py " + " ".join(sys.argv[1:])
    geo = geometry(args.shape)
    dtype = DTYPES[args.dtype]
    rows = []
    for case in args.cases.split(","):
        q, n_past = (int(v) for v in case.split("x"))
        query, key, value = inputs(geo, q, n_past, dtype, args.device)
        outputs = {k: call(k, geo, query, key, value) for k in KERNELS}  # also the warm-up
        seconds: dict[str, list[float]] = {k: [] for k in KERNELS}
        transient: dict[str, int | None] = {}
        for _ in range(args.repeats):
            for kernel in KERNELS:
                s, peak = timed(functools.partial(call, kernel, geo, query, key, value), args.device)
                seconds[kernel].append(s)
                transient[kernel] = peak
        for kernel in KERNELS:
            if transient[kernel] is None:
                transient[kernel] = cpu_transient(geo, kernel, q, n_past, args.dtype)
            reference = outputs["transformers"].float()
            rows.append(
                {
                    "q": q,
                    "n_past": n_past,
                    "kernel": kernel,
                    "median_ms": 1000 * statistics.median(seconds[kernel]),
                    "runs_ms": [1000 * s for s in seconds[kernel]],
                    "transient_bytes": transient[kernel],
                    "kv_bytes": key.nbytes + value.nbytes,
                    "max_abs_diff": float((outputs[kernel].float() - reference).abs().max()),
                }
            )
            r = rows[-1]
            print(
                f"q {q:5d} after {n_past:6d}  {kernel:12s} {r['median_ms']:9.2f} ms  "
                f"transient {r['transient_bytes'] / 2**20:8.1f} MiB  (K+V {r['kv_bytes'] / 2**20:.1f} MiB)  "
                f"diff {r['max_abs_diff']:.2e}",
                flush=True,
            )
        del query, key, value, outputs
    result = {"kind": "block_attention", "shape": args.shape, "geometry": geo, "dtype": args.dtype}
    result.update(device=args.device, repeats=args.repeats, rows=rows)
    save_json(result, args.out, provenance)


if __name__ == "__main__":
    main()
