"""Colours the views share: the Okabe-Ito palette, the Sali-Cache tiers, the sequential colour maps."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

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


def hex_colour(rgb: tuple[int, int, int]) -> str:
    return "#{:02x}{:02x}{:02x}".format(*rgb)


def colour_stops(name: str) -> list[str]:
    """A sequential map's evenly spaced anchors, low to high, as hex colours (for a legend drawn by a page)."""
    return [hex_colour(rgb) for rgb in COLOUR_MAPS[name]]


_TIER_ALIASES = {"fp16": "full", "bf16": "full", "fp32": "full", "prune": "pruned", "skip": "skipped"}


_TIER_BY_INT = ("full", "int8", "int4", "pruned", "skipped")  # visualkv.media.saliency.TIER_* order


def tier_name(tier: Any, names: Sequence[str] | None = None) -> str:
    """Canonical tier name for a report's tier value (an int code, decoded by the report's
    `tier_names` when given, else visualkv.media.saliency's TIER_* order; or a name)."""
    if isinstance(tier, int | np.integer):
        table = names or _TIER_BY_INT
        tier = table[int(tier)] if 0 <= int(tier) < len(table) else str(tier)
    name = str(tier).lower()
    return _TIER_ALIASES.get(name, name)


def tier_colour(name: str) -> tuple[int, int, int]:
    for key, _, colour in TIERS:
        if key == name:
            return colour
    return (200, 200, 200)
