"""KV memory charts: the cache after each prefill block against its budget and the full cache, and
peak memory against input size."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import plotly.graph_objects as go

from visualkv.report.clock import video_read

MIB = 2**20
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


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

    Left panel (its title: the cache holds the budget plus one block at most; "the cache held" for a method
    without a budget, which draws no budget line; linear MiB): "KV cache (held)" (one point per
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
    duration = media_duration or (report.get("media") or {}).get("duration")
    read = [video_read(b.get("media_seconds"), duration) for b in blocks]
    budget_bytes = budget_bytes or budget_kv_bytes(report)
    # while a block is read the cache holds the budget plus that block: the held line may sit above the budget
    left_title = "held: budget + one block at most (MiB)" if budget_bytes else "the cache held (MiB)"
    fig = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.55, 0.45],
        horizontal_spacing=0.14,
        subplot_titles=(left_title, "against the full cache (MiB, log)"),
    )
    _add_budget_panel(fig, blocks, total, budget_bytes)
    _add_full_panel(fig, report, blocks, total, show_rss)
    fig.update_xaxes(**block_axis(total))
    if any(read):  # a video: how far the prefill has read, in time as well as blocks
        _mark_video_read(fig, read)
    fig.update_yaxes(rangemode="tozero", row=1, col=1)
    held = [b["kv_bytes"] / MIB for b in blocks]
    left = [v for v in [*held, *(b["peak_kv_bytes"] / MIB for b in blocks), (budget_bytes or 0) / MIB] if v]
    if left:  # headroom above the highest of held / peak / budget, so the lines never sit on the frame
        fig.update_yaxes(range=[0, max(left) * 1.15], row=1, col=1)
    fig.update_yaxes(**log_axis([y for t in fig.data if t.yaxis == "y2" for y in t.y if y is not None]), row=1, col=2)
    fig.update_layout(
        # the top band holds the app's label of the chart (top left), Plotly's toolbar (top right) and, under
        # them, a video's progress
        margin={"l": 50, "r": 20, "t": 84, "b": 40},
        height=384,
        legend={"orientation": "h", "y": -0.3},
        font={"size": 12},
    )
    fig.update_annotations(font={"size": 12})
    return fig


_HELD_COLOUR, _PEAK_COLOUR, _BUDGET_COLOUR, _FULL_SO_FAR_COLOUR = "#0072B2", "#CC79A7", "#D55E00", "#7f7f7f"


def _held_trace(blocks: list[dict[str, Any]], **extra: Any) -> go.Scatter:
    """The KV cache held after each block (drawn in both panels, one legend entry)."""
    return go.Scatter(
        x=list(range(1, len(blocks) + 1)),
        y=[b["kv_bytes"] / MIB for b in blocks],
        mode="lines+markers",
        name="KV cache (held)",
        legendgroup="held",
        line={"color": _HELD_COLOUR, "width": 3},
        marker={"size": 10 if len(blocks) <= 1 else 6},  # one block: a marker big enough to read
        **extra,
    )


def _add_budget_panel(fig: go.Figure, blocks: list[dict[str, Any]], total: int, budget_bytes: int | None) -> None:
    """Left panel: held, peak so far and the budget line, on a linear axis."""
    x = list(range(1, len(blocks) + 1))
    single = len(blocks) <= 1
    fig.add_trace(_held_trace(blocks), row=1, col=1)
    peak = go.Scatter(
        x=x,
        y=[b["peak_kv_bytes"] / MIB for b in blocks],
        mode="lines+markers",
        name="KV peak so far",
        line={"dash": "dot", "color": _PEAK_COLOUR, "width": 2},
        marker={"symbol": "triangle-up", "size": 9 if single else 6},
    )
    fig.add_trace(peak, row=1, col=1)
    if budget_bytes:
        budget = go.Scatter(
            x=[0.5, max(total, 1) + 0.5],
            y=[budget_bytes / MIB] * 2,
            mode="lines",
            name="budget",
            line={"dash": "dash", "color": _BUDGET_COLOUR, "width": 2},
        )
        fig.add_trace(budget, row=1, col=1)


def _add_full_panel(
    fig: go.Figure, report: dict[str, Any], blocks: list[dict[str, Any]], total: int, show_rss: bool
) -> None:
    """Right panel: the full cache so far and in the end, the held cache again and the process RSS (log axis)."""
    x = list(range(1, len(blocks) + 1))
    single = len(blocks) <= 1
    per_token = kv_bytes_per_token(report)
    tokens_read = np.cumsum([b["tokens_in"] for b in blocks]) if blocks else np.zeros(0)
    # The growing line is honest only when every input token went through the LLM (no frame skipped,
    # no patch pruned before it): then tokens read = what an uncompressed cache would hold so far.
    complete = report.get("prompt_tokens") in (None, int(tokens_read[-1]) if len(tokens_read) else 0)
    if per_token and blocks and complete:
        so_far = go.Scatter(
            x=x,
            y=list(tokens_read * per_token / MIB),
            mode="lines+markers",
            name="full cache (so far)",
            line={"dash": "dot", "color": _FULL_SO_FAR_COLOUR},
            marker={"symbol": "square", "size": 8 if single else 5},
        )
        fig.add_trace(so_far, row=1, col=2)
    if report.get("full_kv_bytes"):
        full = go.Scatter(
            x=[0.5, max(total, 1) + 0.5],
            y=[report["full_kv_bytes"] / MIB] * 2,
            mode="lines",
            name="full cache",
            line={"dash": "dash", "color": "black", "width": 2},
        )
        fig.add_trace(full, row=1, col=2)
    fig.add_trace(_held_trace(blocks, showlegend=False), row=1, col=2)
    if show_rss and blocks and blocks[0].get("rss_bytes"):
        rss = go.Scatter(
            x=x,
            y=[b["rss_bytes"] / MIB for b in blocks],
            mode="lines+markers",
            name="process RSS",
            line={"color": "#009E73", "width": 1, "dash": "dashdot"},
            marker={"symbol": "diamond", "size": 7 if single else 4},
        )
        fig.add_trace(rss, row=1, col=2)


def _mark_video_read(fig: go.Figure, read: list[str]) -> None:
    """How far into the video each block had read: in every point's hover text, and the latest in one line over
    both panels (in each axis title it would be wider than its panel)."""
    hover = [f"block {k}" + (f" · video {r}" if r else "") for k, r in enumerate(read, start=1)]
    fig.update_traces(hovertext=hover, selector={"mode": "lines+markers"})
    fig.add_annotation(
        text=f"video: {next(r for r in reversed(read) if r)}",
        name=VIDEO_READ,
        xref="paper",
        yref="paper",
        x=0.5,
        y=1.0,
        yshift=26,  # over the panels' titles, under the band of the app's label and Plotly's toolbar
        showarrow=False,
        xanchor="center",
        yanchor="bottom",
    )


#: Tick mantissas tried in turn for a log axis, until at least three ticks fall in its range.
_LOG_MANTISSAS = ((1,), (1, 2, 5), (1, 1.5, 2, 3, 5, 7))


def plain_number(value: float) -> str:
    """A tick label as people write numbers: "1,000", "20", "1.5", "0.05" (no exponent, no SI suffix)."""
    if value >= 1 and value == round(value):
        return f"{value:,.0f}"
    return f"{value:.6f}".rstrip("0").rstrip(".")


def log_axis(values: list[float]) -> dict[str, Any]:
    """A log y axis over `values` whose tick labels read as plain increasing numbers: powers of ten
    ("1, 10, 100, 1,000"), or 1-2-5 steps within a narrower range. (Plotly's own log ticks label the
    steps between powers of ten with bare digits, so an axis could read "1000, 5, 2, 100".)"""
    positive = [float(v) for v in values if v is not None and v > 0]
    if not positive:
        return {"type": "log"}
    low, high = min(positive) / 1.5, max(positive) * 1.5  # a margin, so no point sits on the frame
    decades = range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)
    for mantissas in _LOG_MANTISSAS:
        ticks = [m * 10.0**e for e in decades for m in mantissas if low <= m * 10.0**e <= high]
        if len(ticks) >= 3:
            break
    ticks = ticks[:: -(-len(ticks) // 8)]  # at most 8 labels
    return {
        "type": "log",
        "range": [math.log10(low), math.log10(high)],
        "tickvals": ticks,
        "ticktext": [plain_number(t) for t in ticks],
    }


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
