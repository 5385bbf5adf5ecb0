"""The public entry points: every failure becomes a one-line :class:`~visualkv.errors.MediaError` that
names the file and says what to do; no other exception type escapes them."""

from __future__ import annotations

import numpy as np
from PIL import Image

from visualkv.errors import MediaError
from visualkv.media.core import Media, MediaLimits, PathLike, check_pixels
from visualkv.media.files import check_file, sniff
from visualkv.media.image import array_to_rgb, decode_image_file, image_media, pil_to_rgb, unread_frames
from visualkv.media.sampling import FrameSampling
from visualkv.media.video import Backend, load_video_file

# frozen, so one instance serves every call's default
DEFAULT_LIMITS = MediaLimits()
DEFAULT_SAMPLING = FrameSampling()


def media_kind(path: PathLike) -> str:
    """Return ``"image"`` or ``"video"`` from the file's content (magic bytes / Pillow header),
    not its extension. Raises MediaError for anything else (missing, empty, text, PDF, ...)."""
    name = str(path)
    return sniff(check_file(path, name, limits=None), name)


def load_media(
    path: PathLike,
    limits: MediaLimits = DEFAULT_LIMITS,
    sampling: FrameSampling = DEFAULT_SAMPLING,
    backend: Backend = "auto",
    lazy: bool = True,
) -> Media:
    """Load an image or a video (detected from content) with validation and frame sampling.

    ``lazy``: a video's frames are decoded when indexed (:class:`LazyFrames`), else all up front."""
    name = str(path)
    file = check_file(path, name, limits)
    if sniff(file, name) == "image":
        return image_media(*decode_image_file(file, name, limits), name)
    return load_video_file(file, name, limits, sampling, backend, lazy)


def load_image(source: PathLike | Image.Image | np.ndarray, limits: MediaLimits = DEFAULT_LIMITS) -> Media:
    """Load one image from a path, a PIL image, or an array (HxW, HxWx3 RGB, HxWx4 RGBA).

    Arrays may be uint8, bool, float in [0, 1] (or [0, 255]) or 16-bit integers.
    """
    if isinstance(source, Image.Image):
        name = getattr(source, "filename", "") or "<PIL image>"
        check_pixels(source.size, name, limits, "image")
        notes = unread_frames(source, name)
        return image_media(pil_to_rgb(source, name, notes), notes, None)
    if isinstance(source, np.ndarray):
        return image_media(array_to_rgb(source, limits), [], None)
    name = str(source)
    file = check_file(source, name, limits)
    if sniff(file, name) == "video":
        raise MediaError(f"'{name}' is a video, not an image — use load_video() or load_media()")
    return image_media(*decode_image_file(file, name, limits), name)


def load_video(
    path: PathLike,
    limits: MediaLimits = DEFAULT_LIMITS,
    sampling: FrameSampling = DEFAULT_SAMPLING,
    backend: Backend = "auto",
    lazy: bool = True,
) -> Media:
    """Load a video and sample frames from it.

    ``backend``: ``"auto"`` (decord, OpenCV where decord is missing or fails), ``"decord"`` or
    ``"opencv"`` (only that library, no fallback). ``lazy``: see :func:`load_media`.
    """
    name = str(path)
    file = check_file(path, name, limits)
    if sniff(file, name) == "image":
        raise MediaError(f"'{name}' is an image, not a video — use load_image() or load_media()")
    return load_video_file(file, name, limits, sampling, backend, lazy)
