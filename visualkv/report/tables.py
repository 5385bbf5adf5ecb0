"""The numbers panel and summary line of a report, as text (Markdown-safe where it quotes the media)."""

from __future__ import annotations

import re
from typing import Any

from visualkv.report.memory_chart import MIB
from visualkv.report.timeline import frames_sentence


def mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / MIB:.2f} MiB"


def decode_speed(turn: dict[str, Any]) -> str:
    """Tokens per second of a turn's answer, "n/a" when it had fewer than two tokens (no rate to measure);
    "(CUDA graph)" when its steps were replayed as one (visualkv.runtime.static_decode), "(CUDA graph, grouped attention)"
    when that graph attended its window with the grouped matmuls."""
    speed = turn.get("decode_tokens_per_second") or 0
    if not (speed > 0 and len(turn.get("token_ids") or []) > 1):
        return "n/a"
    if turn.get("decode_mode") != "graph":
        return f"{speed:.1f} tokens/s"
    grouped = ", grouped attention" if turn.get("decode_attention") == "grouped" else ""
    return f"{speed:.1f} tokens/s (CUDA graph{grouped})"


def summary_line(report: dict[str, Any]) -> str:
    """One line of what the compression saved: visual tokens, the budget (a keep share with the figure it
    became), peak and final KV against the full cache, how many times less, and the time to the first token of
    the last turn."""
    full = report.get("full_kv_bytes") or 0
    peak, final = report.get("peak_kv_bytes") or 0, report.get("final_kv_bytes") or 0
    turn = (report.get("turns") or [{}])[-1]
    parts = [
        f"{report.get('visual_tokens', 0)} visual tokens{budget_words(report)}",
        f"KV peak {mib(peak)} · final {mib(final)} vs full {mib(full)}",
    ]
    if full and peak:
        ratio = full / peak
        parts.append(f"{ratio:.1f}× less at peak" if ratio >= 1.05 else "no saving (the full cache)")
    ttft = turn.get("ttft_seconds")
    parts.append(f"TTFT {ttft:.2f} s" if ttft is not None else "TTFT n/a")
    if report.get("evidence_recall") is not None:
        parts.append(f"evidence recall {report['evidence_recall']:.1%}")
    return " · ".join(parts) + media_warnings_line(report)


def budget_words(report: dict[str, Any]) -> str:
    """ ", keep 10 % = budget 74 per layer and KV head", ", budget 256 per layer and KV head", or "" (no budget)."""
    budget, keep = report.get("budget"), report.get("keep")
    if not budget:
        return ""
    share = f"keep {keep * 100:g} % = " if keep else ""
    return f", {share}budget {budget:,} per layer and KV head"


#: media warnings the summary line quotes; the rest are counted (all of them are in the report)
SUMMARY_WARNINGS = 2


def md_literal(text: str) -> str:
    """`text` shown literally inside Markdown (file names and messages carry underscores, stars, brackets)."""
    return re.sub(r"([\\`*_\[\]<>#|])", r"\\\1", text)


def media_warnings_line(report: dict[str, Any]) -> str:
    """The media's warnings (first frame only read, undecodable frames stood in for, values stretched) as a
    Markdown line to append to the summary, file names shown literally: "" when there are none."""
    found = list((report.get("media") or {}).get("warnings") or [])
    if not found:
        return ""
    more = len(found) - SUMMARY_WARNINGS
    tail = f" (+{more} more in the report's media.warnings)" if more > 0 else ""
    return "\n\n⚠️ " + "; ".join(md_literal(w) for w in found[:SUMMARY_WARNINGS]) + tail


#: what each kernel of a prefill block after the cache means to a reader (visualkv.attention.block)
PREFILL_ATTENTION = {
    "flash": "flash kernel, lower-right causal (no K/V copy)",
    "gqa": "SDPA with grouped-query heads (no K/V copy)",
    "stock": "transformers' SDPA (K/V repeated per query head)",
}


def prefill_attention(turn: dict[str, Any]) -> str:
    """The kernels a turn's prefill blocks after the cache ran, in words; "none (one block)" when none had one."""
    kernels = [k for k in (turn.get("prefill_attention") or "").split(",") if k]
    return "; ".join(PREFILL_ATTENTION.get(k, k) for k in kernels) or "none (one block, no cache before it)"


def summary_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) rows of the numbers panel for the last turn of a report."""
    full = report.get("full_kv_bytes") or 0

    def vs_full(n: int | None) -> str:
        return mib(n) + (f" ({100 * n / full:.1f}% of full)" if full and n is not None else "")

    turn = (report.get("turns") or [{}])[-1]
    rows = [
        ("model", str(report.get("model"))),
        ("method", str(report.get("method"))),
        ("budget (visual entries / layer / KV head)", str(report.get("budget") or "none")),
        ("block size / prefill", f"{report.get('block_size')} / {report.get('prefill')}"),
        ("visual tokens", str(report.get("visual_tokens", 0))),
        ("prefill blocks", str(len(report.get("blocks") or []))),
        ("peak KV", vs_full(report.get("peak_kv_bytes"))),
        ("final KV (after last turn)", vs_full(report.get("final_kv_bytes"))),
        ("full KV (uncompressed, same tokens)", mib(full)),
        ("TTFT (last turn)", f"{turn.get('ttft_seconds', 0):.2f} s"),
        ("decode speed", decode_speed(turn)),
        ("attention after the cache (last turn's prefill)", prefill_attention(turn)),
        ("peak process RSS", mib(report.get("peak_rss_bytes"))),
    ]
    if report.get("cuda_peak_bytes"):
        rows.append(("peak CUDA allocated", mib(report["cuda_peak_bytes"])))
    if report.get("frames"):
        skipped = sum(bool(f.get("skipped")) for f in report["frames"])
        rows.append(("video frames sampled / skipped", f"{len(report['frames'])} / {skipped}"))
        rows.append(("what became of the frames", frames_sentence(report)))
    if report.get("tiers"):
        rows.append(("tiers", ", ".join(f"{k} {v}" for k, v in report["tiers"].items())))
    if report.get("layer_tokens"):
        toks = [r.get("tokens", 0) for r in report["layer_tokens"]]
        rows.append(("tokens per layer (first / last)", f"{toks[0]} / {toks[-1]}"))
    return rows
