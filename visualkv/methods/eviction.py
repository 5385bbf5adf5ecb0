"""Shared helpers for score-based eviction of visual entries (per layer, per KV head)."""

from __future__ import annotations

import torch

from visualkv.methods.base import PrefillContext


def evict_to_budget(ctx: PrefillContext, layer_idx: int, scores: torch.Tensor, budget: int) -> int:
    """Keep the `budget` highest-scoring visual entries of each KV head.

    scores: (batch, kv_heads, n) over the layer's full-precision entries.
    Protected entries (text, special tokens) are never candidates. Every head
    holds the same number of visual entries (they all received the same
    blocks and lose the same count), so the kept tensors stay rectangular.
    Returns the number of entries evicted per head.
    """
    layer = ctx.cache.layers[layer_idx]
    visual = ctx.is_visual(layer.token_index)  # (b, h, n)
    excess = int(visual[0, 0].sum()) - budget
    if excess <= 0:
        return 0
    n = layer.token_index.shape[-1]
    ranked = scores.float().masked_fill(~visual, float("inf"))
    keep = ranked.topk(n - excess, dim=-1).indices
    layer.keep_full(keep)
    ctx.cache.refresh_bytes(layer_idx)
    return excess
