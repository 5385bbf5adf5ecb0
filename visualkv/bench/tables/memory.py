"""KV and process memory (`bench memory`, scripts/frame_resize_memory.py): full against block-wise over image
sizes, video lengths, the newer families at 4K and hour-scale videos."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from visualkv.bench.tables.format import MIB, family_results, load, matching_results, mib, render, times
from visualkv.bench.tables.measured import BLOCKWISE as BLOCKWISE_CODE
from visualkv.bench.tables.measured import FULL, MEDIA, METHODS, POST_PREFILL, PREFILL, SESSION, paths

BLOCKWISE = "blockwise-snapkv"
LONG_VIDEO_RESULTS = "memory_long_video_tiny-qwen2.5-vl.json"
FRAME_RESIZE_RESULTS = "frame_resize_memory.json"
#: `bench memory --kept-share` sweeps: every method at one kept share, image and video
KEPT_SHARE_RESULTS = "memory_*_kept*.json"


def _image_sweep_columns(data: dict[str, Any]) -> dict[str, str]:
    """The figures of one model's image-size sweep, by the key `kv_memory_over_image_sizes` shows them under."""
    rows, s, budget = data["rows"], data["summary"], data["budget"]
    largest = max(r["size"] for r in rows)
    at = {r["method"]: r for r in rows if r["size"] == largest}
    bw = BLOCKWISE
    over = sorted(
        (r for r in rows if r["method"] == bw and r["visual_tokens"] > budget + (r["block_size"] or 0)),
        key=lambda r: r["size"],
    )
    full = sorted((r for r in rows if r["method"] == "full"), key=lambda r: r["size"])
    bw_growth = [s[m]["rss_growth_over_full_growth"] for m in ("blockwise-keydiff", bw) if m in s]
    return {
        "visual": f"{at['full']['visual_tokens']:,}",
        "peak": " / ".join(mib(at[m]["peak_kv_bytes"]) for m in ("full", "post-snapkv", bw)),
        "final_ratio": times(s[bw]["full_over_final_kv_largest"]),
        "peak_ratio": times(s[bw]["full_over_peak_kv_largest"]),
        "flat": ", ".join(mib(r["peak_kv_bytes"]) for r in over)
        + f" (spread {s[bw].get('peak_kv_spread_over_bound_sizes', 0) * 100:.1f} %)",
        "full_growth": f"{mib(full[0]['peak_kv_bytes'])} → {mib(full[-1]['peak_kv_bytes'])}",
        "bound": f"≤ {s[bw]['peak_over_bound_max']:.2f}" if "peak_over_bound_max" in s[bw] else "not recorded",
        "rss": f"+{s['full']['peak_rss_growth_bytes'] / MIB:.0f} MiB / "
        + " … ".join(f"+{s[m]['peak_rss_growth_bytes'] / MIB:.0f}" for m in ("blockwise-keydiff", bw) if m in s)
        + f" MiB ({min(bw_growth):.2f}–{max(bw_growth):.2f} of full's)",
        "sizes": ", ".join(f"{r['size']:g}" for r in full),
    }


def kv_memory_over_image_sizes(results: Path) -> str:
    """Peak and final KV of full, post-SnapKV and block-wise up to 4K, on the tiny and the bench model."""
    names = ["memory_image_tiny-qwen2.5-vl.json", "memory_image_bench-qwen2.5-vl.json"]
    data = [load(n, results) for n in names]
    cols = [_image_sweep_columns(d) for d in data]
    labels = [
        ("visual tokens at the largest size (4K = 3840×2160)", "visual"),
        ("peak KV at 4K: full / post-snapkv / block-wise", "peak"),
        ("**full / block-wise, final KV at 4K**", "final_ratio"),
        ("**full / block-wise, peak KV at 4K**", "peak_ratio"),
        ("block-wise peak KV over the sizes > M + b", "flat"),
        ("full peak KV, smallest → largest size", "full_growth"),
        ("block-wise peak / ((M + b + protected) × layers)", "bound"),
        ("process peak RSS growth over the sweep: full / block-wise (KeyDiff … SnapKV)", "rss"),
        ("sizes (megapixels)", "sizes"),
    ]
    rows = [[label, cols[0][key], cols[1][key]] for label, key in labels]
    return render(["figure", data[0]["model"], data[1]["model"]], rows, list(zip(names, data)))


