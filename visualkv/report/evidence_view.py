"""The evidence view: where the uncompressed model's answer looked (a heatmap per visual token) with the tokens
the compressed cache kept outlined, on the image or a video's frame strip (report fields: `evidence`,
`retained`, `retained_per_layer`; see visualkv.runtime.evidence)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image

from visualkv.report.drawing import with_colour_bar
from visualkv.report.frames import token_view
from visualkv.report.overlays import retained_values
from visualkv.report.tokens import token_boxes, token_overlay

EVIDENCE_CMAP = "inferno"
OUTLINE_COLOUR = (0, 230, 255)  # cyan: readable over inferno's dark and bright ends


def has_evidence(report: dict[str, Any]) -> bool:
    return bool((report.get("evidence") or {}).get("map"))


def evidence_values(report: dict[str, Any], layer: int | None) -> np.ndarray:
    """Per visual token, its share of the layer's (or the average) evidence, scaled so the largest is 1."""
    evidence = report.get("evidence") or {}
    per_layer = evidence.get("map_per_layer")
    if layer is not None and per_layer and layer < len(per_layer):
        values = np.asarray(per_layer[layer], dtype=np.float32)
    else:
        values = np.asarray(evidence.get("map") or [], dtype=np.float32)
    top = float(values.max()) if values.size else 0.0
    return values / top if top > 0 else values


def evidence_recall_text(report: dict[str, Any], layer: int | None = None) -> str:
    """ "evidence recall 83.1 %" overall, or that of `layer`; "" without evidence."""
    evidence = report.get("evidence") or {}
    if not evidence:
        return ""
    per_layer = evidence.get("recall_per_layer") or []
    if layer is not None and layer < len(per_layer):
        return f"evidence recall {per_layer[layer]:.1%} in layer {layer}"
    return f"evidence recall {evidence['recall']:.1%}"


def recall_bucket(buckets: list[dict[str, Any]], recall: float) -> dict[str, Any] | None:
    """The entry of `buckets` (a needle benchmark's `accuracy_by_recall`: "bucket" "[lo, hi)" or "1.0 (…)", "n",
    "accuracy") whose range holds `recall`; None when none does."""
    for entry in buckets:
        label = str(entry.get("bucket", ""))
        if label.startswith("["):
            low, high = (float(x) for x in label.strip("[)").split(","))
            if low <= recall < high:
                return entry
        elif recall >= 1.0 and label.startswith("1"):
            return entry
    return None


def outline_kept(image: Image.Image, report: dict[str, Any], kept: np.ndarray, scale: float, frame_filter) -> None:
    """Draw a one-pixel outline round each kept token's box on `image`, the media drawn at `scale`."""
    pixels = np.asarray(image).copy()
    for i, (rows, cols) in token_boxes(report, scale, frame_filter):
        if i < len(kept) and kept[i]:
            r0, r1 = rows.start, min(rows.stop, pixels.shape[0]) - 1
            c0, c1 = cols.start, min(cols.stop, pixels.shape[1]) - 1
            if r1 < r0 or c1 < c0:
                continue
            pixels[r0, c0 : c1 + 1] = pixels[r1, c0 : c1 + 1] = OUTLINE_COLOUR
            pixels[r0 : r1 + 1, c0] = pixels[r0 : r1 + 1, c1] = OUTLINE_COLOUR
    image.paste(Image.fromarray(pixels))


def evidence_view(
    frames: Sequence[np.ndarray],
    times: Sequence[float] | None,
    report: dict[str, Any],
    layer: int | None = None,
    max_side: int = 960,
    opacity: float = 0.6,
) -> Image.Image | None:
    """The evidence heatmap (inferno, scaled to the strongest token) with kept tokens outlined in cyan, and a
    colour bar; None without evidence in the report."""
    if not has_evidence(report):
        return None
    values = evidence_values(report, layer)
    kept = retained_values(report, layer) > 0

    def draw(img: np.ndarray, frame_filter: set[int] | None, side: int) -> Image.Image:
        out = token_overlay(img, report, values, side, frame_filter, cmap=EVIDENCE_CMAP, alpha=opacity)
        outline_kept(out, report, kept, out.width / max(1, img.shape[1]), frame_filter)
        return out

    body = token_view(frames, times, report, draw, max_side)
    where = "averaged over layers" if layer is None else f"in layer {layer}"
    title = f"answer's attention ({where}, max = 1); outlined: kept"
    return with_colour_bar(body, EVIDENCE_CMAP, title, percent=False)
