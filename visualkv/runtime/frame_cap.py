"""How many frames a video may bring, by method: a method whose memory grows with the video is capped."""

from __future__ import annotations

import dataclasses

from visualkv.errors import ConfigError
from visualkv.media import MediaLimits
from visualkv.methods import METHODS, method_traits

FULL_FRAME_CAP = 512  # sampled frames for methods that hold every frame's KV at once (memory guard aside)


def is_bounded(name: str) -> bool:
    """Does method `name` evict per block, so its memory does not grow with the video (no frame cap)?"""
    try:
        return method_traits(name).evicts_per_block
    except ConfigError:
        return False


def media_limits(name: str, base: MediaLimits | None = None) -> MediaLimits:
    """`base` (default MediaLimits()) with the frame cap of method `name`: none for a bounded method
    (only the video-length limit applies), FULL_FRAME_CAP otherwise, its refusal naming the bounded ones."""
    base = base or MediaLimits()
    if is_bounded(name):
        return dataclasses.replace(base, max_frames=None, cap_method=None)
    bounded = tuple(n for n in METHODS if is_bounded(n))
    return dataclasses.replace(base, max_frames=FULL_FRAME_CAP, cap_method=name, bounded_methods=bounded)