def kv_memory_over_video_lengths(results: Path) -> str:
    """Peak and final KV of full and block-wise per video length (1 fps), and the process RSS growth."""
    name = "memory_video_tiny-qwen2.5-vl.json"
    d = load(name, results)
    rows = []
    for size in sorted({r["size"] for r in d["rows"]}):
        at = {r["method"]: r for r in d["rows"] if r["size"] == size}
        bw = at.get("blockwise-snapkv") or at.get("blockwise-keydiff")
        rows.append(
            [
                f"{size:g}",
                f"{at['full']['visual_tokens']:,}",
                mib(at["full"]["peak_kv_bytes"]),
                mib(bw["peak_kv_bytes"]),
                mib(bw["final_kv_bytes"]),
            ]
        )
    s = d["summary"]
    bw_name = "blockwise-snapkv" if "blockwise-snapkv" in s else "blockwise-keydiff"
    note = (
        f"Process peak RSS growth over the sweep: full +{s['full']['peak_rss_growth_bytes'] / MIB:.0f} MiB, "
        f"block-wise +{s[bw_name]['peak_rss_growth_bytes'] / MIB:.0f} MiB "
        f"({s[bw_name]['rss_growth_over_full_growth']:.2f} of full's)."
    )
    header = ["frames (1 fps)", "visual tokens", "full peak KV", "block-wise peak KV", "block-wise final KV"]
    return render(header, rows, [(name, d)], note)


def kv_memory_at_4k_per_family(results: Path) -> str:
    """Peak and final KV at 4K per newer family (tiny aliases), full against block-wise."""
    body, sources = [], []
    for alias, d in family_results(results, "memory_image_{alias}.json", sources):
        at = {r["method"]: r for r in d["rows"] if r["size"] == max(x["size"] for x in d["rows"])}
        full, bw = at["full"], at[BLOCKWISE]
        post = at.get("post-snapkv")
        peaks = " / ".join(mib(r["peak_kv_bytes"]) for r in (full, post, bw) if r is not None)
        body.append(
            [
                alias,
                f"{full['visual_tokens']:,}",
                peaks,
                times(full["peak_kv_bytes"] / bw["peak_kv_bytes"]),
                times(full["final_kv_bytes"] / bw["final_kv_bytes"]),
            ]
        )
    header = ["tiny alias", "visual tokens", "peak KV full / post-snapkv / block-wise", "full / block-wise, peak"]
    return render([*header, "full / block-wise, final"], body, sources)


def _clock_minutes(minutes: float) -> str:
    return f"{minutes:g} min"


def _long_video_row(kind: str, method: str, summary: dict, rows: dict, lengths: list[float]) -> list[str]:
    """One (video kind, method) row: peak KV / peak RSS per length (or why it was refused), then the summary."""
    cells = []
    for m in lengths:
        r = rows.get(m)
        if r is None:
            cells.append("")
        elif "refused" in r:
            cells.append(f"refused ({r['frames']} frames)")
        else:
            cells.append(f"{mib(r['peak_kv_bytes'])} / {r['peak_rss_bytes'] / MIB:.0f} MiB")
    longest = rows[max(summary["measured_minutes"])] if summary.get("measured_minutes") else None
    growth = summary.get("growth_minutes")
    return [
        kind,
        f"`{method}`",
        *cells,
        f"{summary['peak_rss_growth'] * 100:+.1f} %" if growth else "",
        f"{summary['peak_kv_spread'] * 100:.1f} %" if growth else "",
        mib(longest["final_kv_bytes"]) if longest else "",
        f"{longest['visual_tokens']:,}" if longest else "",
        f"{summary['ttft_seconds_per_hour']:.0f} s" if longest else "",
    ]


def memory_over_hour_scale_videos(results: Path) -> str:
    """Hour-scale generated videos (`bench memory --video --minutes`): memory per length, each run in its own
    process; a refused run shows its reason."""
    d = load(LONG_VIDEO_RESULTS, results)
    lengths = sorted({r["minutes"] for r in d["rows"]})
    body = []
    for key, summary in d["summary"].items():
        kind, method = key.split("/", 1)
        rows = {r["minutes"]: r for r in d["rows"] if r["video_kind"] == kind and r["method"] == method}
        body.append(_long_video_row(kind, method, summary, rows, lengths))
    growth_from = d.get("growth_from_minutes") or lengths[0]
    header = ["video", "method", *(f"{_clock_minutes(m)}: peak KV / peak RSS" for m in lengths)]
    header += [
        f"peak RSS growth {_clock_minutes(growth_from)} → {_clock_minutes(lengths[-1])}",
        f"peak KV spread ({_clock_minutes(growth_from)} on)",
        "final KV (longest)",
        "visual tokens (longest)",
        "TTFT per hour of video",
    ]
    note = (
        f"Model `{d['model']}`, M = {d['budget']}, {d['fps']:g} frame per second of 640x360 video; `mix`: static "
        "shots, pans, cuts and a one-second event every two minutes, `moving`: every frame moves (nothing to skip)."
    )
    return render(header, body, [(LONG_VIDEO_RESULTS, d)], note)


