"""Frame resizing with OpenCV (Pillow where OpenCV is missing)."""

from __future__ import annotations

import numpy as np
from PIL import Image

from visualkv.media.backends import import_cv2


def resize_to_width(frame: np.ndarray, width: int) -> np.ndarray:
    """RGB frame resized to ``width`` px wide, aspect kept (height rounded, at least 1): INTER_AREA
    when shrinking, INTER_LINEAR when enlarging (the same resize ``visualkv.media.saliency`` applies, so
    a frame resized here passes through its own resize unchanged)."""
    h, w = frame.shape[:2]
    height = max(1, round(h * width / w))
    cv2 = import_cv2()
    if cv2 is None:
        resample = Image.Resampling.BOX if w > width else Image.Resampling.BILINEAR
        return np.asarray(Image.fromarray(frame).resize((width, height), resample))
    interp = cv2.INTER_AREA if w > width else cv2.INTER_LINEAR
    return cv2.resize(frame, (width, height), interpolation=interp)


def resize_to(frame: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    cv2 = import_cv2()
    if cv2 is None:
        return np.asarray(Image.fromarray(frame).resize((shape[1], shape[0])))
    return cv2.resize(frame, (shape[1], shape[0]), interpolation=cv2.INTER_AREA)
