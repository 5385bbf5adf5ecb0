"""Per-token values and colours painted onto each visual token's box of the layout, on a downscaled copy
of the media (so a 4K image or a long video costs a few hundred kilobytes to show)."""

from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image

from visualkv.report.drawing import downscale
from visualkv.report.palette import KEEP_CMAP, colour_map


def token_boxes(report: dict[str, Any], scale: float, frame_filter: set[int] | None):
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


def token_overlay(
    image: np.ndarray,
    report: dict[str, Any],
    values: np.ndarray,
    max_side: int,
    frame_filter: set[int] | None = None,
    cmap: str = KEEP_CMAP,
    alpha: float = 0.6,
) -> Image.Image:
    """Each token's box tinted by `values` (0..1) under `cmap`, `alpha` of the colour over the media."""
    small, scale = downscale(image, max_side)
    base = np.asarray(small, dtype=np.float32)
    if alpha <= 0:
        return small
    heat = np.zeros((small.height, small.width), dtype=np.float32)
    covered = np.zeros((small.height, small.width), dtype=bool)
    for i, sl in token_boxes(report, scale, frame_filter):
        if i < len(values):
            heat[sl] = np.maximum(heat[sl], values[i])
            covered[sl] = True
    colour = colour_map(heat, cmap)
    out = np.where(covered[..., None], (1 - alpha) * base + alpha * colour, base)
    return Image.fromarray(out.clip(0, 255).astype(np.uint8))


def token_paint(
    image: np.ndarray, report: dict[str, Any], colours: np.ndarray, max_side: int, frame_filter: set[int] | None = None
) -> Image.Image:
    """Paint each token's box with its RGB colour (NaN = leave the pixels as they are)."""
    small, scale = downscale(image, max_side)
    paint = np.full((small.height, small.width, 3), np.nan, dtype=np.float32)
    for i, sl in token_boxes(report, scale, frame_filter):
        if i < len(colours):
            paint[sl] = colours[i]
    base = np.asarray(small, dtype=np.float32)
    out = np.where(np.isnan(paint), base, 0.45 * base + 0.55 * np.nan_to_num(paint))
    return Image.fromarray(out.clip(0, 255).astype(np.uint8))