def rss_with_frames_resized_at_decode(results: Path) -> str:
    """Peak RSS of a block-wise prefill of a 1080p video: frames at their decoded size against frames resized at
    decode (scripts/frame_resize_memory.py, one fresh process per run)."""
    d = load(FRAME_RESIZE_RESULTS, results)
    body = []
    for model in dict.fromkeys(r["model"] for r in d["rows"]):
        runs = {r["run"]: r for r in d["rows"] if r["model"] == model}
        plain, resized = runs["decoded size"], runs["resized at decode"]
        read = resized["frame_read_by_vision"]
        change = (resized["peak_growth_bytes"] - plain["peak_growth_bytes"]) / plain["peak_growth_bytes"]
        body.append(
            [
                f"`{model}`",
                f"{read[1]}×{read[0]}" + ("" if read != resized["decoded_frame"] else " (not resized)"),
                f"{resized['visual_tokens']:,}",
                f"{resized['per_token_table_bytes_per_visual_token']:.0f} B",
                " / ".join(f"{r['peak_growth_bytes'] / MIB:.0f} MiB" for r in (plain, resized)),
                f"{change * 100:+.0f} %",
            ]
        )
    v = d["video"]
    header = ["model", "frame the vision side reads", "visual tokens", "per-token tables per visual token"]
    header += ["peak RSS growth: decoded size / resized at decode", "change"]
    note = (
        f"`{d['method']}`, M = {d['budget']}, {v['seconds']} s of {v['width']}x{v['height']} video ({v['kind']}: every "
        f"frame pans) at {v['fps']:g} fps, decoded lazily; peak RSS growth over the prefill and the first token, after "
        "a warm-up, in a fresh process per run. *Decoded size*: `resize_video_at_decode` off. Per-token tables: the "
        "prepared input's ids, positions and masks and the layout, text tokens' share included."
    )
    return render(header, body, [(FRAME_RESIZE_RESULTS, d)], note)


def _kept_share_rows(d: dict[str, Any]) -> list[list[str]]:
    """One row per method of a `bench memory --kept-share` sweep, at its largest input."""
    largest = max(r["size"] for r in d["rows"])
    at = {r["method"]: r for r in d["rows"] if r["size"] == largest}
    full, kind = at["full"], "video" if d["video"] else "image"
    size = f"{largest:g} frames" if d["video"] else f"{largest:g} MP"
    body = []
    for method, r in at.items():
        gains = [times(full[k] / r[k]) for k in ("peak_kv_bytes", "final_kv_bytes")]
        label = f"`{method}`" + (" (all tokens below layer K)" if method == "fastv" else "")
        body.append(
            [
                f"{kind}, {size} ({r['visual_tokens']:,} visual tokens)",
                label,
                f"{r['kept_fraction']:.2f}",
                mib(r["peak_kv_bytes"]),
                mib(r["final_kv_bytes"]),
                *gains,
                f"{r['ttft_seconds']:.2f} s",
            ]
        )
    return body


def kv_memory_at_equal_kept_share(results: Path) -> str:
    """Every method at one kept share of the visual tokens (`bench memory --kept-share`), image and video: peak
    and final KV at the largest input, the gain over `full` and TTFT, each run in its own process."""
    body: list[list[str]] = []
    sources: list[tuple[str, dict]] = []
    for _, d in matching_results(results, KEPT_SHARE_RESULTS, sources):
        body += _kept_share_rows(d)
    if not sources:
        raise FileNotFoundError(f"no {KEPT_SHARE_RESULTS} under {results} (bench memory --kept-share writes them)")
    shares = sorted({d["kept_share"] for _, d in sources})
    header = ["input", "method", "kept (measured)", "peak KV", "final KV", "full / method, peak"]
    header += ["full / method, final", "TTFT"]
    note = (
        f"Model `{sources[0][1]['model']}`; each method set to keep "
        + " / ".join(f"{s:.0%}" for s in shares)
        + " of the visual tokens (M = that share of each input's visual tokens for the budget methods, their own "
        "options for the others: `visualkv.bench.needle.kept_share_options`), one fresh process per run. *kept*: "
        "the measured share of visual entries held, mean over layers and heads. `fastv` keeps every visual token "
        "in the layers before K, hence its kept share and peak; `salicache` holds f/2 of the tokens at full "
        "precision, f/2 at INT8 and f at INT4 (the needle benchmark's operating point); `lightkv` runs its one "
        "merge setting; `evs` runs on video only (a still image has no previous frame)."
    )
    return render(header, body, sources, note)


TABLES = {
    "memory-image": kv_memory_over_image_sizes,
    "memory-kept-share": kv_memory_at_equal_kept_share,
    "memory-video": kv_memory_over_video_lengths,
    "families-4k": kv_memory_at_4k_per_family,
    "long-video": memory_over_hour_scale_videos,
    "frame-resize": rss_with_frames_resized_at_decode,
}
VIDEO_MEMORY_CODE = paths(PREFILL, SESSION, FULL, BLOCKWISE_CODE, MEDIA)
#: block name -> the source paths its figures measure (`visualkv.bench.staleness`)
MEASURES = {
    "memory-image": paths(PREFILL, SESSION, FULL, POST_PREFILL, BLOCKWISE_CODE),
    "memory-kept-share": paths(PREFILL, SESSION, METHODS),
    "memory-video": VIDEO_MEMORY_CODE,
    "families-4k": paths(PREFILL, SESSION, FULL, BLOCKWISE_CODE),
    "long-video": VIDEO_MEMORY_CODE,
    "frame-resize": VIDEO_MEMORY_CODE,
}
