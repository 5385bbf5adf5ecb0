"""Plotly figures and PIL overlays built from telemetry (no gradio import).

Everything here reads a report dict (see `ChatSession.report`) or benchmark
rows, so the app, the CLI and the benches draw the same numbers. Overlays are
drawn on a downscaled copy of the media (`max_side`), so a 4K image or a long
video costs a few hundred kilobytes to show, not the full resolution.

Views of method-specific fields (Sali-Cache `saliency` / `tier` / frame
`motion`; LightKV `merge_map` / `layer_tokens`) return None when the report
has no such field; `has_*` helpers say which views apply to a report.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Sequence
from typing import Any

import numpy as np
import plotly.graph_objects as go
from PIL import Image, ImageDraw, ImageFont

from visualkv.report.clock import clock, video_read
from visualkv.report.telemetry import CUT_SHORT

MIB = 2**20
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}

#: Okabe-Ito qualitative palette (distinguishable under the common colour-vision deficiencies).
OKABE_ITO = {
    "blue": (0, 114, 178),
    "orange": (230, 159, 0),
    "green": (0, 158, 115),
    "vermillion": (213, 94, 0),
    "sky": (86, 180, 233),
    "purple": (204, 121, 167),
    "yellow": (240, 228, 66),
    "black": (0, 0, 0),
}

#: Sali-Cache precision tiers, in display order: (name, label, RGB colour).
TIERS: tuple[tuple[str, str, tuple[int, int, int]], ...] = (
    ("full", "FP16 (full)", OKABE_ITO["green"]),
    ("int8", "INT8", OKABE_ITO["blue"]),
    ("int4", "INT4", OKABE_ITO["orange"]),
    ("pruned", "pruned", (60, 60, 60)),
    ("skipped", "skipped frame", OKABE_ITO["purple"]),
)
KEPT_COLOUR, SKIPPED_COLOUR = OKABE_ITO["blue"], OKABE_ITO["vermillion"]  # kept / skipped video frames

#: Perceptually uniform, colour-blind-safe sequential maps (matplotlib's), as 9 evenly spaced anchors.
COLOUR_MAPS = {
    "viridis": (
        (68, 1, 84),
        (71, 44, 122),
        (59, 81, 139),
        (44, 113, 142),
        (33, 144, 141),
        (39, 173, 129),
        (92, 200, 99),
        (170, 220, 50),
        (253, 231, 37),
    ),
    "inferno": (
        (0, 0, 4),
        (31, 12, 72),
        (85, 15, 109),
        (136, 34, 106),
        (186, 54, 85),
        (227, 89, 51),
        (249, 140, 10),
        (249, 201, 50),
        (252, 255, 164),
    ),
}
KEEP_CMAP, SALIENCY_CMAP = "viridis", "inferno"


def colour_map(values: np.ndarray, name: str = KEEP_CMAP) -> np.ndarray:
    """RGB (float, 0-255) of values in [0, 1] under a sequential map; shape values.shape + (3,)."""
    anchors = np.asarray(COLOUR_MAPS[name], dtype=np.float32)
    pos = np.clip(np.nan_to_num(values), 0, 1) * (len(anchors) - 1)
    low = np.floor(pos).astype(np.int64).clip(0, len(anchors) - 2)
    frac = (pos - low)[..., None]
    return anchors[low] * (1 - frac) + anchors[low + 1] * frac


_TIER_ALIASES = {"fp16": "full", "bf16": "full", "fp32": "full", "prune": "pruned", "skip": "skipped"}
_TIER_BY_INT = ("full", "int8", "int4", "pruned", "skipped")  # visualkv.media.saliency.TIER_* order


# -- memory ------------------------------------------------------------------------------------


def kv_bytes_per_token(report: dict[str, Any]) -> int | None:
    """Bytes one full-precision token takes in the KV cache (all layers, K and V), from model_info."""
    info = report.get("model_info") or {}
    try:
        return int(info["layers"]) * 2 * int(info["kv_heads"]) * int(info["head_dim"]) * DTYPE_BYTES[info["dtype"]]
    except (KeyError, TypeError, ValueError):
        return None


def budget_kv_bytes(report: dict[str, Any]) -> int | None:
    """KV bytes of `budget` visual entries per layer and KV head (protected text comes on top)."""
    per_token = kv_bytes_per_token(report)
    budget = report.get("budget")
    return int(budget) * per_token if budget and per_token else None


def block_axis(total: int) -> dict[str, Any]:
    """An x axis of prefill blocks 1..total: integer ticks (at most ~10 of them), half a block of margin."""
    total = max(int(total), 1)
    return {
        "title": "prefill block",
        "range": [0.5, total + 0.5],
        "tick0": 1,
        "dtick": max(1, -(-total // 10)),
        "tickformat": "d",
    }


VIDEO_READ = "video read"  # name of the memory chart's annotation saying how far into a video the prefill is


def block_memory_figure(
    report: dict[str, Any],
    budget_bytes: int | None = None,
    n_blocks: int | None = None,
    show_rss: bool = True,
    media_duration: float | None = None,
) -> go.Figure:
    """KV MiB after each prefill block, in two panels so no series hides another.

    Left panel ("the cache against its budget", linear MiB): "KV cache (held)" (one point per
    block), "KV peak so far", "budget" (M entries per layer and head; `budget_bytes` overrides
    the value from the report). Its y range is set by these three only, so they stay apart
    however large the full cache is.
    Right panel ("against the full cache", log MiB): "full cache (so far)" (the tokens read so far
    at full precision: what an uncompressed cache would hold after each block; left out when the
    method kept some input from the LLM, e.g. skipped frames), "full cache" (the uncompressed cache
    of the whole conversation, once `full_kv_bytes` is known), the held cache again, and
    "process RSS" (the whole process, same unit, so no second axis).
    `n_blocks` fixes the x range while blocks are still arriving.
    For a video, the blocks' `media_seconds` say how far into it each block had read: shown in the hover
    text of every point and in one line over both panels (the annotation named `VIDEO_READ`: "video: 12:30
    of 1:00:00 read"); `media_duration` (default: the report's media duration) is the whole video's length.
    """
    from plotly.subplots import make_subplots

    blocks = report.get("blocks", [])
    total = n_blocks or (blocks[-1].get("n_blocks") if blocks else 0) or len(blocks)
    x = list(range(1, len(blocks) + 1))
    span = [0.5, max(total, 1) + 0.5]
    single = len(blocks) <= 1  # one block: draw markers big enough to read, no line to draw
    held = [b["kv_bytes"] / MIB for b in blocks]
    duration = media_duration or (report.get("media") or {}).get("duration")
    read = [video_read(b.get("media_seconds"), duration) for b in blocks]
    hover = [f"block {k}" + (f" · video {r}" if r else "") for k, r in zip(x, read)]
    fig = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.55, 0.45],
        horizontal_spacing=0.14,
        subplot_titles=("the cache against its budget (MiB)", "against the full cache (MiB, log)"),
    )
    blue, purple, vermillion, grey = "#0072B2", "#CC79A7", "#D55E00", "#7f7f7f"
    fig.add_trace(
        go.Scatter(
            x=x,
            y=held,
            mode="lines+markers",
            name="KV cache (held)",
            legendgroup="held",
            line={"color": blue, "width": 3},
            marker={"size": 10 if single else 6},
        ),
        row=1,
        col=1,
    )
    fig.add_trace(
        go.Scatter(
            x=x,
            y=[b["peak_kv_bytes"] / MIB for b in blocks],
            mode="lines+markers",
            name="KV peak so far",
            line={"dash": "dot", "color": purple, "width": 2},
            marker={"symbol": "triangle-up", "size": 9 if single else 6},
        ),
        row=1,
        col=1,
    )
    budget_bytes = budget_bytes or budget_kv_bytes(report)
    if budget_bytes:
        fig.add_trace(
            go.Scatter(
                x=span,
                y=[budget_bytes / MIB] * 2,
                mode="lines",
                name="budget",
                line={"dash": "dash", "color": vermillion, "width": 2},
            ),
            row=1,
            col=1,
        )
    per_token = kv_bytes_per_token(report)
    tokens_read = np.cumsum([b["tokens_in"] for b in blocks]) if blocks else np.zeros(0)
    # The growing line is honest only when every input token went through the LLM (no frame skipped,
    # no patch pruned before it): then tokens read = what an uncompressed cache would hold so far.
    complete = report.get("prompt_tokens") in (None, int(tokens_read[-1]) if len(tokens_read) else 0)
    if per_token and blocks and complete:
        fig.add_trace(
            go.Scatter(
                x=x,
                y=list(tokens_read * per_token / MIB),
                mode="lines+markers",
                name="full cache (so far)",
                line={"dash": "dot", "color": grey},
                marker={"symbol": "square", "size": 8 if single else 5},
            ),
            row=1,
            col=2,
        )
    if report.get("full_kv_bytes"):
        fig.add_trace(
            go.Scatter(
                x=span,
                y=[report["full_kv_bytes"] / MIB] * 2,
                mode="lines",
                name="full cache",
                line={"dash": "dash", "color": "black", "width": 2},
            ),
            row=1,
            col=2,
        )
    fig.add_trace(
        go.Scatter(
            x=x,
            y=held,
            mode="lines+markers",
            name="KV cache (held)",
            legendgroup="held",
            showlegend=False,
            line={"color": blue, "width": 3},
            marker={"size": 10 if single else 6},
        ),
        row=1,
        col=2,
    )
    if show_rss and blocks and blocks[0].get("rss_bytes"):
        fig.add_trace(
            go.Scatter(
                x=x,
                y=[b["rss_bytes"] / MIB for b in blocks],
                mode="lines+markers",
                name="process RSS",
                line={"color": "#009E73", "width": 1, "dash": "dashdot"},
                marker={"symbol": "diamond", "size": 7 if single else 4},
            ),
            row=1,
            col=2,
        )
    fig.update_xaxes(**block_axis(total))
    if any(read):  # a video: how far the prefill has read, in time as well as blocks
        fig.update_traces(hovertext=hover, selector={"mode": "lines+markers"})
        # one line over both panels: in each axis title it was wider than its panel, and the two overlapped
        fig.add_annotation(
            text=f"video: {next(r for r in reversed(read) if r)}",
            name=VIDEO_READ,
            xref="paper",
            yref="paper",
            x=1.0,
            y=1.0,
            yshift=28,
            showarrow=False,
            xanchor="right",  # clear of the app's label over the chart's top left corner
            yanchor="bottom",
        )
    fig.update_yaxes(rangemode="tozero", row=1, col=1)
    left = [v for v in [*held, *(b["peak_kv_bytes"] / MIB for b in blocks), (budget_bytes or 0) / MIB] if v]
    if left:  # headroom above the highest of held / peak / budget, so the lines never sit on the frame
        fig.update_yaxes(range=[0, max(left) * 1.15], row=1, col=1)
    fig.update_yaxes(type="log", row=1, col=2)
    fig.update_layout(
        # the top band holds the app's label of the chart (top left) and a video's progress (top right)
        margin={"l": 50, "r": 20, "t": 62, "b": 40},
        height=362,
        legend={"orientation": "h", "y": -0.3},
        font={"size": 12},
    )
    fig.update_annotations(font={"size": 12})
    return fig


def memory_sweep_figure(rows: list[dict[str, Any]], size_label: str) -> go.Figure:
    """Peak KV MiB and peak process RSS against input size, one line per method."""
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("peak KV cache (MiB)", "peak process RSS (MiB)"))
    palette = ("#636efa", "#ef553b", "#00cc96", "#ab63fa", "#ffa15a", "#19d3f3", "#ff6692")
    for k, method in enumerate(dict.fromkeys(r["method"] for r in rows)):
        rs = sorted((r for r in rows if r["method"] == method), key=lambda r: r["size"])
        xs = [r["size"] for r in rs]
        # one colour per method in both panels; dashes tell overlapping lines apart
        line = {"color": palette[k % len(palette)], "dash": ("solid", "dash", "dot", "dashdot")[k % 4]}
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=[r["peak_kv_bytes"] / MIB for r in rs],
                name=method,
                mode="lines+markers",
                legendgroup=method,
                line=line,
            ),
            row=1,
            col=1,
        )
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=[r["peak_rss_bytes"] / MIB for r in rs],
                name=method,
                mode="lines+markers",
                legendgroup=method,
                showlegend=False,
                line=line,
            ),
            row=1,
            col=2,
        )
    fig.update_xaxes(title_text=size_label)
    fig.update_layout(height=420, width=1000)
    return fig


def save_figure(fig: go.Figure, stem: str) -> list[str]:
    """Write stem.html and, where a Chromium is available for kaleido, stem.png."""
    saved = [stem + ".html"]
    fig.write_html(saved[0], include_plotlyjs="cdn")
    browser = os.environ.get("BROWSER_PATH") or shutil.which("chromium") or shutil.which("chromium-browser")
    if browser:
        os.environ.setdefault("BROWSER_PATH", browser)
        try:
            fig.write_image(stem + ".png")
            saved.append(stem + ".png")
        except Exception as exc:  # noqa: BLE001 - PNG export is optional
            print(f"note: PNG export skipped ({type(exc).__name__}: {str(exc)[:120]})")
    return saved


# -- which views apply -------------------------------------------------------------------------


def is_video(report: dict[str, Any]) -> bool:
    return (report.get("media") or {}).get("kind") == "video" or bool(report.get("frames"))


def has_saliency(report: dict[str, Any]) -> bool:
    return bool(report.get("saliency")) or bool(report.get("tier"))


def has_merge_map(report: dict[str, Any]) -> bool:
    return bool(report.get("merge_map")) or bool(report.get("layer_tokens"))


def has_motion(report: dict[str, Any]) -> bool:
    return any("motion" in f for f in report.get("frames") or [])


# -- token overlays ----------------------------------------------------------------------------


def retained_heatmap(
    image: np.ndarray, report: dict[str, Any], max_side: int = 960, layer: int | None = None, opacity: float = 0.6
) -> Image.Image:
    """Overlay the keep fraction of each visual token on a downscaled image (viridis: dark evicted,
    yellow kept; no colour bar, see `retained_view` for one).

    layer: None = averaged over layers (`retained`), else that layer of `retained_per_layer`.
    Uses the layout's token boxes; where several tiles/frames cover the same pixels (SmolVLM's
    global thumbnail), the maximum is shown.
    """
    return _token_overlay(image, report, _retained_values(report, layer), max_side, alpha=opacity)


def _retained_values(report: dict[str, Any], layer: int | None) -> np.ndarray:
    if layer is not None and report.get("retained_per_layer"):
        return np.asarray(report["retained_per_layer"][layer], dtype=np.float32)
    return np.asarray(report.get("retained", []), dtype=np.float32)


KEEP_BAR_TITLE = "share of each token's KV entries kept (over layers and KV heads)"


def retained_view(
    frames: Sequence[np.ndarray],
    times: Sequence[float] | None,
    report: dict[str, Any],
    layer: int | None = None,
    max_side: int = 960,
    opacity: float = 0.6,
    colour_bar: bool = True,
    frame_ids: Sequence[int] | None = None,
) -> Image.Image:
    """Kept-token view for any media: the viridis overlay on an image; a strip of frame thumbnails for
    video (`frame_ids`: which layout frames, default `shown_frames`); a colour bar underneath. `opacity`
    0 draws the media alone, with the same size and colour bar (the "before" side of a before/after
    comparison)."""
    values = _retained_values(report, layer)
    if _layout_is_video(report):
        body = _frame_strip(
            frames,
            times,
            report,
            lambda img, f: _token_overlay(img, report, values, 240, {f}, alpha=opacity),
            frame_ids,
        )
    else:
        body = _image_panels(
            frames[0],
            report,
            lambda img, flt, side: _token_overlay(img, report, values, side, flt, alpha=opacity),
            max_side,
        )
    return _with_colour_bar(body, KEEP_CMAP, KEEP_BAR_TITLE) if colour_bar else body


def saliency_view(
    frames: Sequence[np.ndarray],
    times: Sequence[float] | None,
    report: dict[str, Any],
    max_side: int = 960,
    frame_ids: Sequence[int] | None = None,
) -> Image.Image | None:
    """Sali-Cache saliency per token (inferno: dark = background, bright = salient) with a colour bar;
    None without `saliency`."""
    values = _saliency_values(report)
    if values is None:
        return None
    if _layout_is_video(report):
        body = _frame_strip(
            frames,
            times,
            report,
            lambda img, f: _token_overlay(img, report, values, 240, {f}, cmap=SALIENCY_CMAP),
            frame_ids,
        )
    else:
        body = _image_panels(
            frames[0],
            report,
            lambda img, flt, side: _token_overlay(img, report, values, side, flt, SALIENCY_CMAP),
            max_side,
        )
    return _with_colour_bar(body, SALIENCY_CMAP, "saliency (0 = background, 1 = most salient)", percent=False)


def _saliency_values(report: dict[str, Any]) -> np.ndarray | None:
    if not report.get("saliency"):
        return None
    # null = never computed (a token of a skipped frame): drawn as background
    return np.nan_to_num(np.array([np.nan if v is None else v for v in report["saliency"]], dtype=np.float32))


def tier_view(
    frames: Sequence[np.ndarray],
    times: Sequence[float] | None,
    report: dict[str, Any],
    max_side: int = 960,
    frame_ids: Sequence[int] | None = None,
) -> Image.Image | None:
    """Sali-Cache tier per token (FP16 / INT8 / INT4 / pruned / skipped) with a legend; None without `tier`."""
    if not report.get("tier"):
        return None
    names = _tier_names(report)
    colours = np.array([_tier_colour(n) for n in names], dtype=np.float32)
    if _layout_is_video(report):
        body = _frame_strip(
            frames, times, report, lambda img, f: _token_paint(img, report, colours, 240, {f}), frame_ids
        )
    else:
        body = _image_panels(
            frames[0], report, lambda img, flt, side: _token_paint(img, report, colours, side, flt), max_side
        )
    counts = report.get("tiers") or {n: names.count(n) for n in dict.fromkeys(names)}
    return _with_legend(body, [(label, colour, counts.get(name)) for name, label, colour in TIERS])


def _tier_names(report: dict[str, Any]) -> list[str]:
    return [tier_name(t, report.get("tier_names")) for t in report["tier"]]


def _layout_frame_captions(report: dict[str, Any]) -> list[str]:
    frames = (report.get("layout") or {}).get("frames", [])
    if not _layout_is_video(report):
        return ["image" for _ in frames[:1]]
    return [f"frame {f + 1}/{len(frames)} · t={info.get('time') or 0.0:.1f}s" for f, info in enumerate(frames)]


def _frame_source(frames: Sequence[np.ndarray], times: Sequence[float] | None, info: dict[str, Any]) -> np.ndarray:
    """The media frame a layout frame was made from (its first source frame, else the nearest in time)."""
    sources = [i for i in info.get("source_frames") or [] if i < len(frames)]
    if sources:
        return frames[sources[0]]
    media_times = list(times) if times is not None and len(times) == len(frames) else list(range(len(frames)))
    t = info.get("time") or 0.0
    return frames[int(np.argmin([abs(mt - t) for mt in media_times]))] if media_times else frames[0]


def saliency_gallery(
    frames: Sequence[np.ndarray],
    times: Sequence[float] | None,
    report: dict[str, Any],
    max_side: int = 640,
    frame_ids: Sequence[int] | None = None,
) -> list[tuple[Image.Image, str]] | None:
    """Saliency per frame (one large, captioned image each, with its colour bar), for a zoomable
    gallery of the layout frames `frame_ids` (default `shown_frames`); None without `saliency`."""
    values = _saliency_values(report)
    if values is None:
        return None
    token_frame = np.asarray((report.get("layout") or {}).get("token_frame", []), dtype=np.int64)
    captions = _layout_frame_captions(report)
    items = []
    for f in _frame_ids(len(captions), frame_ids):
        caption = captions[f]
        img = _gallery_item(
            frames,
            times,
            report,
            f,
            lambda im, flt, side: _token_overlay(im, report, values, side, flt, cmap=SALIENCY_CMAP),
            max_side,
        )
        mine = values[: len(token_frame)]
        if _layout_is_video(report):
            mine = mine[token_frame[: len(values)] == f]
        mean = f" · mean saliency {float(mine.mean()):.2f}" if mine.size else ""
        items.append(
            (
                _with_colour_bar(img, SALIENCY_CMAP, "saliency (0 = background, 1 = most salient)", percent=False),
                caption + mean,
            )
        )
    return items


def tier_gallery(
    frames: Sequence[np.ndarray],
    times: Sequence[float] | None,
    report: dict[str, Any],
    max_side: int = 640,
    frame_ids: Sequence[int] | None = None,
) -> list[tuple[Image.Image, str]] | None:
    """The precision tier of every token, one large image per frame with that frame's tier counts in
    its legend and caption, for a zoomable gallery of the layout frames `frame_ids` (default
    `shown_frames`); None without `tier`."""
    if not report.get("tier"):
        return None
    names = _tier_names(report)
    colours = np.array([_tier_colour(n) for n in names], dtype=np.float32)
    token_frame = np.asarray((report.get("layout") or {}).get("token_frame", []), dtype=np.int64)[: len(names)]
    name_array = np.asarray(names[: len(token_frame)], dtype=object)
    captions = _layout_frame_captions(report)
    items = []
    for f in _frame_ids(len(captions), frame_ids):
        caption = captions[f]
        counts = {name: 0 for name, _, _ in TIERS}
        mask = token_frame == f if _layout_is_video(report) else slice(None)  # an image: all its tiles
        mine, n = np.unique(name_array[mask].astype(str), return_counts=True)
        counts.update({str(k): int(v) for k, v in zip(mine, n, strict=True)})
        img = _gallery_item(
            frames, times, report, f, lambda im, flt, side: _token_paint(im, report, colours, side, flt), max_side
        )
        legend = [(label, colour, counts.get(name, 0)) for name, label, colour in TIERS]
        text = ", ".join(f"{label} {counts.get(name, 0)}" for name, label, _ in TIERS if counts.get(name))
        items.append((_with_legend(img, legend), f"{caption} · {text}"))
    return items


def tier_name(tier: Any, names: Sequence[str] | None = None) -> str:
    """Canonical tier name for a report's tier value (an int code, decoded by the report's
    `tier_names` when given, else visualkv.media.saliency's TIER_* order; or a name)."""
    if isinstance(tier, int | np.integer):
        table = names or _TIER_BY_INT
        tier = table[int(tier)] if 0 <= int(tier) < len(table) else str(tier)
    name = str(tier).lower()
    return _TIER_ALIASES.get(name, name)


