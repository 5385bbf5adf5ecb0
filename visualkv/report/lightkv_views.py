"""LightKV's views: which tokens merged into which (on the media), and tokens and KV bytes per layer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import plotly.graph_objects as go
from PIL import Image

from visualkv.report.drawing import with_legend
from visualkv.report.frames import token_view
from visualkv.report.memory_chart import MIB
from visualkv.report.palette import OKABE_ITO, hex_colour
from visualkv.report.tokens import token_paint

MERGED_COLOUR = (40, 40, 40)


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
    body = token_view(
        frames, times, report, lambda img, flt, side: token_paint(img, report, colours, side, flt), max_side, frame_ids
    )
    return with_legend(body, merge_legend(report))


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


def layer_tokens_figure(report: dict[str, Any]) -> go.Figure | None:
    """Tokens held and KV MiB per layer (LightKV shrinks later layers); None without `layer_tokens`."""
    rows = report.get("layer_tokens")
    if not rows:
        return None
    layers = list(range(len(rows)))
    fig = go.Figure()
    # the app's palette (Okabe-Ito, as every other view), not Plotly's default blue and red
    fig.add_trace(
        go.Bar(
            x=layers,
            y=[r.get("tokens", 0) for r in rows],
            name="tokens held",
            marker_color=hex_colour(OKABE_ITO["sky"]),
        )
    )
    fig.add_trace(
        go.Scatter(
            x=layers,
            y=[r.get("kv_bytes", 0) / MIB for r in rows],
            name="KV MiB",
            yaxis="y2",
            mode="lines+markers",
            line={"color": hex_colour(OKABE_ITO["vermillion"]), "width": 2},
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
