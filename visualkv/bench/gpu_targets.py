"""The GPU targets judged on `bench gpu` results (`visualkv.bench.gpu`), and how its rows are read.

A figure is a number (one run) or ``{"median", "min", "max", "n"}`` over repeats; `stat` reads either. Time
targets compare a method with the better of the two `generate` rows on the same input; a result without pinned
SDPA backends has no fair reference and is never judged. Verdicts: met (worst repeat meets the target against
the reference's best), within noise (only the medians do), not met, not measured. Each target is named in
`_input_verdicts`, `_method_verdicts` and `_hour_verdicts`; docs/RESULTS.md#on-a-gpu shows them judged.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

GENERATE = "generate"  # transformers' processor + model.generate, as a user calls it
GENERATE_STATIC = "generate-static"  # the same with cache_implementation="static"
LEGACY_GENERATE = "transformers-generate"  # the `generate` row's name in files written before the static one
GENERATE_ROWS = (GENERATE, GENERATE_STATIC, LEGACY_GENERATE)
REFERENCE_ROWS = (*GENERATE_ROWS, "full")  # the rows every compressed method is stated against
BLOCKWISE = ("blockwise-keydiff", "blockwise-snapkv")
HOUR_METHODS = ("blockwise-keydiff", "blockwise-keydiff+salicache")
GIB = 2**30
MET, NOISE, NOT_MET, NOT_MEASURED, UNFAIR = "met", "within noise", "not met", "not measured", "no fair reference"


class Stat(NamedTuple):
    """One figure over the repeats (a one-run figure: all three equal, n = 1)."""

    median: float
    lo: float
    hi: float
    n: int


def stats(values: list[float | None]) -> dict[str, Any] | None:
    """`{"median", "min", "max", "n"}` of the repeats' values (None when any is None: not measured here)."""
    if not values or any(v is None for v in values):
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def stat(row: dict[str, Any] | None, key: str) -> Stat | None:
    """`row[key]` as a Stat, from a number or a repeats dict (None: missing, or the row has no figures)."""
    value = row.get(key) if measured(row) else None
    if value is None:
        return None
    if isinstance(value, dict):
        return Stat(value["median"], value["min"], value["max"], value["n"])
    return Stat(value, value, value, 1)


def median(row: dict[str, Any] | None, key: str) -> float | None:
    figure = stat(row, key)
    return None if figure is None else figure.median


def fair_reference(result: dict[str, Any]) -> bool:
    """Whether the result's `generate` rows were warmed on the measured shapes with the attention backend pinned."""
    return bool((result.get("config") or {}).get("sdpa_backends"))


@dataclass(frozen=True)
class Verdict:
    """One target on one case: the median ratio (or size), the worst repeats' one, the limit and the verdict."""

    target: str
    input: str
    case: str
    measured: float | None  # medians
    worst: float | None  # the method's worst repeat against the reference's best
    limit: float | None
    verdict: str  # MET, NOISE, NOT_MET, NOT_MEASURED, UNFAIR ("" for a figure only recorded)
    unit: str = "x"  # "x": a ratio; "GiB"; "s/h" (recorded, no limit)


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


def best_generate(rows: list[dict[str, Any]], key: str, higher_is_better: bool) -> dict[str, Any] | None:
    """The `generate` row (dynamic or static cache) with the better median `key` on one input's rows."""
    found = [r for r in rows if r["method"] in GENERATE_ROWS and not _variant(r) and median(r, key) is not None]
    if not found:
        return None
    pick = max if higher_is_better else min
    return pick(found, key=lambda r: median(r, key))


def judge(a: Stat | None, b: Stat | None, limit: float, at_most: bool) -> tuple[float | None, float | None, str]:
    """(median ratio, worst-case ratio, verdict) of a / b against `limit` (`at_most`: a / b <= limit; else >=).
    Worst case: a's worst repeat against b's best (for <=: a's max over b's min)."""
    if a is None or b is None or not b.median or not b.lo or not b.hi:
        return None, None, NOT_MEASURED
    ratio = a.median / b.median
    worst = a.hi / b.lo if at_most else a.lo / b.hi
    holds = (lambda x: x <= limit) if at_most else (lambda x: x >= limit)
    return ratio, worst, MET if holds(worst) else NOISE if holds(ratio) else NOT_MET


def _peak_ratio(a, b, limit: float) -> tuple[float | None, float | None, str]:
    return judge(stat(a, "peak_over_weights_bytes"), stat(b, "peak_over_weights_bytes"), limit, at_most=True)


class _Judge:
    """The verdicts of one input's rows (`fair`: its `generate` rows may be compared for time)."""

    def __init__(self, label: str, rows: list[dict[str, Any]], fair: bool) -> None:
        self.label, self.rows, self.fair = label, rows, fair
        self.full = _find(rows, "full")
        self.ttft_ref = best_generate(rows, "ttft_seconds", higher_is_better=False)
        self.decode_ref = best_generate(rows, "decode_tokens_per_second", higher_is_better=True)

    def verdict(self, target, row, judged, limit, unit: str = "x", method: str = "") -> Verdict:
        case = case_label(row) if row else f"{method} (not run)"
        return Verdict(target, self.label, case, judged[0], judged[1], limit, judged[2], unit)

    def vs_generate(self, target, row, key: str, limit: float, at_most: bool, method: str = "") -> Verdict:
        """`row`'s `key` against the better generate's (no fair reference: not judged)."""
        ref = self.ttft_ref if key == "ttft_seconds" else self.decode_ref
        judged = judge(stat(row, key), stat(ref, key), limit, at_most)
        if not self.fair and measured(row):
            judged = (None, None, UNFAIR)
        return self.verdict(target, row, judged, limit, method=method)


