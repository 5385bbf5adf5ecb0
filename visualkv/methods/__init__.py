"""Compression methods. Each is a small class the engine calls at fixed points."""

from __future__ import annotations

from visualkv.methods.base import Method
from visualkv.methods.blockwise import BlockwiseKeyDiff, BlockwiseSnapKV
from visualkv.methods.full import FullCache
from visualkv.methods.lightkv import LightKV
from visualkv.methods.post_prefill import PostPrefillSnapKV
from visualkv.methods.salicache import SaliCache

METHODS: dict[str, type[Method]] = {
    cls.name: cls for cls in (FullCache, BlockwiseKeyDiff, BlockwiseSnapKV, PostPrefillSnapKV, SaliCache, LightKV)
}


def make_method(name: str, **options) -> Method:
    """Instantiate a method by name; raises ValueError listing the known ones."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose one of: {', '.join(METHODS)}")
    return METHODS[name](**options)


# -- frame caps that follow the method (issue 14) ---------------------------------------------------
FULL_FRAME_CAP = 512  # sampled frames for methods that hold every frame's KV at once (memory guard aside)


def is_bounded(name: str) -> bool:
    """Does method `name` evict per block, so its memory does not grow with the video (no frame cap)?"""
    cls = METHODS.get(name)
    return bool(cls is not None and cls.evicts_per_block)


def media_limits(name: str, base=None):
    """`base` (default MediaLimits()) with the frame cap of method `name`: none for a bounded method
    (only the video-length limit applies), FULL_FRAME_CAP otherwise, its refusal naming the bounded ones."""
    import dataclasses

    from visualkv.media import MediaLimits

    base = base or MediaLimits()
    if is_bounded(name):
        return dataclasses.replace(base, max_frames=None, cap_method=None)
    bounded = tuple(n for n in METHODS if is_bounded(n))
    return dataclasses.replace(base, max_frames=FULL_FRAME_CAP, cap_method=name, bounded_methods=bounded)
