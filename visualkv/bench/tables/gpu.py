"""`bench gpu` (every method against transformers' `generate` and VisualKV's `full` on one GPU): the run's own
Markdown table and console lines, README's headline, the full table with the targets, and a cold start against a
warmed one. Figures are medians with (min–max) over the repeats; ratios are of medians."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from visualkv.bench import gpu_targets
from visualkv.bench.gpu_targets import GENERATE_ROWS, case_label, input_label, measured, median, stat
from visualkv.bench.tables.format import MIB, load, render, source_line
from visualkv.bench.tables.measured import DECODE, METHODS, PREFILL, SESSION, paths

GPU_RESULTS = "gpu/gpu_shape-qwen2.5-vl-7b.json"
GPU_NO_WARMUP_RESULTS = "gpu/gpu_shape-qwen2.5-vl-7b.no-warmup.json"  # the same bench measured from a cold process
HEADLINE_METHODS = ("generate", "generate-static", "transformers-generate", "full")
HEADLINE_METHODS += ("blockwise-keydiff", "salicache", "lightkv")
SPEED_KEYS = ("ttft_seconds", "decode_tokens_per_second")


# -- the run's own table and console lines ---------------------------------------------------------
def figure_cell(row: dict[str, Any], key: str, digits: int = 2, scale: float = 1.0) -> str:
    """A figure's median, with "(min–max)" after it when it has several repeats ("" when not measured)."""
    figure = stat(row, key)
    if figure is None:
        return ""
    text = f"{figure.median / scale:,.{digits}f}"
    if figure.n > 1:
        text += f" ({figure.lo / scale:,.{digits}f}–{figure.hi / scale:,.{digits}f})"
    return text


def decode_how(row: dict[str, Any]) -> str:
    """ "graph, grouped" (the decode mode and a fixed-shape step's attention), or the generate row's name."""
    return ", ".join(x for x in (row.get("decode_mode"), row.get("decode_attention")) if x) or row["method"]


def console_line(row: dict[str, Any]) -> str:
    """The line `bench gpu` prints as each case finishes."""
    head = f"  {input_label(row):18s} {case_label(row):28s}"
    if "refused" in row:
        return f"{head} refused: {row['refused']}"
    if "error" in row:
        return f"{head} FAILED {row['error']}"
    peak = median(row, "peak_over_weights_bytes")
    peak_txt = f"{peak / 2**20:9.0f} MiB over weights" if peak is not None else "  (no CUDA peak)"
    per_hour = median(row, "ttft_seconds_per_hour")
    return (
        f"{head} TTFT {figure_cell(row, 'ttft_seconds')} s"
        + (f" ({per_hour:.0f} s per hour of video)" if per_hour is not None else "")
        + f"  decode {figure_cell(row, 'decode_tokens_per_second', 1)} tok/s ({decode_how(row)})  {peak_txt}  "
        f"cache peak {row['cache_peak_bytes'] / 2**20:9.1f} MiB"
    )


def _ratio_pair(ratios: dict[str, Any] | None) -> str:
    """ "0.53× / 7.0×": TTFT and decode over a reference ("" without one)."""
    if not ratios or ratios.get("ttft_seconds") is None or ratios.get("decode_tokens_per_second") is None:
        return ""
    return f"{ratios['ttft_seconds']:.2f}× / {ratios['decode_tokens_per_second']:.2f}×"


def _speed_over(row: dict[str, Any], ref: dict[str, Any] | None) -> dict[str, float | None] | None:
    """TTFT and decode medians of `row` over `ref`'s (None without `ref`): for files written before `vs_full`."""
    if ref is None:
        return None
    out = {}
    for key in SPEED_KEYS:
        a, b = median(row, key), median(ref, key)
        out[key] = a / b if a is not None and b else None
    return out


def _limit_shares(row: dict[str, Any]) -> str:
    """ "12% / 41%": TTFT's share of its FLOP floor and decode's of its bandwidth ceiling ("" when unknown)."""
    limits = row.get("limits") or {}
    shares = [limits.get("ttft_share"), limits.get("decode_share")]
    return "" if all(s is None for s in shares) else " / ".join("—" if s is None else f"{s:.0%}" for s in shares)


def _markdown_cells(r: dict[str, Any], full: dict[str, Any] | None, fair: bool, limits: bool) -> list[str]:
    """The cells of one measured row of `markdown_table`."""
    mode = f" ({decode_how(r)})" if r.get("decode_mode") else ""
    # the kernel of the prefill's blocks after the cache (block_attention): rows measured before it have none
    attention = f" ({r['prefill_attention']})" if r.get("prefill_attention") else ""
    memory = (r.get("vs_generate") or {}).get("peak_over_weights_bytes")
    label = f"{input_label(r)} ({r.get('visual_tokens') or '?'} visual tokens)"
    cells = [
        label,
        case_label(r),
        figure_cell(r, "ttft_seconds") + attention,
        figure_cell(r, "ttft_seconds_per_hour", 0),
    ]
    cells += [
        figure_cell(r, "decode_tokens_per_second", 1) + mode,
        figure_cell(r, "peak_over_weights_bytes", 0, 2**20),
    ]
    vs_full = r.get("vs_full") or _speed_over(r, full)  # files before `vs_full`: divided here
    if not fair and r["method"] in GENERATE_ROWS:
        vs_full = None  # a generate row not warmed per shape nor backend-pinned: no speed ratio
    cells += [f"{r['cache_peak_bytes'] / 2**20:,.1f}", _ratio_pair(vs_full)]
    cells += [_ratio_pair(r.get("vs_best_generate"))] if fair else []
    cells += ["" if memory is None else f"{memory:.3f}"] + ([_limit_shares(r)] if limits else [])
    return cells


