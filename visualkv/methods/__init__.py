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
