"""Shared helpers for score-based eviction of visual entries (per layer, per KV head, per precision tier)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from visualkv.kv.cache import TIER_FULL, TIER_INT4, TIER_INT8
from visualkv.kv.quant import dequantize_all
from visualkv.methods.base import PrefillContext

#: scores (b, h, n) of the entries with keys (b, h, n, d) and token indices (b, h, n), and the transient
#: bytes the scorer allocated
Scorer = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, int]]


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
    working = scratch_bytes + scores.nbytes + _keep_full(ctx, layer, scores, excess, budget)
    ctx.cache.refresh_bytes(layer_idx, working)
    return excess


def _keep_full(ctx: PrefillContext, layer, scores: torch.Tensor, excess: int, budget: int) -> int:
    """Drop the `excess` lowest-scoring visual full-precision entries of each KV head, leaving `budget`; the
    transient bytes it held."""
    visual = ctx.is_visual(layer.token_index)  # (b, h, n)
    ranked = scores.float().masked_fill(~visual, float("inf"))
    keep = ranked.topk(layer.n_full - excess, dim=-1).indices
    layer.keep_full(keep)
    layer.visual_entries = budget
    return visual.nbytes + ranked.nbytes + keep.nbytes + layer.working_bytes


def tier_budgets(budget: int, shares: tuple[float, float, float] | None) -> dict[int, int]:
    """M split across the tiers (full, int8, int4) in proportion to `shares`; the parts sum to M.

    Per-tier budgets keep every tier's tensors rectangular across heads (each head loses the same count
    in each tier). Largest remainders round, so a tier never gets more than its share plus one.
    """
    if shares is None or sum(shares) <= 0:
        return {TIER_FULL: budget}
    total = sum(shares)
    exact = [budget * s / total for s in shares]
    parts = [math.floor(x) for x in exact]
    for i in sorted(range(3), key=lambda i: parts[i] - exact[i])[: budget - sum(parts)]:
        parts[i] += 1
    return dict(zip((TIER_FULL, TIER_INT8, TIER_INT4), parts))


def evict_tiers(ctx: PrefillContext, layer_idx: int, scorer: Scorer, budget: int) -> int:
    """Bound every tier of a layer: at most `budget` visual entries per KV head over all tiers.

    Without packed entries this is `evict_to_budget` on the full-precision keys. With packed INT8 / INT4
    entries (Sali-Cache tiers), M is split by `ctx.tier_shares` (`tier_budgets`) and all entries are
    scored together, so the scores are the same as if nothing were packed: the packed keys are
    dequantized transiently on the layer's device, the entries put in token order (SnapKV pools along
    it), scored once, and each tier keeps its highest-scoring entries. Counts are host ints, so deciding
    needs no device read. Returns the entries evicted per head, all tiers together.
    """
    layer = ctx.cache.layers[layer_idx]
    budgets = tier_budgets(budget, ctx.tier_shares)
    counts = layer.visual_by_tier()
    if len(counts) == 1:  # full precision only: the block-wise path as it always was
        scores, scratch = scorer(layer.keys, layer.token_index)
        return evict_to_budget(ctx, layer_idx, scores, budgets[TIER_FULL], scratch)
    excess = {tier: n - budgets.get(tier, 0) for tier, n in counts.items()}
    if all(e <= 0 for e in excess.values()):
        return 0
    segments = layer.quant
    packed = [t for t in counts if t != TIER_FULL]  # ascending tier codes, as `visual_by_tier` lists them
    keys = dequantize_all([segments[t].keys for t in packed], layer.keys)  # (b, h, n, d) transient
    index = torch.cat([segments[t].token_index for t in packed] + [layer.token_index], dim=2)  # (b, h, n)
    in_order, perm = index.sort(dim=-1)
    by_token = keys.gather(2, perm[..., None].expand_as(keys))
    sorted_scores, scratch = scorer(by_token, in_order)
    scores = torch.empty_like(sorted_scores).scatter_(-1, perm, sorted_scores)  # back to [packed... | full]
    working = scratch + 2 * keys.nbytes + 2 * index.nbytes + perm.nbytes + 2 * scores.nbytes
    evicted, at = 0, 0
    for tier in packed:
        n = counts[tier]
        if excess[tier] > 0:
            keep = scores[..., at : at + n].float().topk(n - excess[tier], dim=-1).indices
            layer.keep_quant(tier, keep)
            working += keep.nbytes + layer.working_bytes
            evicted += excess[tier]
        at += n
    if excess[TIER_FULL] > 0:
        working += _keep_full(ctx, layer, scores[..., at:], excess[TIER_FULL], budgets[TIER_FULL])
        evicted += excess[TIER_FULL]
    ctx.cache.refresh_bytes(layer_idx, working)
    return evicted
