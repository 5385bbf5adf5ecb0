"""The step channel: what one decoder layer call needs beyond transformers' own arguments.

transformers' decoder layers call `cache.update(key, value, layer_idx)` and the attention function with their own
arguments only. What VisualKV adds to a layer call travels as one `Step`: the sequence indices and precision
tiers of the new entries (read by `CompressibleCache.update`), the layer's packed tiers, the mask of a block
after cached entries and the decode path (read by the attention functions, `visualkv.attention.packed`).

The engine and the fixed-shape decoder run each layer inside `running(step)`; `current()` reads it. It is a
context variable, so it is per thread (another chat's thread running the same model sees its own step or none)
and `running` resets it on exit, also when the layer raises or a Stop ends the call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from visualkv.attention.block import AfterCache


@dataclass(frozen=True, eq=False)  # holds tensors: compared by identity
class Step:
    """One decoder layer call of a block (or of a decode step).

    token_index: (q,) sequence indices of the new entries on the layer's device; None: they follow the held ones.
    tiers: {tier: positions in the block} (`kv.cache.split_tiers`, on the layer's device); None: all full precision.
    n_visual: visual entries among the block's full-precision ones (host int, for eviction's count).
    segments: the layer's packed tiers as held before this call (`CompressibleLayer.packed_segments`), which its
      attention call adds, dequantized for that call only.
    after_cache: the mask of a block after cached entries (all of them visible, the block causal), for the
      wrapped sdpa / eager functions; None: the mask transformers passes (if any) is the whole mask.
    grouped_decode: a fixed-shape decode step over its window, attended by `packed.one_query`.
    """

    token_index: torch.Tensor | None = None
    tiers: dict[int, torch.Tensor] | None = None
    n_visual: int = 0
    segments: Sequence[Any] = ()
    after_cache: AfterCache | None = None
    grouped_decode: bool = False


_CURRENT: ContextVar[Step | None] = ContextVar("visualkv_step", default=None)


def current() -> Step | None:
    """The step of the layer call running in this thread (context), or None outside one."""
    return _CURRENT.get()


@contextlib.contextmanager
def running(step: Step) -> Iterator[Step]:
    """Within: `current()` is `step` in this thread; on exit (normal, error, Stop) what it was before."""
    token = _CURRENT.set(step)
    try:
        yield step
    finally:
        _CURRENT.reset(token)