def markdown_table(result: dict[str, Any]) -> str:
    """The table of one result: one row per (input, case); refused and failed cases say why. A file without a fair
    generate reference (`gpu_targets.fair_reference`) shows no speed ratio against generate."""
    fair = gpu_targets.fair_reference(result)
    limits = any("limits" in r for r in result["cases"])  # files written before the limits have no such column
    columns = ["input", "method", "TTFT s", "TTFT s per hour of video", "decode tok/s", "peak over weights MiB"]
    columns += ["cache peak MiB", "TTFT / decode vs full"]
    columns += ["TTFT / decode vs better generate"] if fair else []
    columns += ["peak / generate"] + (["share of limits: TTFT / decode"] if limits else [])
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    full = {input_label(r): r for r in result["cases"] if r["method"] == "full" and "case" not in r and measured(r)}
    for r in result["cases"]:
        if "refused" in r or "error" in r:
            label = f"{input_label(r)} ({r.get('visual_tokens') or '?'} visual tokens)"
            why = f"refused: {r['refused']}" if "refused" in r else f"failed: {r['error']}"
            lines.append(f"| {label} | {case_label(r)} | {why.replace('|', '/')} |" + " |" * (len(columns) - 3))
            continue
        lines.append("| " + " | ".join(_markdown_cells(r, full.get(input_label(r)), fair, limits)) + " |")
    return "\n".join(lines)


# -- the documents' tables -------------------------------------------------------------------------
def gpu_methods_and_targets(results: Path) -> str:
    """`bench gpu` on shape-qwen2.5-vl-7b: its own table and the GPU targets judged on its rows."""
    d = load(GPU_RESULTS, results)
    notes = [_gpu_runs_note(d), _gpu_limits_note(d)]
    return "\n\n".join(
        [markdown_table(d), gpu_targets.markdown(d), *filter(None, notes), source_line((GPU_RESULTS, d))]
    )


def _gpu_runs_note(d: dict[str, Any]) -> str:
    """How the figures of a `bench gpu` file were taken: versions, warm-up, repeats, attention backend, TTFT."""
    head = (
        f"torch {d['torch']}, transformers {d['transformers']}; the model built in {d['load_seconds']:.1f} s "
        f"({d['weights_bytes'] / 2**30:.2f} GiB of {d['model_info']['dtype']} weights)"
    )
    cfg = d["config"]
    if not cfg.get("sdpa_backends"):
        return (
            f"{head}; every case run once untimed first, on a smaller image ({d['warmup_seconds']:.0f} s); each "
            "figure is one run. This file predates the fair reference rows: its `transformers-generate` row was "
            "not warmed on the measured shapes nor run with a pinned attention backend, so speed is compared with "
            "VisualKV's `full` only (what compression adds); memory is compared with `generate`."
        )
    backends = ", ".join(cfg["sdpa_backends"])
    return (
        f"{head}. Each case ran once untimed on its own input ({d['warmup_seconds']:.0f} s in all, transformers' "
        f"compile of the static decode included), then {cfg['repeats']} times: each figure is the median "
        f"(min–max), each ratio one of medians. SDPA backends pinned for every row: {backends}. TTFT: "
        f"{cfg['ttft']}."
    )


def _gpu_limits_note(d: dict[str, Any]) -> str:
    """What the share-of-limits column divides by (only in files that carry limits)."""
    peak = d.get("device_peaks")
    if "work" not in d:
        return ""
    if not peak:
        return "Share of limits: no peak figures for this device (`visualkv/bench/device_peaks.py`)."
    return (
        f"Share of limits: TTFT against the FLOPs of the vision tower and the LLM prefill at "
        f"{peak['bf16_flops_per_second'] / 1e12:,.0f} TFLOP/s dense bf16, decode against "
        f"{d['work']['decode_bytes_per_token'] / 2**30:.2f} GiB of weights read per token at "
        f"{peak['memory_bytes_per_second'] / 1e12:.2f} TB/s ({peak['source']}; what is counted: "
        "`visualkv/bench/limits.py`)."
    )


