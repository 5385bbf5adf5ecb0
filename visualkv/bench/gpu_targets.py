"""The GPU speed and memory targets, judged on `bench gpu` results (`visualkv.bench.gpu`).

Each target is a ratio or a size read from the rows of one input (ratios are against transformers' own
`generate` on the same input, measured in the same process). A target whose figure is missing (no CUDA peak on
a CPU run, a refused or failed row, a method or input not run) is "not measured", never met. The verdicts are
for the machine the result names: on CPU they say nothing about the GPU targets (`bench gpu` marks them so).

Targets:
- block-wise TTFT <= 1.10x `generate` at 4K and on the long video, hybrid plan and forced block-wise;
- decode tokens/s after any compressing method >= 2x `generate`'s, and >= `full`'s, on every input;
- Sali-Cache TTFT <= 1.0x on the `mix` video (static shots, pans and cuts, like the bundled example video) and
  <= 1.25x on the `moving` one (nothing can be skipped), its CUDA peak no higher than `full`'s;
- LightKV TTFT <= 0.75x at 4K;
- block-wise CUDA peak over the weights <= 1/5 of `full`'s at 4K and <= 1/50 on the long video;
- on an hour of video, CUDA peak over the weights <= 1 GiB for block-wise KeyDiff and the composed
  pipeline (TTFT per hour of video is recorded beside it).
Decode rows also give the fraction of the weight-bandwidth limit reached: tokens/s x weight bytes over the
GPU's memory bandwidth, for the GPUs listed in `BANDWIDTH` (a decode step reads every weight once).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

REFERENCE = "transformers-generate"  # the reference row of `bench gpu` (visualkv.bench.gpu uses this name)
BLOCKWISE = ("blockwise-keydiff", "blockwise-snapkv")
HOUR_METHODS = ("blockwise-keydiff", "blockwise-keydiff+salicache")
GIB = 2**30
#: memory bandwidth (bytes/s) by a substring of the CUDA device name, from the vendors' data sheets
BANDWIDTH = {"H200": 4.8e12, "H100 SXM": 3.35e12, "H100 PCIe": 2.0e12, "A100": 2.0e12, "L4": 0.3e12, "A10G": 0.6e12}


@dataclass(frozen=True)
class Verdict:
    """One target on one case: the measured figure, the limit, and whether it holds (None: not measured)."""

    target: str
    input: str
    case: str
    measured: float | None
    limit: float | None
    met: bool | None
    unit: str = "x"  # "x": a ratio; "GiB"; "s/h" (informational, no limit)


def input_label(row: dict[str, Any]) -> str:
    """ "image", or "video mix, 3600 s" for a video row."""
    if row["input"] != "video":
        return row["input"]
    return f"video {row['video_kind']}, {row['video_seconds']:g} s"


def case_label(row: dict[str, Any]) -> str:
    """The method, or "blockwise-keydiff (blockwise forced)" / "… (vision ahead 4)" / "full (decode attention
    model)" for a variant row."""
    return row.get("case", row["method"])


def measured(row: dict[str, Any] | None) -> bool:
    """A row with figures (not missing, refused or failed)."""
    return row is not None and "error" not in row and "refused" not in row


def _ratio(row: dict[str, Any] | None, key: str) -> float | None:
    return (row.get("vs_generate") or {}).get(key) if measured(row) else None


def _at_most(value: float | None, limit: float) -> bool | None:
    return None if value is None else value <= limit


def _at_least(value: float | None, limit: float) -> bool | None:
    return None if value is None else value >= limit


def _by_input(cases: list[dict[str, Any]]) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    for label in dict.fromkeys(input_label(r) for r in cases):
        yield label, [r for r in cases if input_label(r) == label]


def _find(rows: list[dict[str, Any]], method: str, forced: bool = False, ahead: bool = False) -> dict[str, Any] | None:
    """The method's row: its default, its forced block-wise variant or its vision-ahead variant."""
    return next(
        (
            r
            for r in rows
            if r["method"] == method
            and ("forced_prefill" in r) == forced
            and ("vision_ahead" in r) == ahead
            and "forced_decode_attention" not in r
        ),
        None,
    )


def _variant(row: dict[str, Any]) -> bool:
    """A forced-plan, vision-ahead or decode-attention row beside a method's default row."""
    return "forced_prefill" in row or "vision_ahead" in row or "forced_decode_attention" in row


