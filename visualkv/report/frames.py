"""Which frames a view draws and how: strips of video frames, an image's tiles beside its thumbnail,
and the gallery of sampled frames (kept / skipped)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from visualkv.report.drawing import downscale, grid
from visualkv.report.palette import KEPT_COLOUR, SKIPPED_COLOUR

#: Frames drawn at most in a strip, gallery or thumbnail sheet (evenly spaced over a longer video).
MAX_FRAMES_SHOWN = 24


def shown_frames(n: int, limit: int = MAX_FRAMES_SHOWN) -> list[int]:
    """Indices of at most `limit` of `n` frames, evenly spaced, the first and the last included."""
    if n <= limit:
        return list(range(n))
    return sorted(set(np.linspace(0, n - 1, max(limit, 1)).round().astype(int).tolist()))


def frames_to_draw(n: int, frame_ids: Sequence[int] | None) -> list[int]:
    return shown_frames(n) if frame_ids is None else [int(f) for f in frame_ids if 0 <= int(f) < n]


def layout_is_video(report: dict[str, Any]) -> bool:
    frames = (report.get("layout") or {}).get("frames", [])
    return any(f.get("kind") == "frame" for f in frames)


def layout_frame_captions(report: dict[str, Any]) -> list[str]:
    frames = (report.get("layout") or {}).get("frames", [])
    if not layout_is_video(report):
        return ["image" for _ in frames[:1]]
    return [f"frame {f + 1}/{len(frames)} · t={info.get('time') or 0.0:.1f}s" for f, info in enumerate(frames)]


def frame_source(frames: Sequence[np.ndarray], times: Sequence[float] | None, info: dict[str, Any]) -> np.ndarray:
    """The media frame a layout frame was made from (its first source frame, else the nearest in time)."""
    sources = [i for i in info.get("source_frames") or [] if i < len(frames)]
    if sources:
        return frames[sources[0]]
    media_times = list(times) if times is not None and len(times) == len(frames) else list(range(len(frames)))
    t = info.get("time") or 0.0
    return frames[int(np.argmin([abs(mt - t) for mt in media_times]))] if media_times else frames[0]


def image_panels(image: np.ndarray, report: dict[str, Any], draw, max_side: int) -> Image.Image:
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
    return grid([main, thumb], ["tiles", "thumbnail: its own tokens, whole image"])


def gallery_item(frames, times, report: dict[str, Any], f: int, draw, max_side: int) -> Image.Image:
    """Layout frame `f` of a video on its media frame; an image as a whole (tiles + thumbnail panel)."""
    if not layout_is_video(report):
        return image_panels(frames[0], report, draw, max_side)
    layout_frames = (report.get("layout") or {}).get("frames", [])
    return draw(frame_source(frames, times, layout_frames[f]), {f}, max_side)


#: px: the side of each frame's tile in a video's token view
STRIP_SIDE = 240


def token_view(
    frames: Sequence[np.ndarray],
    times: Sequence[float] | None,
    report: dict[str, Any],
    draw,
    max_side: int,
    frame_ids: Sequence[int] | None = None,
) -> Image.Image:
    """The media's token view, `draw(image, frame_filter, side)`: a video's strip of frame tiles (each drawn
    with its own frame's tokens, `STRIP_SIDE` px), or an image's panels (`image_panels`)."""
    if layout_is_video(report):
        return frame_strip(frames, times, report, lambda img, f: draw(img, {f}, STRIP_SIDE), frame_ids)
    return image_panels(frames[0], report, draw, max_side)


def frame_strip(
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
    for f in frames_to_draw(len(layout_frames), frame_ids):
        info = layout_frames[f]
        t = info.get("time") or 0.0
        sources = [i for i in info.get("source_frames") or [] if i < len(frames)]
        if sources:
            nearest = sources[0]  # the media frame this tile/frame was made from
        else:
            nearest = int(np.argmin([abs(mt - t) for mt in media_times])) if media_times else 0
        tiles.append(draw_frame(frames[nearest], f))
        captions.append(f"t={t:.1f}s")
    return grid(tiles, captions)


def frame_gallery(
    frames: Sequence[np.ndarray],
    report: dict[str, Any],
    max_side: int = 320,
    frame_ids: Sequence[int] | None = None,
) -> list[tuple[Image.Image, str]] | None:
    """The sampled frames `frame_ids` (indices into `frames`; default `shown_frames`, so an hour of video
    gives evenly spaced ones) for a zoomable gallery: one image each (blue border kept; vermillion border
    and dimmed skipped) captioned with its time and state. None for an image (no `frames`).

    A gallery rather than one sheet: its captions are text at the page's size, and a click zooms."""
    info = report.get("frames") or []
    if not info or not len(frames):
        return None
    items = []
    for k in frames_to_draw(len(frames), frame_ids):
        meta = info[k] if k < len(info) else {}
        image, _ = downscale(frames[k], max_side)
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
