"""Accuracy on the public benchmarks (`python -m visualkv eval`): every committed ``summary.json`` under
``docs/results/eval/<run>/``, one row per run, method and budget, with its breakdowns."""

from __future__ import annotations

from pathlib import Path

from visualkv.bench.tables.format import load, mib, render
from visualkv.bench.tables.gpu import GPU_CODE
from visualkv.bench.tables.measured import DECODE, METHODS, PREFILL, SESSION, paths
from visualkv.runtime.frame_cap import FULL_FRAME_CAP, is_bounded

EVAL_FOLDER = "eval"


def _groups(entry: dict) -> str:
    return "; ".join(
        f"{group}: " + ", ".join(f"{value or '-'} {s['accuracy'] * 100:.0f} %" for value, s in values.items())
        for group, values in entry["by_group"].items()
    )


def eval_summaries(results: Path) -> str:
    """One row per (run, method, budget): items, the benchmark's own average, KV held, accuracy per group."""
    names = sorted(p.relative_to(results).as_posix() for p in (results / EVAL_FOLDER).glob("*/summary.json"))
    data = [(name, load(name, results)) for name in names]
    rows = []
    for _, d in data:
        for e in d["results"]:
            rows.append(
                [
                    d["benchmark"] + (f" {d['subset']}" if d.get("subset") else ""),
                    f"`{d['model']}`, {d['prompt']} prompt",
                    e["method"],
                    str(e["budget"] or "—"),
                    str(e["n"]),
                    f"{e['accuracy'] * 100:.1f} %",
                    mib(e["mean_peak_kv_bytes"]),
                    mib(e["mean_final_kv_bytes"]),
                    _groups(e),
                ]
            )
    header = ["benchmark", "model", "method", "budget", "n", "accuracy", "peak KV", "final KV", "per group"]
    note = (
        "Accuracy is each benchmark's own average (Video-MME, V*Bench: over questions; MLVU: M-avg over tasks; "
        "HR-Bench: over cycle categories); KV is the mean per question, peak during the prefill and held after it."
    )
    return render(header, rows, data, note)


GPU_RUN = "gpu/gpu_shape-qwen2.5-vl-7b.json"
#: (item, frames of the bench's 512-frame video it costs, or None for the bench's image), for `eval_estimates`
ESTIMATE_ITEMS = (
    ("a video item at --max-frames 64", 64),
    ("a 30-minute video at 1 fps (Video-MME long, MLVU)", 1800),
    ("an image of ~10.5k visual tokens (HR-Bench 4K)", None),
)
ESTIMATE_METHODS = ("full", "blockwise-keydiff", "blockwise-snapkv")
ANSWER_TOKENS = 16


def eval_estimates(results: Path) -> str:
    """Seconds per eval item estimated from `bench gpu`'s speeds: the prefill's TTFT scaled linearly with the
    frames (from its 512-frame video) or taken from its 4K image, plus 16 answer tokens at its decode speed."""
    d = load(GPU_RUN, results)
    cases = {}
    for c in d["cases"]:
        cases.setdefault((c["input"], c["method"]), c)  # the first of a method's rows: without vision-ahead
    frames = d["videos"][0]["frames"]
    rows = []
    for label, n_frames in ESTIMATE_ITEMS:
        cells = []
        for method in ESTIMATE_METHODS:
            case = cases.get(("image" if n_frames is None else "video", method))
            if n_frames and n_frames > FULL_FRAME_CAP and not is_bounded(method):
                cells.append(f"refused (over its {FULL_FRAME_CAP}-frame cap)")
                continue
            if case is None or not case.get("ttft_seconds"):
                cells.append("—")
                continue
            prefill = case["ttft_seconds"] * (1 if n_frames is None else n_frames / frames)
            cells.append(f"{prefill + ANSWER_TOKENS / case['decode_tokens_per_second']:.1f} s")
        rows.append([label, *cells])
    note = (
        f"Estimates, not measurements of `eval`: {d['config']['model']} (random weights, the 7B's shapes) on "
        f"{(d.get('provenance') or {}).get('gpu') or 'a GPU'}; the video's TTFT is scaled linearly from its "
        f"{frames}-frame {d['config']['video_size'][0]}x{d['config']['video_size'][1]} video (full attention grows "
        "faster than linearly, so `full` on long videos is underestimated), plus 16 answer tokens. No H100 run is "
        "committed yet; a real `eval` run's `seconds` per line replaces these."
    )
    return render(["item", *ESTIMATE_METHODS], rows, [(GPU_RUN, d)], note)


TABLES = {"eval-summaries": eval_summaries, "eval-estimates": eval_estimates}
#: block name -> the source paths its figures measure (`visualkv.bench.staleness`)
MEASURES = {
    "eval-summaries": paths(("visualkv/eval",), PREFILL, DECODE, SESSION, METHODS),
    "eval-estimates": GPU_CODE,
}