def _hex(rgb: tuple[int, int, int]) -> str:
    return "#{:02x}{:02x}{:02x}".format(*rgb)


def _tier_colour(name: str) -> tuple[int, int, int]:
    for key, _, colour in TIERS:
        if key == name:
            return colour
    return (200, 200, 200)


def merge_view(
    frames: Sequence[np.ndarray],
    times: Sequence[float] | None,
    report: dict[str, Any],
    max_side: int = 960,
    frame_ids: Sequence[int] | None = None,
) -> Image.Image | None:
    """LightKV merge map: tokens merged into a neighbour are darkened; the kept tokens that absorbed
    them are coloured by how many tokens they now stand for (yellow few, red many); tokens untouched
    are left as they are. None without `merge_map`."""
    merge = report.get("merge_map")
    if not merge:
        return None
    target = np.asarray(merge, dtype=np.int64)
    own = target == np.arange(len(target))
    sizes = np.bincount(target, minlength=len(target))
    biggest = max(int(sizes.max()), 2)
    colours = np.full((len(target), 3), np.nan, dtype=np.float32)
    colours[~own] = MERGED_COLOUR
    absorbing = own & (sizes > 1)
    level = (sizes[absorbing] - 2) / max(biggest - 2, 1)  # 0 = a group of 2 (yellow), 1 = the largest (red)
    colours[absorbing] = np.stack([np.full_like(level, 255), 230 * (1 - level), np.zeros_like(level)], axis=1)
    if _layout_is_video(report):
        body = _frame_strip(
            frames, times, report, lambda img, f: _token_paint(img, report, colours, 240, {f}), frame_ids
        )
    else:
        body = _image_panels(
            frames[0], report, lambda img, flt, side: _token_paint(img, report, colours, side, flt), max_side
        )
    return _with_legend(body, merge_legend(report))