def _peak_over(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float | None:
    """a's CUDA peak over the weights divided by b's (None without both)."""
    if not (measured(a) and measured(b)) or a["peak_over_weights_bytes"] is None or not b["peak_over_weights_bytes"]:
        return None
    return a["peak_over_weights_bytes"] / b["peak_over_weights_bytes"]


def _input_verdicts(label: str, rows: list[dict[str, Any]], hour: bool) -> Iterator[Verdict]:
    video = rows[0]["input"] == "video"
    kind = rows[0].get("video_kind")
    full = _find(rows, "full")

    def v(target: str, row, measured, limit, met, unit: str = "x", method: str = "") -> Verdict:
        return Verdict(target, label, case_label(row) if row else f"{method} (not run)", measured, limit, met, unit)

    if hour:  # past every frame cap, only the bounded methods run; no reference to divide by
        for method in HOUR_METHODS:
            row = _find(rows, method)
            peak = row["peak_over_weights_bytes"] / GIB if measured(row) and row["peak_over_weights_bytes"] else None
            yield v("CUDA peak over weights <= 1 GiB on an hour", row, peak, 1.0, _at_most(peak, 1.0), "GiB", method)
            per_hour = row.get("ttft_seconds_per_hour") if measured(row) else None
            yield v("TTFT per hour of video (recorded)", row, per_hour, None, None, "s/h", method)
        return
    for method in BLOCKWISE:
        for forced, ahead in ((False, False), (True, False), (False, True)):
            row = _find(rows, method, forced, ahead)
            if row is None and (forced or ahead):
                continue  # not run (bench gpu --forced-blockwise / --vision-ahead N add them)
            ratio = _ratio(row, "ttft_seconds")
            yield v("block-wise TTFT <= 1.10x generate", row, ratio, 1.10, _at_most(ratio, 1.10), method=method)
        row = _find(rows, method)
        limit = 1 / 50 if video else 1 / 5
        share = _peak_over(row, full)
        target = f"block-wise CUDA peak <= 1/{round(1 / limit)} of full's"
        yield v(target, row, share, limit, _at_most(share, limit), method=method)
    for row in rows:
        if row["method"] in (REFERENCE, "full") or _variant(row):
            continue
        ratio = _ratio(row, "decode_tokens_per_second")
        yield v("decode tok/s >= 2x generate after compression", row, ratio, 2.0, _at_least(ratio, 2.0))
        vs_full = None
        if measured(row) and measured(full) and full["decode_tokens_per_second"]:
            vs_full = row["decode_tokens_per_second"] / full["decode_tokens_per_second"]
        yield v("decode tok/s >= full's", row, vs_full, 1.0, _at_least(vs_full, 1.0))
    sali = _find(rows, "salicache")
    if video and kind in ("mix", "moving") and sali is not None:
        limit = 1.0 if kind == "mix" else 1.25
        ratio = _ratio(sali, "ttft_seconds")
        yield v(f"Sali-Cache TTFT <= {limit:.2f}x generate ({kind} video)", sali, ratio, limit, _at_most(ratio, limit))
        share = _peak_over(sali, full)
        yield v("Sali-Cache CUDA peak <= full's", sali, share, 1.0, _at_most(share, 1.0))
    light = _find(rows, "lightkv")
    if not video and light is not None:
        ratio = _ratio(light, "ttft_seconds")
        yield v("LightKV TTFT <= 0.75x generate at 4K", light, ratio, 0.75, _at_most(ratio, 0.75))


def evaluate(result: dict[str, Any]) -> list[Verdict]:
    """Every target that `result` (one `bench gpu` run) bears on, with its verdict. A video of an hour or more is
    judged on the hour's memory target; any other input on the speed and memory ratios."""
    out: list[Verdict] = []
    for label, rows in _by_input(result["cases"]):
        hour = rows[0]["input"] == "video" and rows[0]["video_seconds"] >= 3600
        out.extend(_input_verdicts(label, rows, hour))
    return out


def bandwidth_fraction(result: dict[str, Any], tokens_per_second: float) -> float | None:
    """tokens/s x weight bytes / the GPU's memory bandwidth (None for a GPU not in `BANDWIDTH`, or on CPU)."""
    machine = result.get("machine", "")
    bandwidth = next((bw for name, bw in BANDWIDTH.items() if name in machine), None)
    if bandwidth is None or not result.get("weights_bytes"):
        return None
    return tokens_per_second * result["weights_bytes"] / bandwidth


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "not measured"
    if unit == "GiB":
        return f"{value:.2f} GiB"
    if unit == "s/h":
        return f"{value:,.0f} s per hour"
    return f"{value:.3f}×" if value < 0.1 else f"{value:.2f}×"


def _limit(v: Verdict) -> str:
    if v.limit is None:
        return ""
    return ("≥ " if ">=" in v.target else "≤ ") + _fmt(v.limit, v.unit)


VERDICT_WORDS: dict[bool | None, str] = {True: "met", False: "**not met**", None: "not measured"}


def markdown(result: dict[str, Any], verdicts: list[Verdict] | None = None) -> str:
    """The targets table of one result, then the decode rows' share of the weight-bandwidth limit."""
    verdicts = evaluate(result) if verdicts is None else verdicts
    lines = ["| target | input | case | measured | limit | verdict |", "|" + " --- |" * 6]
    for v in verdicts:
        target = re.sub(r"(\d)x\b", r"\1×", v.target.replace("<=", "≤").replace(">=", "≥"))
        verdict = "" if v.unit == "s/h" else VERDICT_WORDS[v.met]
        lines.append(f"| {target} | {v.input} | {v.case} | {_fmt(v.measured, v.unit)} | {_limit(v)} | {verdict} |")
    shares = _bandwidth_lines(result)
    if not result.get("machine", "").startswith("CPU") and not shares:
        shares = ["Weight-bandwidth share: this GPU is not in `gpu_targets.BANDWIDTH`."]
    if result.get("machine", "").startswith("CPU"):
        shares = ["Measured on CPU: these verdicts are not the GPU targets' (CUDA peaks are not measured)."]
    return "\n".join(lines + ([""] + shares if shares else []))


def _bandwidth_lines(result: dict[str, Any]) -> list[str]:
    parts = []
    for row in result["cases"]:
        if not measured(row) or not row.get("decode_tokens_per_second"):
            continue
        share = bandwidth_fraction(result, row["decode_tokens_per_second"])
        if share is not None:
            parts.append(
                f"{input_label(row)} / {case_label(row)}: {row['decode_tokens_per_second']:.0f} tok/s = {share:.0%}"
            )
    if not parts:
        return []
    return [
        "Decode as a share of the weight-bandwidth limit (tokens/s × weight bytes / bandwidth): " + "; ".join(parts)
    ]


def as_json(verdicts: list[Verdict]) -> list[dict[str, Any]]:
    return [asdict(v) for v in verdicts]
