"""Load and validate images and videos, and sample video frames.

Every failure is a one-line :class:`~visualkv.errors.MediaError` naming the file and what to do.
Videos are decoded lazily by default (:class:`LazyFrames`), so memory does not grow with their length.
One module per job: ``load`` (entry points), ``core`` (``Media``, ``MediaLimits``), ``files``, ``image``,
``probe``, ``readers``, ``video``, ``lazy``, ``sampling``, ``flat``, ``resize``, ``saliency``.
"""

from __future__ import annotations

from visualkv.errors import MediaError
from visualkv.media.backends import quiet_decoders
from visualkv.media.core import RESIZE_AT_DECODE_BELOW, Media, MediaLimits
from visualkv.media.image import IMAGE_FORMATS
from visualkv.media.lazy import LazyFrames
from visualkv.media.load import load_image, load_media, load_video, media_kind
from visualkv.media.resize import resize_to_width
from visualkv.media.sampling import FrameSampling, sample_frame_indices

__all__ = [
    "IMAGE_FORMATS",
    "RESIZE_AT_DECODE_BELOW",
    "FrameSampling",
    "LazyFrames",
    "Media",
    "MediaError",
    "MediaLimits",
    "load_image",
    "load_media",
    "load_video",
    "media_kind",
    "quiet_decoders",
    "resize_to_width",
    "sample_frame_indices",
]