def merge_legend(report: dict[str, Any]) -> list[tuple[str, tuple[int, int, int], int]]:
    """(label, colour, tokens) of the merge map: exactly the colours `merge_view` draws (dark merged,
    the yellow end of the ramp for a group of 2, its red end for the largest group)."""
    target = np.asarray(report.get("merge_map") or [], dtype=np.int64)
    own = target == np.arange(len(target))
    sizes = np.bincount(target, minlength=len(target))
    biggest = max(int(sizes.max()) if len(sizes) else 2, 2)
    group = sizes[own & (sizes > 1)]
    entries = [
        ("merged into a neighbour", MERGED_COLOUR, int((~own).sum())),
        ("kept, standing for 2 tokens", (255, 230, 0), int((group == 2).sum())),
    ]
    if biggest > 2:
        entries.append(
            (f"kept, standing for 3 to {biggest} tokens (yellow to red)", (255, 0, 0), int((group > 2).sum()))
        )
    return entries


MERGED_COLOUR = (40, 40, 40)


def _image_panels(image: np.ndarray, report: dict[str, Any], draw, max_side: int) -> Image.Image:
    """An image's token view, `draw(image, frame_filter, max_side)`: every tile's tokens over that tile's box.
    A thumbnail frame ("global": SmolVLM's and InternVL's thumbnail, LLaVA-OneVision's base image) has tokens
    of its own that cover the whole image; drawn on top they would hide the tiles' (a kept thumbnail token
    over an evicted tile token), so they get a panel of their own beside, on a copy a third the size."""
    frames = (report.get("layout") or {}).get("frames", [])
    thumbs = {f for f, info in enumerate(frames) if info.get("kind") == "global"}
    if not thumbs or len(thumbs) == len(frames):
        return draw(image, None, max_side)
    main = draw(image, set(range(len(frames))) - thumbs, max_side)
    thumb = draw(image, thumbs, max(1, max(main.size) // 3))
    return _grid([main, thumb], ["tiles", "thumbnail: its own tokens, whole image"])


def _gallery_item(frames, times, report: dict[str, Any], f: int, draw, max_side: int) -> Image.Image:
    """Layout frame `f` of a video on its media frame; an image as a whole (tiles + thumbnail panel)."""
    if not _layout_is_video(report):
        return _image_panels(frames[0], report, draw, max_side)
    layout_frames = (report.get("layout") or {}).get("frames", [])
    return draw(_frame_source(frames, times, layout_frames[f]), {f}, max_side)


#: Frames drawn at most in a strip, gallery or thumbnail sheet (evenly spaced over a longer video).
MAX_FRAMES_SHOWN = 24


def shown_frames(n: int, limit: int = MAX_FRAMES_SHOWN) -> list[int]:
    """Indices of at most `limit` of `n` frames, evenly spaced, the first and the last included."""
    if n <= limit:
        return list(range(n))
    return sorted(set(np.linspace(0, n - 1, max(limit, 1)).round().astype(int).tolist()))


def _frame_ids(n: int, frame_ids: Sequence[int] | None) -> list[int]:
    return shown_frames(n) if frame_ids is None else [int(f) for f in frame_ids if 0 <= int(f) < n]


def _layout_is_video(report: dict[str, Any]) -> bool:
    frames = (report.get("layout") or {}).get("frames", [])
    return any(f.get("kind") == "frame" for f in frames)


def _token_boxes(report: dict[str, Any], scale: float, frame_filter: set[int] | None):
    """Yield (visual token index, (row slice, col slice)) on the downscaled canvas.

    Cell edges are the layout's own (`layout.grid_boxes`: linspace over the frame's box, rounded), so at
    scale 1 a token covers exactly its layout box and neighbouring tokens (and tiles) share edges."""
    layout = report.get("layout") or {}
    frames = layout.get("frames", [])
    token_frame = np.asarray(layout.get("token_frame", []), dtype=np.int64)
    rows, cols = layout.get("token_row", []), layout.get("token_col", [])
    # the tokens of the wanted frames, found at once (a long video has ~10^5 tokens, a strip ~20 frames)
    wanted = (
        range(len(token_frame))
        if frame_filter is None
        else np.flatnonzero(np.isin(token_frame, list(frame_filter))).tolist()
    )
    edges: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # frame -> pixel edges of its columns and rows
    for i in wanted:
        f = int(token_frame[i])
        if f not in edges:
            x0, y0, x1, y1 = frames[f]["box"]
            gr, gc = frames[f]["grid"]
            xs, ys = np.linspace(x0, x1, gc + 1), np.linspace(y0, y1, gr + 1)
            edges[f] = (np.round(np.round(xs) * scale).astype(int), np.round(np.round(ys) * scale).astype(int))
        xs, ys = edges[f]
        c, r = cols[i], rows[i]
        yield i, (slice(ys[r], max(ys[r] + 1, ys[r + 1])), slice(xs[c], max(xs[c] + 1, xs[c + 1])))


def _downscale(image: np.ndarray, max_side: int) -> tuple[Image.Image, float]:
    h, w = image.shape[:2]
    scale = min(1.0, max_side / max(h, w))
    small = (
        Image.fromarray(image)
        .convert("RGB")
        .resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.Resampling.BILINEAR)
    )
    return small, scale


def _token_overlay(
    image: np.ndarray,
    report: dict[str, Any],
    values: np.ndarray,
    max_side: int,
    frame_filter: set[int] | None = None,
    cmap: str = KEEP_CMAP,
    alpha: float = 0.6,
) -> Image.Image:
    """Each token's box tinted by `values` (0..1) under `cmap`, `alpha` of the colour over the media."""
    small, scale = _downscale(image, max_side)
    base = np.asarray(small, dtype=np.float32)
    if alpha <= 0:
        return small
    heat = np.zeros((small.height, small.width), dtype=np.float32)
    covered = np.zeros((small.height, small.width), dtype=bool)
    for i, sl in _token_boxes(report, scale, frame_filter):
        if i < len(values):
            heat[sl] = np.maximum(heat[sl], values[i])
            covered[sl] = True
    colour = colour_map(heat, cmap)
    out = np.where(covered[..., None], (1 - alpha) * base + alpha * colour, base)
    return Image.fromarray(out.clip(0, 255).astype(np.uint8))


#: the app shows a view about this many pixels wide (its right-hand panel at 1440x900); text drawn into an image
#: scales with the image's width so it keeps at least `MIN_SHOWN_TEXT_PX` there when the image is shrunk to fit
SHOWN_WIDTH_PX = 470
MIN_SHOWN_TEXT_PX = 6


def _text_unit(width: int) -> int:
    """Font size (px) for text drawn into an image `width` px wide: 13 px, or more for a wide image."""
    return max(13, round(width / 45))


def _with_colour_bar(body: Image.Image, cmap: str, title: str, percent: bool = True) -> Image.Image:
    """`body` with a horizontal colour bar for values 0..1 under it (five ticks, as % or as fractions)."""
    width = max(body.width, 360)
    unit = _text_unit(width)  # text stays legible when a wide image is shown scaled down
    font = _font(unit)
    bar_x0, bar_x1 = unit, width - unit
    out = Image.new("RGB", (width, body.height + 4 * unit + 8), "white")
    out.paste(body, (0, 0))
    draw = ImageDraw.Draw(out)
    y = body.height + 4
    draw.text((bar_x0, y), title, fill=(20, 20, 20), font=font)
    top, bottom = y + unit + 5, y + 2 * unit + 5
    ramp = colour_map(np.linspace(0, 1, bar_x1 - bar_x0, dtype=np.float32), cmap).astype(np.uint8)
    out.paste(Image.fromarray(np.repeat(ramp[None], bottom - top, axis=0)), (bar_x0, top))
    draw.rectangle([bar_x0, top, bar_x1 - 1, bottom - 1], outline=(0, 0, 0))
    for k in range(5):
        x = bar_x0 + round(k / 4 * (bar_x1 - bar_x0 - 1))
        draw.line([x, bottom - 1, x, bottom + 3], fill=(0, 0, 0))
        label = f"{25 * k}%" if percent else f"{k / 4:g}"
        tw = draw.textlength(label, font=font)
        draw.text((min(max(x - tw / 2, 0), width - tw), bottom + 4), label, fill=(20, 20, 20), font=font)
    return out


def _token_paint(
    image: np.ndarray, report: dict[str, Any], colours: np.ndarray, max_side: int, frame_filter: set[int] | None = None
) -> Image.Image:
    """Paint each token's box with its RGB colour (NaN = leave the pixels as they are)."""
    small, scale = _downscale(image, max_side)
    paint = np.full((small.height, small.width, 3), np.nan, dtype=np.float32)
    for i, sl in _token_boxes(report, scale, frame_filter):
        if i < len(colours):
            paint[sl] = colours[i]
    base = np.asarray(small, dtype=np.float32)
    out = np.where(np.isnan(paint), base, 0.45 * base + 0.55 * np.nan_to_num(paint))
    return Image.fromarray(out.clip(0, 255).astype(np.uint8))


def _font(size: int = 13):
    try:
        return ImageFont.load_default(size)
    except TypeError:  # Pillow without FreeType sizes
        return ImageFont.load_default()


def _grid(tiles: list[Image.Image], captions: list[str], per_row: int = 8) -> Image.Image:
    """Tiles in rows of `per_row`, each with a caption underneath, sized for the sheet as it is shown: scaled
    with the sheet's width (`_text_unit`), and shrunk where a caption would run into its neighbour's."""
    if not tiles:
        return Image.new("RGB", (320, 40), "white")
    tw = max(t.width for t in tiles)
    th = max(t.height for t in tiles)
    pad = 4
    cols = min(per_row, len(tiles))
    rows = -(-len(tiles) // cols)
    unit = _text_unit(cols * (tw + pad) + pad)
    cap = unit + 6
    sheet = Image.new("RGB", (cols * (tw + pad) + pad, rows * (th + cap + pad) + pad), "white")
    draw = ImageDraw.Draw(sheet)
    for k, tile in enumerate(tiles):
        x = pad + (k % cols) * (tw + pad)
        y = pad + (k // cols) * (th + cap + pad)
        sheet.paste(tile, (x, y))
        caption, font = _fit(draw, captions[k], unit, tw - 4)
        draw.text((x + 2, y + th + 2), caption, fill=(20, 20, 20), font=font)
    return sheet


def _fit(
    draw: ImageDraw.ImageDraw, text: str, size: int, width: int, smallest: int = 9
) -> tuple[str, ImageFont.FreeTypeFont | ImageFont.ImageFont]:
    """(text, font) that fit in `width` px: the font shrunk down to `smallest` px, then the text cut with "…"."""
    length = draw.textlength(text, font=_font(size))
    if length > width:
        size = max(smallest, int(size * width / length))
    font = _font(size)
    while len(text) > 1 and draw.textlength(text, font=font) > width:
        text = text[:-2] + "…"
    return text, font


def _frame_strip(
    frames: Sequence[np.ndarray],
    times: Sequence[float] | None,
    report: dict[str, Any],
    draw_frame,
    frame_ids: Sequence[int] | None = None,
) -> Image.Image:
    """One tile per layout frame of `frame_ids` (default `shown_frames`; Qwen: per 2-frame temporal
    patch), drawn on the nearest media frame. Only those media frames are read (`frames[i]`), so a lazily
    decoded hour of video costs as many decodes as tiles."""
    layout_frames = (report.get("layout") or {}).get("frames", [])
    media_times = list(times) if times is not None and len(times) == len(frames) else list(range(len(frames)))
    tiles, captions = [], []
    for f in _frame_ids(len(layout_frames), frame_ids):
        info = layout_frames[f]
        t = info.get("time") or 0.0
        sources = [i for i in info.get("source_frames") or [] if i < len(frames)]
        if sources:
            nearest = sources[0]  # the media frame this tile/frame was made from
        else:
            nearest = int(np.argmin([abs(mt - t) for mt in media_times])) if media_times else 0
        tiles.append(draw_frame(frames[nearest], f))
        captions.append(f"t={t:.1f}s")
    return _grid(tiles, captions)


def _with_legend(body: Image.Image, entries: list[tuple[str, tuple[int, int, int], int | None]]) -> Image.Image:
    """`body` with one legend line (colour swatch, label, count) per entry under it, scaled with its width."""
    width = max(body.width, 420)
    unit = _text_unit(width)
    font, line = _font(unit), round(unit * 1.6)
    out = Image.new("RGB", (width, body.height + line * len(entries) + 8), "white")
    out.paste(body, (0, 0))
    draw = ImageDraw.Draw(out)
    for k, (label, colour, count) in enumerate(entries):
        y = body.height + 6 + k * line
        draw.rectangle([6, y + 2, 6 + unit, y + 2 + unit], fill=colour, outline=(0, 0, 0))
        text = label if count is None else f"{label}: {count}"
        draw.text((14 + unit, y + 1), text, fill=(20, 20, 20), font=font)
    return out


# -- video timeline -----------------------------------------------------------------------------


#: More sampled frames than this and the timeline shows bins of frames instead of one bar per frame.
TIMELINE_MAX_FRAMES = 200
_BIN_SECONDS = (1, 2, 5, 10, 15, 20, 30, 60, 120, 300, 600, 900, 1200, 1800, 3600, 7200)


def _frame_edges(times: np.ndarray) -> np.ndarray:
    """len(times)+1 edges: frame k stands for [edges[k], edges[k+1]), from halfway to its previous
    sampled frame to halfway to its next one (the first and last get half a typical step outward)."""
    step = float(np.median(np.diff(times))) if len(times) > 1 else 1.0
    step = step if step > 0 else 1.0
    mids = (times[:-1] + times[1:]) / 2
    return np.concatenate([[times[0] - step / 2], mids, [times[-1] + step / 2]])


def skipped_spans(report: dict[str, Any]) -> list[tuple[float, float]]:
    """(start, end) seconds of each run of consecutive skipped frames: the run covers its frames'
    stretches of the video (see `_frame_edges`), so every skipped frame's time lies in one span and no
    kept frame's time lies in any."""
    frames = report.get("frames") or []
    if not frames:
        return []
    times = np.array([f.get("time", i) for i, f in enumerate(frames)], dtype=np.float64)
    skipped = np.array([bool(f.get("skipped")) for f in frames])
    edges = _frame_edges(times)
    flips = np.flatnonzero(np.diff(np.concatenate([[0], skipped.astype(np.int8), [0]])))
    return [(float(edges[a]), float(edges[b])) for a, b in zip(flips[::2], flips[1::2])]


def _span_trace(spans: list[tuple[float, float]]) -> go.Scatter:
    """All skipped spans as ONE filled trace of rectangles (None between them), full height on a hidden
    axis: a constant cost however many runs an hour of video has (thousands of layout shapes would not be)."""
    x: list[float | None] = []
    y: list[float | None] = []
    for a, b in spans:
        x += [a, a, b, b, a, None]
        y += [0, 1, 1, 0, 0, None]
    return go.Scatter(
        x=x,
        y=y,
        yaxis="y2",
        mode="lines",
        fill="toself",
        fillcolor="rgba(213, 94, 0, 0.18)",
        line={"width": 0},
        hoveron="fills",
        name="skipped spans",
        connectgaps=False,
    )


def _bin_seconds(t0: float, t1: float, max_bins: int) -> int:
    return next((w for w in _BIN_SECONDS if (t1 - t0) / w <= max_bins), _BIN_SECONDS[-1])


def frame_timeline_figure(report: dict[str, Any], max_frames: int = TIMELINE_MAX_FRAMES) -> go.Figure | None:
    """Sampled frames over time, zoomable (range slider on the x axis, in seconds), skipped spans shaded.

    Up to `max_frames` sampled frames: motion per frame (where the method measures it), the skip
    threshold, skipped frames marked. More (an hour of video): frames grouped into at most ~`max_frames`
    bins of a round number of seconds, motion as the mean and max per bin (or kept / skipped frames per
    bin), so the figure stays a handful of traces whatever the length. None for an image."""
    frames = report.get("frames") or []
    if not frames:
        return None
    times = [f.get("time", i) for i, f in enumerate(frames)]
    skipped = [bool(f.get("skipped")) for f in frames]
    fig = go.Figure()
    spans = skipped_spans(report)
    if spans:  # first, so the bars and markers draw over the shading
        fig.add_trace(_span_trace(spans))
    if len(frames) > max_frames:
        title, y_title = _binned_timeline(
            fig, report, np.asarray(times, dtype=np.float64), np.asarray(skipped), max_frames
        )
    else:
        title, y_title = _per_frame_timeline(fig, report, times, skipped)
    encoded = report.get("vision_encoder_frames")
    if encoded is not None:
        title += f"<br>{len(frames)} sampled, {sum(skipped)} skipped, {encoded} sent to the vision encoder"
    fig.update_layout(
        # below the app's label of the chart, which floats over its top left corner
        title={"text": title, "font": {"size": 13}, "y": 1, "yref": "container", "yanchor": "top", "pad": {"t": 40}},
        xaxis={
            "title": "time (s) · drag to zoom, or use the range slider",
            "rangeslider": {"visible": True, "thickness": 0.1},
            "tickformat": "d",
        },
        yaxis_title=y_title,
        yaxis2={"overlaying": "y", "range": [0, 1], "visible": False, "fixedrange": True},
        height=416,
        margin={"l": 50, "r": 10, "t": 126, "b": 40},
        legend={"orientation": "h", "y": 1.0, "yanchor": "bottom", "x": 0},  # above the plot, clear of the slider
        yaxis={"showticklabels": has_motion(report)},
        barmode="stack",
    )
    return fig


def _per_frame_timeline(fig: go.Figure, report: dict[str, Any], times: list[float], skipped: list[bool]):
    """One bar (motion) or marker per sampled frame; returns (title, y axis title)."""
    frames = report["frames"]
    if has_motion(report):
        motion = [f.get("motion") or 0.0 for f in frames]
        fig.add_trace(
            go.Bar(
                x=times,
                y=motion,
                name="motion",
                marker_color=[_hex(SKIPPED_COLOUR) if s else _hex(KEPT_COLOUR) for s in skipped],
            )
        )
        _threshold(fig, report, times)
        y_skip = [m for m, s in zip(motion, skipped) if s]
        title, y_title = "motion per sampled frame (orange-red: skipped)", "motion (px, downscaled frame)"
    else:
        fig.add_trace(
            go.Scatter(
                x=[t for t, s in zip(times, skipped) if not s],
                y=[1] * (len(frames) - sum(skipped)),
                mode="markers",
                name="kept",
                marker={"color": _hex(KEPT_COLOUR), "size": 10},
            )
        )
        y_skip = [1] * sum(skipped)
        title, y_title = "sampled frames (motion scores not available for this method)", ""
    fig.add_trace(
        go.Scatter(
            x=[t for t, s in zip(times, skipped) if s],
            y=y_skip,
            mode="markers",
            name="skipped",
            marker={"symbol": "x", "size": 11, "color": _hex(SKIPPED_COLOUR)},
        )
    )
    return title, y_title


def _threshold(fig: go.Figure, report: dict[str, Any], times) -> None:
    if report.get("flow_threshold") is not None:
        fig.add_trace(
            go.Scatter(
                x=[min(times), max(times)],
                y=[report["flow_threshold"]] * 2,
                mode="lines",
                name="threshold",
                line={"dash": "dash", "color": "black"},
            )
        )


def _binned_timeline(fig: go.Figure, report: dict[str, Any], times: np.ndarray, skipped: np.ndarray, max_bins: int):
    """Frames grouped into bins of a round number of seconds; returns (title, y axis title)."""
    width = _bin_seconds(float(times.min()), float(times.max()), max_bins)
    index = np.floor(times / width).astype(np.int64)
    bins, inverse, counts = np.unique(index, return_inverse=True, return_counts=True)
    n_skipped = np.bincount(inverse, weights=skipped.astype(np.float64)).astype(np.int64)
    # plain lists: Plotly would send numpy arrays as typed-array blobs, which the page's `data` does not decode
    centres = ((bins + 0.5) * width).tolist()
    hover = [
        f"{clock(b * width)}–{clock((b + 1) * width)}: {n} frames, {k} skipped"
        for b, n, k in zip(bins, counts, n_skipped)
    ]
    bar = {"x": centres, "width": width * 0.9, "hovertext": hover, "hoverinfo": "text+y"}
    if has_motion(report):
        motion = np.array([f.get("motion") or 0.0 for f in report["frames"]], dtype=np.float64)
        mean = (np.bincount(inverse, weights=motion) / counts).tolist()
        peak = np.full(len(bins), -np.inf)
        np.maximum.at(peak, inverse, motion)
        peak = peak.tolist()
        fig.add_trace(go.Bar(y=mean, name=f"motion (mean per {width} s)", marker_color=_hex(KEPT_COLOUR), **bar))
        fig.add_trace(
            go.Scatter(
                x=centres,
                y=peak,
                mode="lines",
                name=f"motion (max per {width} s)",
                line={"color": _hex(KEPT_COLOUR), "width": 1, "dash": "dot"},
                hovertext=hover,
            )
        )
        _threshold(fig, report, times.tolist())
        title, y_title = f"motion in bins of {width} s (shaded: skipped frames)", "motion (px, downscaled frame)"
    else:
        fig.add_trace(
            go.Bar(y=(counts - n_skipped).tolist(), name="kept frames per bin", marker_color=_hex(KEPT_COLOUR), **bar)
        )
        fig.add_trace(
            go.Bar(y=n_skipped.tolist(), name="skipped frames per bin", marker_color=_hex(SKIPPED_COLOUR), **bar)
        )
        title, y_title = f"sampled frames in bins of {width} s (shaded: skipped)", "frames per bin"
    return title, y_title


def frame_gallery(
    frames: Sequence[np.ndarray],
    report: dict[str, Any],
    max_side: int = 320,
    frame_ids: Sequence[int] | None = None,
) -> list[tuple[Image.Image, str]] | None:
    """The sampled frames `frame_ids` (indices into `frames`; default `shown_frames`, so an hour of video
    gives evenly spaced ones) for a zoomable gallery: one image each (blue border kept; vermillion border
    and dimmed skipped) captioned with its time and state. None for an image (no `frames`).

    A gallery, not one sheet: a sheet of 8 frames a row, shrunk to the panel's width, left its captions a
    few pixels high and overlapping; gallery captions are text at the page's size, and a click zooms."""
    info = report.get("frames") or []
    if not info or not len(frames):
        return None
    items = []
    for k in _frame_ids(len(frames), frame_ids):
        meta = info[k] if k < len(info) else {}
        image, _ = _downscale(frames[k], max_side)
        skipped = bool(meta.get("skipped"))
        if skipped:
            image = Image.blend(image, Image.new("RGB", image.size, (255, 255, 255)), 0.55)
        ImageDraw.Draw(image).rectangle(
            [0, 0, image.width - 1, image.height - 1],
            outline=SKIPPED_COLOUR if skipped else KEPT_COLOUR,
            width=max(2, max(image.size) // 60),
        )
        items.append((image, f"{meta.get('time', k):.1f} s · {'skipped' if skipped else 'kept'}"))
    return items


# -- LightKV -----------------------------------------------------------------------------------


def layer_tokens_figure(report: dict[str, Any]) -> go.Figure | None:
    """Tokens held and KV MiB per layer (LightKV shrinks later layers); None without `layer_tokens`."""
    rows = report.get("layer_tokens")
    if not rows:
        return None
    layers = list(range(len(rows)))
    fig = go.Figure()
    # the app's palette (Okabe-Ito, as every other view), not Plotly's default blue and red
    fig.add_trace(
        go.Bar(x=layers, y=[r.get("tokens", 0) for r in rows], name="tokens held", marker_color=_hex(OKABE_ITO["sky"]))
    )
    fig.add_trace(
        go.Scatter(
            x=layers,
            y=[r.get("kv_bytes", 0) / MIB for r in rows],
            name="KV MiB",
            yaxis="y2",
            mode="lines+markers",
            line={"color": _hex(OKABE_ITO["vermillion"]), "width": 2},
        )
    )
    n = len(layers)
    fig.update_layout(
        xaxis={"title": "layer", "range": [-0.5, n - 0.5], "tick0": 0, "dtick": max(1, -(-n // 12)), "tickformat": "d"},
        yaxis={"title": "tokens", "rangemode": "tozero", "automargin": True, "tickformat": "d"},
        yaxis2={
            "title": "KV MiB",
            "overlaying": "y",
            "side": "right",
            "showgrid": False,
            "rangemode": "tozero",
            "automargin": True,
        },
        height=300,
        margin={"l": 60, "r": 60, "t": 20, "b": 40},
        legend={"orientation": "h", "y": -0.25},
    )
    return fig


# -- numbers -----------------------------------------------------------------------------------


def _mib(n: float | None) -> str:
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
    """One line of what the compression saved: visual tokens, peak and final KV against the full cache,
    how many times less, and the time to the first token of the last turn."""
    full = report.get("full_kv_bytes") or 0
    peak, final = report.get("peak_kv_bytes") or 0, report.get("final_kv_bytes") or 0
    turn = (report.get("turns") or [{}])[-1]
    parts = [
        f"{report.get('visual_tokens', 0)} visual tokens",
        f"KV peak {_mib(peak)} · final {_mib(final)} vs full {_mib(full)}",
    ]
    if full and peak:
        ratio = full / peak
        parts.append(f"{ratio:.1f}× less at peak" if ratio >= 1.05 else "no saving (the full cache)")
    ttft = turn.get("ttft_seconds")
    parts.append(f"TTFT {ttft:.2f} s" if ttft is not None else "TTFT n/a")
    return " · ".join(parts) + media_warnings_line(report)


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
        return _mib(n) + (f" ({100 * n / full:.1f}% of full)" if full and n is not None else "")

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
        ("full KV (uncompressed, same tokens)", _mib(full)),
        ("TTFT (last turn)", f"{turn.get('ttft_seconds', 0):.2f} s"),
        ("decode speed", decode_speed(turn)),
        ("attention after the cache (last turn's prefill)", prefill_attention(turn)),
        ("peak process RSS", _mib(report.get("peak_rss_bytes"))),
    ]
    if report.get("cuda_peak_bytes"):
        rows.append(("peak CUDA allocated", _mib(report["cuda_peak_bytes"])))
    if report.get("frames"):
        skipped = sum(bool(f.get("skipped")) for f in report["frames"])
        rows.append(("video frames sampled / skipped", f"{len(report['frames'])} / {skipped}"))
        rows.append(("frames sent to the vision encoder", str(report.get("vision_encoder_frames", "n/a"))))
    if report.get("tiers"):
        rows.append(("tiers", ", ".join(f"{k} {v}" for k, v in report["tiers"].items())))
    if report.get("layer_tokens"):
        toks = [r.get("tokens", 0) for r in report["layer_tokens"]]
        rows.append(("tokens per layer (first / last)", f"{toks[0]} / {toks[-1]}"))
    return rows


# -- compare -----------------------------------------------------------------------------------


def agreement(ids: Sequence[int], reference: Sequence[int]) -> float:
    """Fraction of answer positions where two token sequences agree (over the longer one)."""
    n = max(len(ids), len(reference))
    if n == 0:
        return 1.0
    return sum(a == b for a, b in zip(ids, reference)) / n


#: what a reader compares first comes first: the app's panel shows about five columns before it scrolls sideways
COMPARE_HEADERS = [
    "method",
    "agreement with full",
    "peak vs full",
    "peak KV (MiB)",
    "final KV (MiB)",
    "TTFT (s)",
    "answer",
]


def compare_rows(results: dict[str, dict[str, Any] | str]) -> list[list[Any]]:
    """Table rows (COMPARE_HEADERS) for {method: report or error message}.

    Agreement is token-level against the `full` method's answer to the same question
    (1.0 = the same tokens); "n/a" when `full` is not among the results; "stopped" for an answer cut short
    (by Stop or a time limit: its tokens are a prefix, not an answer to agree with), and the answer says so.
    """
    ref = results.get("full")
    ref_ids = ref["turns"][0]["token_ids"] if isinstance(ref, dict) and ref.get("turns") else None
    rows: list[list[Any]] = []
    for name, rep in results.items():
        if isinstance(rep, str):
            rows.append([name, "", "", None, None, None, f"error: {rep}"])
            continue
        turn = rep["turns"][0] if rep.get("turns") else {}
        full = rep.get("full_kv_bytes") or 0
        agree = f"{agreement(turn.get('token_ids', []), ref_ids):.0%}" if ref_ids is not None else "n/a"
        answer = turn.get("answer", "")
        if turn.get("stopped") in CUT_SHORT:
            agree, answer = "stopped", f"{answer} … (stopped after {len(turn.get('token_ids', []))} token(s))"
        rows.append(
            [
                name,
                agree,
                f"{rep['peak_kv_bytes'] / full:.1%}" if full else "",
                round(rep["peak_kv_bytes"] / MIB, 3),
                round(rep["final_kv_bytes"] / MIB, 3),
                round(turn.get("ttft_seconds", 0.0), 3),
                answer,
            ]
        )
    return rows


def compare_memory_figure(results: dict[str, dict[str, Any] | str]) -> go.Figure:
    """KV MiB against tokens read, one curve per method (methods block their input differently,
    so tokens read is the common x axis)."""
    fig = go.Figure()
    palette = ("#000000", "#0072B2", "#E69F00", "#009E73", "#CC79A7", "#D55E00", "#56B4E9")
    dashes = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
    symbols = ("circle", "square", "diamond", "triangle-up", "x", "star", "cross")
    drawn = [(name, rep) for name, rep in results.items() if not isinstance(rep, str) and rep.get("blocks")]
    for k, (name, rep) in enumerate(drawn):
        blocks = rep["blocks"]
        # earlier traces are drawn wider and under later ones: where two methods coincide (post-snapkv
        # equals full until its last block) both stay visible, and each differs in colour, dash and marker
        width = 2 + 2.5 * (len(drawn) - 1 - k) / max(len(drawn) - 1, 1)
        fig.add_trace(
            go.Scatter(
                x=list(np.cumsum([b["tokens_in"] for b in blocks])),
                y=[b["kv_bytes"] / MIB for b in blocks],
                mode="lines+markers",
                name=name,
                line={"color": palette[k % len(palette)], "dash": dashes[k % len(dashes)], "width": width},
                marker={"symbol": symbols[k % len(symbols)], "size": 5 + 4 * width / 4.5},
            )
        )
    fig.update_layout(
        xaxis={"title": "tokens read", "tickformat": "d", "rangemode": "tozero"},
        yaxis={"title": "KV MiB after block", "rangemode": "tozero"},
        height=320,
        margin={"l": 50, "r": 10, "t": 20, "b": 40},
        legend={"orientation": "h", "y": -0.25},
    )
    return fig
