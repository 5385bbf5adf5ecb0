"""Heatmaps of tiled families: every tile's tokens over that tile's box, the thumbnail in a panel of its own.

A tiny LLaVA-OneVision and a tiny InternVL3.5 prefill a synthetic image that is black except for one white
square, inside one tile. The views are then drawn with chosen per-token values (1 on some tokens, 0 on the
rest) and compared with the all-zero drawing: the pixels that change must be exactly the layout's boxes of
the tokens set to 1 (the boxes the adapter computed), in the main panel; the thumbnail's own tokens (InternVL's
thumbnail, LLaVA-OneVision's base image) only in the panel beside it.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import get_adapter
from visualkv.media import Media
from visualkv.report.overlays import retained_view, saliency_view
from visualkv.runtime.session import ChatSession, SessionConfig

PAD = 4  # grid's margin: the main panel's top-left corner in the composed view
#: (alias, image width, height, the tile (x0, y0, x1, y1) holding the white square)
CASES = {
    # InternVL: 896 x 448 -> 2 x 1 tiles of 448 px (resized 1:1) + the thumbnail
    "tiny-internvl3.5": (896, 448, (448, 0, 896, 448)),
    # LLaVA-OneVision: 768 x 384 is the 384 x 768 pinpoint exactly: 1 x 2 tiles, no padding, a 27 x 54 map
    "tiny-llava-onevision": (768, 384, (384, 0, 768, 384)),
}


def _image(width: int, height: int, tile: tuple[int, int, int, int]) -> Media:
    pixels = np.zeros((height, width, 3), dtype=np.uint8)
    x0, y0, x1, y1 = tile
    cx, cy = (x0 + x1) // 2, (y0 + y1) // 2
    pixels[cy - 40 : cy + 40, cx - 40 : cx + 40] = 255  # the only content: a white square in that tile
    return Media(kind="image", frames=[pixels], times=[0.0], source_fps=None, duration=None, path=None)


@pytest.fixture(scope="module", params=list(CASES))
def run(request):
    alias = request.param
    width, height, tile = CASES[alias]
    media = _image(width, height, tile)
    s = ChatSession(get_adapter(alias), SessionConfig(method="full", max_new_tokens=1))
    s.ask("Where is the square?", media)
    return alias, media, s.prepared.layout, s.report(), tile


def _view(media: Media, report: dict, values: np.ndarray, kind: str = "retained") -> np.ndarray:
    report = {**report, kind: values.tolist()}
    width, height = media.size
    if kind == "saliency":  # always with its colour bar underneath: the same in both drawings compared
        return np.asarray(saliency_view(media.frames, None, report, max_side=max(width, height)))
    return np.asarray(
        retained_view(media.frames, None, report, max_side=max(width, height), opacity=1.0, colour_bar=False)
    )


def _changed(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.any(a != b, axis=-1)


def _expected(shape: tuple[int, int], boxes: np.ndarray, offset: tuple[int, int] = (PAD, PAD)) -> np.ndarray:
    mask = np.zeros(shape, dtype=bool)
    ox, oy = offset
    for x0, y0, x1, y1 in boxes:
        mask[oy + y0 : oy + y1, ox + x0 : ox + x1] = True
    return mask


def _thumbnail_frames(layout) -> list[int]:
    return [f for f, info in enumerate(layout.frames) if info.kind == "global"]


def test_layout_has_tiles_and_a_thumbnail(run):
    alias, media, layout, _, _ = run
    thumbs = _thumbnail_frames(layout)
    assert len(thumbs) == 1 and layout.frames[thumbs[0]].box == (0, 0, *media.size)
    if alias == "tiny-internvl3.5":
        assert [f.box for f in layout.frames if f.kind == "tile"] == [(0, 0, 448, 448), (448, 0, 896, 448)]
    else:
        assert [tuple(f.grid) for f in layout.frames if f.kind == "image"] == [(27, 54)]


def test_a_token_in_the_content_tile_colours_exactly_its_box(run):
    """The token whose box holds the white square's centre: the overlay changes exactly its layout box."""
    _, media, layout, report, tile = run
    thumbs = set(_thumbnail_frames(layout))
    cx, cy = (tile[0] + tile[2]) // 2, (tile[1] + tile[3]) // 2
    boxes = layout.box
    inside = (boxes[:, 0] <= cx) & (cx < boxes[:, 2]) & (boxes[:, 1] <= cy) & (cy < boxes[:, 3])
    candidates = [i for i in np.flatnonzero(inside) if layout.frame[i] not in thumbs]
    newline = (layout.extra or {}).get("newline")
    if newline is not None:
        candidates = [i for i in candidates if not newline[i]]
    assert len(candidates) == 1, candidates  # one tile token there (the thumbnail's is in its own panel)
    i = candidates[0]
    values = np.zeros(layout.n_visual, dtype=np.float32)
    base = _view(media, report, values)
    values[i] = 1.0
    changed = _changed(base, _view(media, report, values))
    assert np.array_equal(changed, _expected(changed.shape, boxes[i : i + 1]))
    assert np.all((boxes[i, :2] >= tile[:2]) & (boxes[i, 2:] <= tile[2:]))  # and that box lies in the tile


def test_all_tokens_of_a_tile_colour_exactly_that_tile(run):
    alias, media, layout, report, tile = run
    values = np.zeros(layout.n_visual, dtype=np.float32)
    base = _view(media, report, values)
    if alias == "tiny-internvl3.5":
        k = next(f for f, info in enumerate(layout.frames) if info.kind == "tile" and info.box == tile)
        mine = layout.frame == k
    else:  # the anyres map's right tile: columns 27..53 of the 27 x 54 map (newlines end their row there)
        image_frame = next(f for f, info in enumerate(layout.frames) if info.kind == "image")
        mine = (layout.frame == image_frame) & (layout.col >= 27)
    values[mine] = 1.0
    changed = _changed(base, _view(media, report, values))
    assert np.array_equal(changed, _expected(changed.shape, np.array([tile])))


def test_thumbnail_tokens_are_drawn_in_their_own_panel(run):
    """Kept thumbnail tokens leave the main panel as it is and cover the whole thumbnail panel beside it."""
    _, media, layout, report, _ = run
    width, height = media.size
    values = np.zeros(layout.n_visual, dtype=np.float32)
    base = _view(media, report, values)
    values[np.isin(layout.frame, _thumbnail_frames(layout))] = 1.0
    changed = _changed(base, _view(media, report, values))
    assert not changed[PAD : PAD + height, PAD : PAD + width].any()
    thumb_side = max(width, height) // 3
    tw, th = round(width * thumb_side / max(width, height)), round(height * thumb_side / max(width, height))
    x0 = PAD + width + PAD
    assert np.array_equal(changed, _expected(changed.shape, np.array([[0, 0, tw, th]]), offset=(x0, PAD)))


def test_saliency_view_uses_the_same_boxes(run):
    _, media, layout, report, tile = run
    values = np.zeros(layout.n_visual, dtype=np.float32)
    base = _view(media, report, values, "saliency")
    thumbs = np.isin(layout.frame, _thumbnail_frames(layout))
    boxes = layout.box
    in_tile = (boxes[:, 0] >= tile[0]) & (boxes[:, 2] <= tile[2]) & ~thumbs
    values[in_tile] = 1.0
    changed = _changed(base, _view(media, report, values, "saliency"))
    assert np.array_equal(changed, _expected(changed.shape, np.array([tile])))
