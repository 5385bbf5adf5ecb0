"""PIL sheet helpers: fonts sized for how the app shows an image, colour bars, legends, grids, downscaling."""

from __future__ import annotations

import math

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from visualkv.report.palette import colour_map

#: the app shows a view about this many pixels wide (its right-hand panel at 1440x900); text drawn into an image
#: scales with the image's width so that its font is `SHOWN_FONT_PX` there when the image is shrunk to fit
SHOWN_WIDTH_PX = 470
SHOWN_FONT_PX = 12

#: the least height (px, as shown) of a digit drawn into a view: a digit is ~0.7 of its font's size, so this
#: holds for a font of 11 px or more
MIN_SHOWN_TEXT_PX = 8


def text_unit(width: int) -> int:
    """Font size (px) for text drawn into an image `width` px wide: 13 px, or more for an image wider than the
    panel, so that it is `SHOWN_FONT_PX` when the image is shown `SHOWN_WIDTH_PX` wide."""
    return max(13, math.ceil(width * SHOWN_FONT_PX / SHOWN_WIDTH_PX))


def sized_font(size: int = 13):
    try:
        return ImageFont.load_default(size)
    except TypeError:  # Pillow without FreeType sizes
        return ImageFont.load_default()


def downscale(image: np.ndarray, max_side: int) -> tuple[Image.Image, float]:
    h, w = image.shape[:2]
    scale = min(1.0, max_side / max(h, w))
    small = (
        Image.fromarray(image)
        .convert("RGB")
        .resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.Resampling.BILINEAR)
    )
    return small, scale


def with_colour_bar(body: Image.Image, cmap: str, title: str, percent: bool = True) -> Image.Image:
    """`body` with a horizontal colour bar for values 0..1 under it (five ticks, as % or as fractions)."""
    width = max(body.width, 360)
    unit = text_unit(width)  # text stays legible when a wide image is shown scaled down
    font = sized_font(unit)
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


def grid(tiles: list[Image.Image], captions: list[str], per_row: int = 8) -> Image.Image:
    """Tiles in rows of `per_row`, each with a caption underneath, sized for the sheet as it is shown: scaled
    with the sheet's width (`text_unit`), and shrunk where a caption would run into its neighbour's."""
    if not tiles:
        return Image.new("RGB", (320, 40), "white")
    tw = max(t.width for t in tiles)
    th = max(t.height for t in tiles)
    pad = 4
    cols = min(per_row, len(tiles))
    rows = -(-len(tiles) // cols)
    unit = text_unit(cols * (tw + pad) + pad)
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
    length = draw.textlength(text, font=sized_font(size))
    if length > width:
        size = max(smallest, int(size * width / length))
    font = sized_font(size)
    while len(text) > 1 and draw.textlength(text, font=font) > width:
        text = text[:-2] + "…"
    return text, font


def with_legend(body: Image.Image, entries: list[tuple[str, tuple[int, int, int], int | None]]) -> Image.Image:
    """`body` with one legend line (colour swatch, label, count) per entry under it, scaled with its width."""
    width = max(body.width, 420)
    unit = text_unit(width)
    font, line = sized_font(unit), round(unit * 1.6)
    out = Image.new("RGB", (width, body.height + line * len(entries) + 8), "white")
    out.paste(body, (0, 0))
    draw = ImageDraw.Draw(out)
    for k, (label, colour, count) in enumerate(entries):
        y = body.height + 6 + k * line
        draw.rectangle([6, y + 2, 6 + unit, y + 2 + unit], fill=colour, outline=(0, 0, 0))
        text = label if count is None else f"{label}: {count}"
        draw.text((14 + unit, y + 1), text, fill=(20, 20, 20), font=font)
    return out