def headline_memory_and_speed(results: Path) -> str:
    """README's headline: on one GPU and a 7B shape, what each method holds beside transformers' own `generate`,
    and how soon it answers and how fast it decodes beside VisualKV's `full` (what compression adds) and, in a file
    with fair reference rows, beside the better of `generate` and `generate-static` (from `bench gpu`'s JSON)."""
    d = load(GPU_RESULTS, results)
    fair = gpu_targets.fair_reference(d)
    full = {r["input"]: r for r in d["cases"] if case_label(r) == "full" and measured(r)}
    body = []
    for row in d["cases"]:
        if case_label(row) not in HEADLINE_METHODS or not measured(row):
            continue
        what = "4K image" if row["input"] == "image" else f"{row['video_seconds']:g}-s video"
        cells = [f"{what} ({row['visual_tokens']:,} visual tokens)", f"`{row['method']}`", _headline_peak(row)]
        if fair or row["method"] not in GENERATE_ROWS:
            cells += [_headline_speed(row, full.get(row["input"]), key, fair) for key in SPEED_KEYS]
        else:
            cells += ["— (not a fair speed reference: below)"] * 2
        body.append(cells)
    header = ["input", "method", "GPU peak over the weights (vs generate)"]
    if fair:
        header += ["time to first token, s (vs full; vs better generate)", "decode tok/s (vs full; vs better generate)"]
    else:
        header += ["time to first token, s (vs full)", "decode tok/s (vs full)"]
    return render(header, body, [(GPU_RESULTS, d)], _headline_note(d, fair))


def _headline_peak(row: dict[str, Any]) -> str:
    ratio = (row.get("vs_generate") or {}).get("peak_over_weights_bytes")
    peak = median(row, "peak_over_weights_bytes")
    return f"{peak / MIB:,.0f} MiB ({ratio:.3f}×)" if peak is not None and ratio is not None else "—"


def _headline_speed(row: dict[str, Any], full: dict[str, Any] | None, key: str, fair: bool) -> str:
    """The median (min–max) of `key`, then its median over `full`'s (and over the better generate's, in a fair
    file)."""
    a, b = median(row, key), median(full, key)
    ratios = [a / b if a is not None and b else None]
    if fair:
        ratios.append((row.get("vs_best_generate") or {}).get(key))
    shown = "; ".join("—" if r is None else f"{r:.2f}×" for r in ratios)
    return f"{figure_cell(row, key, 2 if key == 'ttft_seconds' else 0)} ({shown})"


def _headline_note(d: dict[str, Any], fair: bool) -> str:
    cfg, info = d["config"], d["model_info"]
    head = (
        f"`{cfg['model']}`: {info['layers']} decoder layers, {info['kv_heads']} KV heads, the released configuration "
        f"with random {info['dtype']} weights (memory and speed only; answers are noise), on {d['machine']}; torch "
        f"{d['torch']}, transformers {d['transformers']}. Budget M = {cfg['budget']} visual entries per layer and KV "
        f"head, {cfg['new_tokens']} new tokens, the CUDA peak reset before each case; `generate` is transformers' "
        "own processor and `model.generate`."
    )
    if fair:
        how = (
            f" Each case ran once untimed on its own input, then {cfg['repeats']} times: median (min–max); SDPA "
            f"backends pinned for every row ({', '.join(cfg['sdpa_backends'])}); `generate-static` is "
            '`model.generate(..., cache_implementation="static")`. TTFT: ' + cfg["ttft"] + "."
        )
    else:
        how = (
            " Each figure is one run. The `transformers-generate` speed reference in this file was not warmed on "
            "the measured shapes nor run with a pinned attention backend, so speed is stated against VisualKV's "
            "`full` (what compression adds) and memory against `generate`."
        )
    return head + how + " Every method and variant: docs/RESULTS.md."


def cold_against_warmed_start(results: Path) -> str:
    """The first cases of a cold process pay one-off CUDA costs: the same bench without and with the warm-up."""
    cold, warm = load(GPU_NO_WARMUP_RESULTS, results), load(GPU_RESULTS, results)

    def rows(d: dict[str, Any]) -> dict[str, dict]:
        return {(r["input"], r.get("case", r["method"])): r for r in d["cases"] if "ttft_seconds" in r}

    cold_rows, warm_rows = rows(cold), rows(warm)
    body = []
    for key, c in list(cold_rows.items())[:3]:  # the first three cases ran cold; later ones were warm anyway
        w = warm_rows[key]
        body.append(
            [
                f"{key[0]}, {key[1]}",
                f"{c['ttft_seconds']:.2f} s",
                f"{w['ttft_seconds']:.2f} s",
                f"{c['decode_tokens_per_second']:.1f}",
                f"{w['decode_tokens_per_second']:.1f}",
            ]
        )
    header = ["first cases of the run", "TTFT cold", "TTFT warmed up", "decode tok/s cold", "warmed up"]
    return render(header, body, [(GPU_NO_WARMUP_RESULTS, cold), (GPU_RESULTS, warm)])


TABLES = {
    "headline": headline_memory_and_speed,
    "gpu": gpu_methods_and_targets,
    "gpu-warmup": cold_against_warmed_start,
}
GPU_CODE = paths(PREFILL, DECODE, SESSION, METHODS)
#: block name -> the source paths its figures measure (`visualkv.bench.staleness`)
MEASURES = {
    "headline": GPU_CODE,
    "gpu": GPU_CODE,
    "gpu-warmup": GPU_CODE,
}