def _input_verdicts(label: str, rows: list[dict[str, Any]], hour: bool, fair: bool) -> Iterator[Verdict]:
    j = _Judge(label, rows, fair)
    video = rows[0]["input"] == "video"
    if hour:  # past every frame cap only the bounded methods run: sizes, no reference to divide by
        yield from _hour_verdicts(j)
        return
    for method in BLOCKWISE:
        for forced, ahead in ((False, False), (True, False), (False, True)):
            row = _find(rows, method, forced, ahead)
            if row is None and (forced or ahead):
                continue  # not run (bench gpu --forced-blockwise / --vision-ahead N add them)
            target = "block-wise TTFT <= 1.10x the better generate"
            yield j.vs_generate(target, row, "ttft_seconds", 1.10, at_most=True, method=method)
        row = _find(rows, method)
        limit = 1 / 50 if video else 1 / 5
        target = f"block-wise CUDA peak <= 1/{round(1 / limit)} of full's"
        yield j.verdict(target, row, _peak_ratio(row, j.full, limit), limit, method=method)
    for row in rows:
        if row["method"] in REFERENCE_ROWS or _variant(row):
            continue
        yield j.vs_generate("decode tok/s >= 2x the better generate", row, "decode_tokens_per_second", 2.0, False)
        judged = judge(stat(row, "decode_tokens_per_second"), stat(j.full, "decode_tokens_per_second"), 1.0, False)
        yield j.verdict("decode tok/s >= full's", row, judged, 1.0)
    yield from _method_verdicts(j, video, rows[0].get("video_kind"))


def _method_verdicts(j: _Judge, video: bool, kind: str | None) -> Iterator[Verdict]:
    sali = _find(j.rows, "salicache")
    if video and kind in ("mix", "moving") and sali is not None:
        limit = 1.0 if kind == "mix" else 1.25
        target = f"Sali-Cache TTFT <= {limit:.2f}x the better generate ({kind} video)"
        yield j.vs_generate(target, sali, "ttft_seconds", limit, at_most=True)
        yield j.verdict("Sali-Cache CUDA peak <= full's", sali, _peak_ratio(sali, j.full, 1.0), 1.0)
    light = _find(j.rows, "lightkv")
    if not video and light is not None:
        yield j.vs_generate("LightKV TTFT <= 0.75x the better generate at 4K", light, "ttft_seconds", 0.75, True)


def _hour_verdicts(j: _Judge) -> Iterator[Verdict]:
    one_gib = Stat(GIB, GIB, GIB, 1)
    for method in HOUR_METHODS:
        row = _find(j.rows, method)
        judged = judge(stat(row, "peak_over_weights_bytes"), one_gib, 1.0, at_most=True)
        yield j.verdict("CUDA peak over weights <= 1 GiB on an hour", row, judged, 1.0, "GiB", method)
        per_hour = median(row, "ttft_seconds_per_hour")
        yield j.verdict("TTFT per hour of video (recorded)", row, (per_hour, None, ""), None, "s/h", method)


def evaluate(result: dict[str, Any]) -> list[Verdict]:
    """Every target that `result` (one `bench gpu` run) bears on, with its verdict. A video of an hour or more is
    judged on the hour's memory target; any other input on the others."""
    out: list[Verdict] = []
    fair = fair_reference(result)
    for label, rows in _by_input(result["cases"]):
        hour = rows[0]["input"] == "video" and rows[0]["video_seconds"] >= 3600
        out.extend(_input_verdicts(label, rows, hour, fair))
    return out


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "—"
    if unit == "GiB":
        return f"{value:.2f} GiB"
    if unit == "s/h":
        return f"{value:,.0f} s per hour"
    return f"{value:.3f}×" if value < 0.1 else f"{value:.2f}×"


def _limit(v: Verdict) -> str:
    if v.limit is None:
        return ""
    return ("≥ " if ">=" in v.target else "≤ ") + _fmt(v.limit, v.unit)


def markdown(result: dict[str, Any], verdicts: list[Verdict] | None = None) -> str:
    """The targets table of one result: medians, the worst repeats' figure and the verdict."""
    verdicts = evaluate(result) if verdicts is None else verdicts
    lines = ["| target | input | case | median | worst repeat | limit | verdict |", "|" + " --- |" * 7]
    for v in verdicts:
        target = re.sub(r"(\d)x\b", r"\1×", v.target.replace("<=", "≤").replace(">=", "≥"))
        verdict = f"**{v.verdict}**" if v.verdict == NOT_MET else v.verdict
        lines.append(
            f"| {target} | {v.input} | {v.case} | {_fmt(v.measured, v.unit)} | {_fmt(v.worst, v.unit)} | "
            f"{_limit(v)} | {verdict} |"
        )
    notes = []
    if not fair_reference(result):
        notes.append(
            "No fair reference: this file's `generate` row was not warmed on the measured shapes nor run with a "
            "pinned attention backend, so no time target against it is judged."
        )
    if result.get("machine", "").startswith("CPU"):
        notes.append("Measured on CPU: these verdicts are not the GPU targets' (CUDA peaks are not measured).")
    return "\n".join(lines + [line for note in notes for line in ("", note)])


def as_json(verdicts: list[Verdict]) -> list[dict[str, Any]]:
    return [asdict(v) for v in verdicts]
