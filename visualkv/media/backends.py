"""The optional video decoders, decord and OpenCV: imported when first needed, and silenced."""

from __future__ import annotations

import os
from types import ModuleType


def import_decord() -> ModuleType | None:
    try:
        import decord
    except ImportError:
        return None
    return decord


def import_cv2() -> ModuleType | None:
    try:
        import cv2
    except ImportError:
        return None
    return cv2


def quiet_decoders() -> None:
    """Silence FFmpeg's own logging in decord and in OpenCV for this process ("[mjpeg @ 0x…] No JPEG data found"
    per broken frame): a decoder failure already becomes one :class:`MediaError`, and those lines would print
    around it. Process-wide, so the library never calls it; the CLI and the app, which own their process, do,
    before the first video is opened (OpenCV reads OPENCV_FFMPEG_LOGLEVEL once, when FFmpeg starts; a value
    already set is kept). VISUALKV_DEBUG=1 keeps them."""
    if os.environ.get("VISUALKV_DEBUG"):
        return
    os.environ.setdefault("OPENCV_FFMPEG_LOGLEVEL", "-8")  # AV_LOG_QUIET
    decord = import_decord()
    if decord is not None:
        decord.logging.set_level(decord.logging.QUIET)
