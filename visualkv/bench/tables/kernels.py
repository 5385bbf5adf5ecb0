"""Attention kernels on one layer of a 7B shape: a decode step over Sali-Cache's packed tiers
(scripts/packed_decode.py), a block after cached entries (scripts/block_attention.py) and a follow-up question's
mask (scripts/followup_attention.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from visualkv.bench.tables.format import MIB, grouped, load, mib, render, times
from visualkv.bench.tables.measured import PREFILL, SESSION, paths

PACKED_DECODE_RESULTS = "packed_decode_shape-qwen2.5-vl-7b.json"
BLOCK_ATTENTION_RESULTS = ("block_attention_7b_cpu_float32.json", "block_attention_7b_cpu_bfloat16.json")
#: times from a run with glibc's default allocator, memory from one with its mmap threshold pinned (`--pin-mmap`)
FOLLOWUP_ATTENTION_RESULTS = (
    "followup_attention_bench-qwen2.5-vl.json",
    "followup_attention_bench-qwen2.5-vl_pinned.json",
)
#: the decoder weights' bytes in each dtype, over their bytes in bfloat16
WEIGHT_BYTES_OVER_BF16 = {"float32": 2, "bfloat16": 1, "float16": 1}


def _packed_decode_rows(d: dict[str, Any]) -> list[list[str]]:
    """Per dtype and case: KV held, bytes moved and kernels per layer (each over `full`'s), and a whole step's
    bytes with the weights over `full`'s."""
    body = []
    for dtype in dict.fromkeys(r["dtype"] for r in d["rows"]):
        weights = d["decoder_weight_bytes_bf16"] * WEIGHT_BYTES_OVER_BF16[dtype]
        rows = [r for r in d["rows"] if r["dtype"] == dtype]
        full = next(r for r in rows if r["case"] == "full")
        for r in rows:
            step = r["bytes_moved_per_token"] + weights
            difference = r.get("max_abs_difference")
            moved = r["bytes_moved_per_layer"] / full["bytes_moved_per_layer"]
            body.append(
                [
                    dtype,
                    f"`{r['case']}`",
                    mib(r["kv_bytes_held_per_layer"]),
                    f"{r['bytes_moved_per_layer'] / MIB:.1f} MiB ({moved:.2f}×)",
                    f"{r['kernels_per_layer']} ({r['kernels_per_layer'] / full['kernels_per_layer']:.1f}×)",
                    f"{r['cpu_ms_per_layer_median']:.1f}",
                    "n/a" if difference is None else f"{difference:.1e}",
                    times(step / (full["bytes_moved_per_token"] + weights)),
                ]
            )
    return body


def _packed_decode_summary(d: dict[str, Any]) -> str:
    """The bfloat16 (GPU) case in a sentence: Sali-Cache's step against `full`'s, by addcmul and through float32."""
    bf16 = {r["case"]: r for r in d["rows"] if r["dtype"] == "bfloat16"}
    if not {"full", "salicache", "salicache, float32 dequantize"} <= set(bf16):
        return ""
    full, addcmul, chain = bf16["full"], bf16["salicache"], bf16["salicache, float32 dequantize"]
    weights = d["decoder_weight_bytes_bf16"]

    def step(r: dict) -> float:
        return (r["bytes_moved_per_token"] + weights) / (full["bytes_moved_per_token"] + weights)

    def over_full(r: dict, key: str) -> float:
        return r[key] / full[key]

    return (
        f"In bfloat16 a Sali-Cache step's attention moves {over_full(addcmul, 'bytes_moved_per_layer'):.1f}× "
        f"`full`'s bytes in {over_full(addcmul, 'kernels_per_layer'):.1f}× its kernels (dequantizing "
        f"through float32: {over_full(chain, 'bytes_moved_per_layer'):.1f}× in "
        f"{over_full(chain, 'kernels_per_layer'):.1f}×); with the weights, a bandwidth-bound step "
        f"moves {step(addcmul):.2f}× `full`'s bytes ({step(chain):.2f}× through float32)."
    )


def packed_tier_decode_step(results: Path) -> str:
    """One decode step's attention per layer over Sali-Cache's packed tiers, dequantized through float32 and by one
    addcmul per tensor into one buffer (what a step runs), beside `full` (scripts/packed_decode.py)."""
    d = load(PACKED_DECODE_RESULTS, results)
    header = [
        "dtype",
        "case",
        "KV held per layer",
        "bytes its kernels move per layer (vs full)",
        "kernels per layer (vs full)",
        "CPU ms per layer",
        "max abs difference",
        "a step's bytes with the weights, vs full",
    ]
    a, t = d["attention"], d["tiers"]
    note = (
        f"`{d['shape']}`'s attention ({a['kv_heads']} KV heads, {a['query_group']} query heads each, head_dim "
        f"{a['head_dim']}, {a['layers']} layers) over the entries Sali-Cache keeps of a 4K image ({d['visual_tokens']:,} "
        f"visual tokens: {t['full']:,} full precision, {t['int8']:,} INT8, {t['int4']:,} INT4, {t['pruned']:,} pruned; "
        f"`full` holds them all) and {d['text_tokens']} text tokens: one new token's attention in one layer. Bytes: "
        "what the kernels read and write (`OpCounter.bytes_moved`; an operand of another dtype counted once, as a CUDA "
        "kernel casts it as it reads, where a CPU copies it first); the last column adds, over "
        f"{a['layers']} layers, the decoder weights every step reads ({d['decoder_weight_bytes_bf16'] / 1e9:.1f} GB in "
        "bfloat16). bfloat16 is the GPU case; there a step of this size pays a few microseconds per kernel as well as "
        "its bytes, so both are shown. "
        "CPU ms: median of interleaved repeats, one thread, this CPU (bfloat16 matmuls are slow on it). Max abs "
        "difference: from float32 attention over the exact quantized values."
    )
    notes = (n for n in (note, _packed_decode_summary(d)) if n)
    return render(header, _packed_decode_rows(d), [(PACKED_DECODE_RESULTS, d)], *notes)


def block_attention_against_masked(results: Path) -> str:
    """One layer's attention for a block after cached entries: transformers' function with a mask (K/V repeated
    to every query head) against `block_attention` (scripts/block_attention.py), per dtype and case."""
    sources = [(name, load(name, results)) for name in BLOCK_ATTENTION_RESULTS]
    body = []
    for _, d in sources:
        for (q, n_past), rows in grouped(d["rows"], lambda r: (r["q"], r["n_past"])).items():
            stock, ours = (next(r for r in rows if r["kernel"] == k) for k in ("transformers", "visualkv"))
            body.append(
                [
                    d["dtype"],
                    f"{q:,} after {n_past:,}",
                    f"{mib(stock['kv_bytes'])}",
                    f"{stock['transient_bytes'] / MIB:,.1f} → {ours['transient_bytes'] / MIB:,.1f} MiB",
                    f"{stock['median_ms']:,.0f} → {ours['median_ms']:,.0f} ({times(ours['median_ms'] / stock['median_ms'])})",
                    f"{ours['max_abs_diff']:.1e}",
                ]
            )
    geo = sources[0][1]["geometry"]
    header = [
        "dtype",
        "queries after entries",
        "K + V of the layer",
        "transient of one call",
        "ms per call",
        "max abs difference",
    ]
    note = (
        f"`{sources[0][1]['shape']}`'s attention ({geo['heads']} query heads, {geo['kv_heads']} KV heads, head_dim "
        f"{geo['head_dim']}), one layer, random entries: transformers' `sdpa_attention_forward` with the lower-right "
        "bool mask → `block_attention.attend` (this CPU: the same mask with `enable_gqa`). Transient: the "
        "growth of the peak RSS of a fresh process over its inputs for one call. ms: median of 5 interleaved repeats. "
        "1,024 after 1,024 is a block-wise block at M = 1024; 16 after 10,565 / 76,544 a follow-up question over "
        "`full`'s cache of a 4K image / the 512-s video."
    )
    return render(header, body, sources, note)


def followup_mask_against_marker(results: Path) -> str:
    """A follow-up question end to end: a dense mask tensor (transformers' path) against the lower-right marker
    (scripts/followup_attention.py): TTFT from the default run, peak RSS growth from the pinned one."""
    timed, pinned = (load(name, results) for name in FOLLOWUP_ATTENTION_RESULTS)
    cases = (("tensor mask", "tensor mask"), ("lower-right marker", "marker"))
    body = [
        [
            label,
            f"{timed['summary'][case]['entries_per_layer']:,}",
            f"{timed['summary'][case]['followup_ttft_median_s']:.3f} s",
            f"{pinned['summary'][case]['followup_rss_growth_median_bytes'] / MIB:,.1f} MiB",
        ]
        for label, case in cases
    ]
    header = ["follow-up attention", "entries per layer after", "TTFT (median)", "peak RSS growth of the turn (median)"]
    ttft = {case: timed["summary"][case]["followup_ttft_median_s"] for _, case in cases}
    runs = sum(len(r["followup_ttft_s"]) for r in timed["runs"]["marker"])
    note = (
        f"`{timed['model']}`, `{timed['method']}` over a {timed['image']} synthetic image, then {runs} follow-up "
        "questions per case, two sessions alternating in one process (fresh each repeat): the marker's follow-up TTFT "
        f"is {times(ttft['marker'] / ttft['tensor mask'])} of the tensor mask's. The RSS growth comes from a second run "
        "with glibc's mmap threshold pinned at 64 KiB (otherwise glibc serves a turn's transients from memory earlier "
        "turns freed, and neither case shows any); its times are not used (every large allocation then costs fresh "
        "pages)."
    )
    return render(header, body, [(name, d) for name, d in zip(FOLLOWUP_ATTENTION_RESULTS, (timed, pinned))], note)


TABLES = {
    "packed-decode": packed_tier_decode_step,
    "block-attention": block_attention_against_masked,
    "followup-attention": followup_mask_against_marker,
}
#: block name -> the source paths its figures measure (`visualkv.bench.staleness`)
MEASURES = {
    "packed-decode": ("visualkv/attention/packed.py", "visualkv/kv"),
    "block-attention": ("visualkv/attention/block.py",),
    "followup-attention": paths(PREFILL, SESSION),
}
