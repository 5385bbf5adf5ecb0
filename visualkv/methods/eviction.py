"""Shared helpers for score-based eviction of visual entries (per layer, per KV head)."""

from __future__ import annotations

import torch

from visualkv.methods.base import PrefillContext


def evict_to_budget(
    ctx: PrefillContext, layer_idx: int, scores: torch.Tensor, budget: int, scratch_bytes: int = 0
) -> int:
    """Keep the `budget` highest-scoring visual entries of each KV head.

    scores: (batch, kv_heads, n) over the layer's full-precision entries.
    Protected entries (text, special tokens) are never candidates. Every head
    holds the same number of visual entries (they all received the same
    blocks and lose the same count), so the kept tensors stay rectangular; that
    count is a host int kept by the cache, so deciding needs no device read.
    scratch_bytes: transient bytes the scorer allocated (for the device peak).
    Returns the number of entries evicted per head.
    """
    layer = ctx.cache.layers[layer_idx]
    excess = layer.visual_entries - budget
    if excess <= 0:
        ctx.cache.note_working(scratch_bytes)
        return 0
    visual = ctx.is_visual(layer.token_index)  # (b, h, n)
    ranked = scores.float().masked_fill(~visual, float("inf"))
    keep = ranked.topk(layer.n_full - excess, dim=-1).indices
    layer.keep_full(keep)
    layer.visual_entries = budget
    working = scratch_bytes + scores.nbytes + visual.nbytes + ranked.nbytes + keep.nbytes + layer.working_bytes
    ctx.cache.refresh_bytes(layer_idx, working)
    return excess
