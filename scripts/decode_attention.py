"""One decode step's attention over a long cache, three ways, at a shape's attention dimensions.

Usage: python scripts/decode_attention.py OUT.json [--shape shape-qwen2.5-vl-7b] [--entries 1024,10579,76574]
  [--window-room 65] [--repeats 20] [--dtype bfloat16] [--device cuda]

Why: on the H200 (docs/results/gpu/gpu_shape-qwen2.5-vl-7b.json) decoding slowed with the cache's size far more
than reading it would: `full` 19.4 tokens/s over 4.2 GB of cache on the 512-s video, LightKV 27.7 over 2.5 GB,
block-wise 110 over 62 MB, about 10 ms per GB of cache per token, where the H200 reads a GB in about 0.2 ms. A
graph-decoded step attends over a fixed window with a boolean mask hiding the slots this answer has not written
yet; with a mask, transformers' SDPA path packs the query heads of each KV head as queries (`pack_gqa`) and PyTorch
cannot use its flash kernels, so the step may run on a kernel that parallelises over heads and queries only
(4 KV heads x 7 queries on Qwen2.5-VL-7B), not over the 76k entries. This measures, for one layer and one new
token, in one process on the same random entries:
- `sdpa, masked`: transformers' `sdpa_attention_forward` with the window's boolean mask (what the graph step runs);
- `sdpa, no mask`: the same over the written entries only, no mask (`enable_gqa`; what an eager step over an exact
  cache gets);
- `grouped matmul`: `packed_attention.one_query` with no packed parts (two batched matmuls and a float32 softmax,
  KV heads not repeated), with the same mask.
Per case: median time per call (CUDA events on a GPU; perf_counter and one thread on a CPU), the bytes K and V hold
(what a call must read at least) and the effective rate, and the largest difference from a float32 reference.
Times are this machine's; on a CPU they do not predict a GPU's.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

from visualkv.attention.packed import one_query
from visualkv.bench.provenance import save_json, start

CASES = ("sdpa, masked", "sdpa, no mask", "grouped matmul")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def geometry(shape: str) -> dict[str, int]:
    """Query heads, KV heads, head dim and layers of a shape model's language model (from its config)."""
    from visualkv.models.synthetic.shapes import build_shape_config, build_shape_processor

    text = build_shape_config(shape, build_shape_processor(shape)).text_config
    heads, kv_heads = text.num_attention_heads, text.num_key_value_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "layers": text.num_hidden_layers}


def _sdpa(query, key, value, mask, groups: int):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = SimpleNamespace(num_key_value_groups=groups, is_causal=True, training=False)
    return sdpa_attention_forward(module, query, key, value, mask, scaling=query.shape[-1] ** -0.5)[0]


def run_case(case: str, query, key, value, written: int):
    """One call of `case`; the window holds `key.shape[2]` slots of which the first `written` are visible."""
    groups = query.shape[1] // key.shape[1]
    window = key.shape[2]
    mask = (torch.arange(window, device=key.device) < written).view(1, 1, 1, window)
    if case == "sdpa, masked":
        return _sdpa(query, key, value, mask, groups)
    if case == "sdpa, no mask":
        return _sdpa(query, key[:, :, :written], value[:, :, :written], None, groups)
    return one_query(query, key, value, mask, [], query.shape[-1] ** -0.5)[0]


def _timed(fn, repeats: int, cuda: bool) -> float:
    """Median seconds per call of `fn` (the caller has run it once already: that call is the warm-up)."""
    times = []
    for _ in range(repeats):
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()  # the timing itself: read once per repeat, outside any hot path
            times.append(begin.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(shape: str, entries: list[int], room: int, repeats: int, dtype: str, device: str) -> dict:
    geo = geometry(shape)
    cuda = device.startswith("cuda")
    torch_dtype = DTYPES[dtype]
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    for n in entries:
        window = n + room  # the held entries and room for the answer, as the graph step's window
        q = torch.randn(1, geo["heads"], 1, geo["head_dim"], generator=gen)
        k = torch.randn(1, geo["kv_heads"], window, geo["head_dim"], generator=gen)
        v = torch.randn(1, geo["kv_heads"], window, geo["head_dim"], generator=gen)
        written = n + 1  # this step's own entry included
        reference = run_case("grouped matmul", q.double(), k.double(), v.double(), written)
        q, k, v = (t.to(device=device, dtype=torch_dtype) for t in (q, k, v))
        kv_bytes = 2 * k[:, :, :written].numel() * k.element_size()
        for case in CASES:
            out = run_case(case, q, k, v, written)  # checked below; also the warm-up of the timed calls
            seconds = _timed(functools.partial(run_case, case, q, k, v, written), repeats, cuda)
            rows.append(
                {
                    "entries": n,
                    "case": case,
                    "seconds_per_call": seconds,
                    "kv_bytes": kv_bytes,
                    "gb_per_second": kv_bytes / seconds / 1e9,
                    "seconds_per_token_all_layers": seconds * geo["layers"],
                    "max_abs_difference": float((out.double().cpu() - reference).abs().max()),
                }
            )
    return {"shape": shape, "geometry": geo, "dtype": dtype, "device": device, "window_room": room, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="JSON file to write")
    p.add_argument("--shape", default="shape-qwen2.5-vl-7b")
    p.add_argument("--entries", default="1024,10579,76574", help="held entries per KV head, comma-separated")
    p.add_argument("--window-room", type=int, default=65, help="slots reserved for the answer (max new tokens + 1)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    if not args.device.startswith("cuda"):
        torch.set_num_threads(1)
    prov = start()
    prov["command"] = "python scripts/decode_attention.py " + " ".join(sys.argv[1:] if argv is None else argv)
    entries = [int(x) for x in args.entries.split(",")]
    result = measure(args.shape, entries, args.window_room, args.repeats, args.dtype, args.device)
    save_json(result, args.out, prov)
    for row in result["rows"]:
        print(
            f"{row['entries']:>8} entries  {row['case']:15s} {row['seconds_per_call'] * 1e6:9.1f} us/call "
            f"{row['gb_per_second']:7.1f} GB/s  x{result['geometry']['layers']} layers "
            f"{row['seconds_per_token_all_layers'] * 1e3:7.2f} ms/token  max diff {row['max_abs_difference']:.2e}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
