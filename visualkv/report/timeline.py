"""The video timeline: sampled frames over time, their motion and skip threshold, skipped spans shaded;
binned by a round number of seconds when there are too many frames for one bar each."""

from __future__ import annotations

from typing import Any

import numpy as np
import plotly.graph_objects as go

from visualkv.report.applicable import has_motion
from visualkv.report.clock import clock
from visualkv.report.palette import KEPT_COLOUR, SKIPPED_COLOUR, hex_colour

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


def frames_sentence(report: dict[str, Any]) -> str:
    """What happened to the sampled frames, with its arithmetic in sight: "32 frames sampled: 20 skipped as
    nearly unchanged, 12 kept; the vision encoder read the 12 kept frames as 6 inputs of 2 frames" (a model
    such as Qwen2.5-VL encodes frames in pairs). "" without frame data."""
    frames = report.get("frames") or []
    encoded = report.get("vision_encoder_frames")
    if not frames:
        return ""
    n, skipped = len(frames), sum(bool(f.get("skipped")) for f in frames)
    kept = n - skipped
    said = (
        f"{n} frames sampled: {skipped} skipped as nearly unchanged, {kept} kept"
        if skipped
        else f"{n} frames sampled, none skipped"
    )
    if encoded is None:
        return said
    which = f"the {kept} kept frames" if skipped else f"the {kept} frames"
    if encoded == kept:
        return f"{said}; the vision encoder read {which}, one input each"
    if encoded and kept % encoded == 0:
        return f"{said}; the vision encoder read {which} as {encoded} inputs of {kept // encoded} frames"
    return f"{said}; the vision encoder read {which} as {encoded} inputs"


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
    said = frames_sentence(report)
    if said:
        title += "<br>" + said.replace("; ", "<br>")  # two short lines: the panel is ~470 px wide
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
        height=432,
        margin={"l": 50, "r": 10, "t": 142, "b": 40},
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
                marker_color=[hex_colour(SKIPPED_COLOUR) if s else hex_colour(KEPT_COLOUR) for s in skipped],
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
                marker={"color": hex_colour(KEPT_COLOUR), "size": 10},
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
            marker={"symbol": "x", "size": 11, "color": hex_colour(SKIPPED_COLOUR)},
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
        fig.add_trace(go.Bar(y=mean, name=f"motion (mean per {width} s)", marker_color=hex_colour(KEPT_COLOUR), **bar))
        fig.add_trace(
            go.Scatter(
                x=centres,
                y=peak,
                mode="lines",
                name=f"motion (max per {width} s)",
                line={"color": hex_colour(KEPT_COLOUR), "width": 1, "dash": "dot"},
                hovertext=hover,
            )
        )
        _threshold(fig, report, times.tolist())
        title, y_title = f"motion in bins of {width} s (shaded: skipped frames)", "motion (px, downscaled frame)"
    else:
        fig.add_trace(
            go.Bar(
                y=(counts - n_skipped).tolist(), name="kept frames per bin", marker_color=hex_colour(KEPT_COLOUR), **bar
            )
        )
        fig.add_trace(
            go.Bar(y=n_skipped.tolist(), name="skipped frames per bin", marker_color=hex_colour(SKIPPED_COLOUR), **bar)
        )
        title, y_title = f"sampled frames in bins of {width} s (shaded: skipped)", "frames per bin"
    return title, y_title
