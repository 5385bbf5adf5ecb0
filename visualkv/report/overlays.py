"""Token overlays on the media: the share of each token's KV kept, and Sali-Cache's saliency and
precision tier, as one image (with a colour bar or legend) or a gallery of frames."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image

from visualkv.report.drawing import with_colour_bar, with_legend
from visualkv.report.frames import (
    frames_to_draw,
    gallery_item,
    layout_frame_captions,
    layout_is_video,
    token_view,
)
from visualkv.report.palette import KEEP_CMAP, SALIENCY_CMAP, TIERS, tier_colour, tier_name
from visualkv.report.tokens import token_overlay, token_paint


def retained_values(report: dict[str, Any], layer: int | None) -> np.ndarray:
    if layer is not None and report.get("retained_per_layer"):
        return np.asarray(report["retained_per_layer"][layer], dtype=np.float32)
    return np.asarray(report.get("retained", []), dtype=np.float32)


def keep_bar_title(layer: int | None = None) -> str:
    """The keep map's colour-bar title: averaged over every layer, or the one layer shown."""
    where = "over layers and KV heads" if layer is None else f"in layer {layer}, over its KV heads"
    return f"share of each token's KV entries kept ({where})"


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
    values = retained_values(report, layer)

    def draw(img: np.ndarray, frame_filter: set[int] | None, side: int) -> Image.Image:
        return token_overlay(img, report, values, side, frame_filter, alpha=opacity)

    body = token_view(frames, times, report, draw, max_side, frame_ids)
    return with_colour_bar(body, KEEP_CMAP, keep_bar_title(layer)) if colour_bar else body


def saliency_view(
    frames: Sequence[np.ndarray],
    times: Sequence[float] | None,
    report: dict[str, Any],
    max_side: int = 960,
    frame_ids: Sequence[int] | None = None,
) -> Image.Image | None:
    """Sali-Cache saliency per token (inferno: dark = background, bright = salient) with a colour bar;
    None without `saliency`."""
    values = saliency_values(report)
    if values is None:
        return None

    def draw(img: np.ndarray, frame_filter: set[int] | None, side: int) -> Image.Image:
        return token_overlay(img, report, values, side, frame_filter, cmap=SALIENCY_CMAP)

    body = token_view(frames, times, report, draw, max_side, frame_ids)
    return with_colour_bar(body, SALIENCY_CMAP, SALIENCY_SCALE, percent=False)


SALIENCY_SCALE = "saliency (0 = background, 1 = most salient)"


def saliency_values(report: dict[str, Any]) -> np.ndarray | None:
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
    names = tier_names(report)
    colours = np.array([tier_colour(n) for n in names], dtype=np.float32)
    body = token_view(
        frames, times, report, lambda img, flt, side: token_paint(img, report, colours, side, flt), max_side, frame_ids
    )
    counts = report.get("tiers") or {n: names.count(n) for n in dict.fromkeys(names)}
    return with_legend(body, [(label, colour, counts.get(name)) for name, label, colour in TIERS])


def tier_names(report: dict[str, Any]) -> list[str]:
    return [tier_name(t, report.get("tier_names")) for t in report["tier"]]


def saliency_gallery(
    frames: Sequence[np.ndarray],
    times: Sequence[float] | None,
    report: dict[str, Any],
    max_side: int = 640,
    frame_ids: Sequence[int] | None = None,
) -> list[tuple[Image.Image, str]] | None:
    """Saliency per frame (one large, captioned image each), for a zoomable gallery of the layout frames
    `frame_ids` (default `shown_frames`); None without `saliency`. The images carry no colour bar: a gallery
    shows them a few at a row, where drawn text would be too small to read; the page shows the scale once
    (`SALIENCY_SCALE`)."""
    values = saliency_values(report)
    if values is None:
        return None
    token_frame = np.asarray((report.get("layout") or {}).get("token_frame", []), dtype=np.int64)
    captions = layout_frame_captions(report)
    items = []
    for f in frames_to_draw(len(captions), frame_ids):
        caption = captions[f]
        img = gallery_item(
            frames,
            times,
            report,
            f,
            lambda im, flt, side: token_overlay(im, report, values, side, flt, cmap=SALIENCY_CMAP),
            max_side,
        )
        mine = values[: len(token_frame)]
        if layout_is_video(report):
            mine = mine[token_frame[: len(values)] == f]
        mean = f" · mean saliency {float(mine.mean()):.2f}" if mine.size else ""
        items.append((img, caption + mean))
    return items


def tier_gallery(
    frames: Sequence[np.ndarray],
    times: Sequence[float] | None,
    report: dict[str, Any],
    max_side: int = 640,
    frame_ids: Sequence[int] | None = None,
) -> list[tuple[Image.Image, str]] | None:
    """The precision tier of every token, one large image per frame with that frame's tier counts in
    its caption, for a zoomable gallery of the layout frames `frame_ids` (default `shown_frames`); None
    without `tier`. As for `saliency_gallery`, the colours' legend is the page's (`TIERS`), not drawn in."""
    if not report.get("tier"):
        return None
    names = tier_names(report)
    colours = np.array([tier_colour(n) for n in names], dtype=np.float32)
    token_frame = np.asarray((report.get("layout") or {}).get("token_frame", []), dtype=np.int64)[: len(names)]
    name_array = np.asarray(names[: len(token_frame)], dtype=object)
    captions = layout_frame_captions(report)
    items = []
    for f in frames_to_draw(len(captions), frame_ids):
        caption = captions[f]
        counts = {name: 0 for name, _, _ in TIERS}
        mask = token_frame == f if layout_is_video(report) else slice(None)  # an image: all its tiles
        mine, n = np.unique(name_array[mask].astype(str), return_counts=True)
        counts.update({str(k): int(v) for k, v in zip(mine, n, strict=True)})
        img = gallery_item(
            frames, times, report, f, lambda im, flt, side: token_paint(im, report, colours, side, flt), max_side
        )
        text = ", ".join(f"{label} {counts.get(name, 0)}" for name, label, _ in TIERS if counts.get(name))
        items.append((img, f"{caption} · {text}"))
    return items
