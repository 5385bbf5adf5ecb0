"""The uncompressed baseline: every entry kept, bulk prefill by default."""

from __future__ import annotations

from visualkv.methods.base import Method


class FullCache(Method):
    """Keeps everything. With `--prefill blockwise` it runs the same blocks as
    the block-wise methods without evicting, which is how their exactness is
    checked."""

    name = "full"
    description = "No compression: the reference for memory, latency and answers."
    plain = "keeps everything: no compression, the reference to compare with"
    default_prefill = "bulk"
    compose_refusal = "it keeps everything: leave it out"
