"""Pure scoring functions for KV eviction (no model, no state).

Every scorer returns a tensor shaped (batch, kv_heads, tokens) where a higher
value means "keep". Scores are compared only within one (batch, kv_head) row,
so they need not be calibrated across heads or layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def keydiff_scores(keys: torch.Tensor) -> torch.Tensor:
    """KeyDiff: distinctiveness of each key against the mean key direction.

    keys: (batch, kv_heads, tokens, head_dim), post-RoPE as cached.
    anchor = mean over tokens of the L2-normalised keys (per head);
    score = -cos(key, anchor). Needs no attention weights, so it works with
    any attention kernel and does not depend on the (future) question.
    """
    normed = F.normalize(keys.float(), dim=-1)  # (b, h, n, d)
    anchor = normed.mean(dim=2, keepdim=True)  # (b, h, 1, d)
    # cos(key, anchor) with the keys already unit length: one product and the anchor's norm (fewer
    # launches per layer per block than F.cosine_similarity, which normalises both sides again)
    cosine = (normed @ anchor.transpose(-1, -2)).squeeze(-1) / anchor.norm(dim=-1).clamp_min(1e-8)
    return -cosine  # (b, h, n)


def snapkv_scores(
    queries: torch.Tensor,
    keys: torch.Tensor,
    kernel_size: int = 5,
    key_mask: torch.Tensor | None = None,
    grid: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """SnapKV: attention the observation-window queries pay to each key.

    queries: (batch, q_heads, window, head_dim), post-RoPE.
    keys: (batch, kv_heads, tokens, head_dim), post-RoPE; q_heads must be a
    multiple of kv_heads (GQA: consecutive query heads share one KV head).
    key_mask: optional bool (batch, kv_heads, tokens) or (tokens,), False for
    keys that must not take part in the softmax (e.g. padding).

    The softmax runs over all keys for each query; probabilities are averaged
    over the window and over the query heads of a group, then smoothed with a
    1-D average pool of ``kernel_size`` over token order (neighbouring visual
    tokens are kept together, as in the SnapKV paper). With ``grid`` =
    (coord, group), both (batch, kv_heads, tokens) long, the pool runs along
    each key's *original* token order instead of cache order (see
    `pool_along_grid`): after eviction, neighbours in the cache are not
    neighbours in the image.
    """
    batch, q_heads, window, head_dim = queries.shape
    kv_heads, n_tokens = keys.shape[1], keys.shape[2]
    if q_heads % kv_heads:
        raise ValueError(f"q_heads={q_heads} is not a multiple of kv_heads={kv_heads}")
    group = q_heads // kv_heads
    if n_tokens == 0:
        return keys.new_zeros((batch, kv_heads, 0), dtype=torch.float32)
    # (b, kv, group*window, d): the queries that read each KV head.
    q = queries.float().reshape(batch, kv_heads, group * window, head_dim)
    logits = q @ keys.float().transpose(-1, -2) / head_dim**0.5  # (b, kv, g*w, n)
    if key_mask is not None:
        logits = logits.masked_fill(~key_mask.expand(batch, kv_heads, n_tokens)[:, :, None, :], float("-inf"))
    probs = logits.softmax(dim=-1).mean(dim=2)  # (b, kv, n)
    if kernel_size > 1 and grid is not None:
        return pool_along_grid(probs, *grid, kernel_size=kernel_size)
    if kernel_size > 1:
        probs = F.avg_pool1d(
            probs.reshape(batch * kv_heads, 1, n_tokens),
            kernel_size=kernel_size,
            stride=1,
            padding=kernel_size // 2,
            count_include_pad=False,
        )[..., :n_tokens].reshape(batch, kv_heads, n_tokens)
    return probs


def pool_along_grid(scores: torch.Tensor, coord: torch.Tensor, group: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """Average each score with those of its neighbours in original token order, within one tile/frame.

    scores, coord, group: (batch, kv_heads, n), entries sorted by `coord` along the last axis (as the
    cache keeps them). `coord` is the entry's place in the original token order (e.g. its visual
    token id), `group` its tile / frame (-1: an entry that pools with nobody, e.g. protected text).
    A neighbour counts when it is in the same group and its coordinate is within ``kernel_size // 2``
    of the centre's; evicted neighbours are simply absent (like padding that is not counted). With
    nothing evicted and one group this is ``avg_pool1d`` with ``count_include_pad=False``. Coordinates
    are distinct and sorted, so every such neighbour lies within ``kernel_size // 2`` cache slots: one
    windowed view (`unfold`) of that many slots either side does it in a fixed handful of kernels, with
    no host synchronisation (a loop over shifts cost ~50 launches per layer per block).
    """
    n = scores.shape[-1]
    radius = min(kernel_size // 2, n - 1)
    if radius <= 0:
        return scores.float().clone()
    width, pad = 2 * radius + 1, (radius, radius)
    # (b, h, n, width): each entry's neighbourhood in cache order; padding is group -1 (pools with nobody)
    near_scores = F.pad(scores.float(), pad).unfold(-1, width, 1)
    near_group = F.pad(group, pad, value=-1).unfold(-1, width, 1)
    near_coord = F.pad(coord, pad).unfold(-1, width, 1)
    near = (
        (near_group == group[..., None])
        & (group[..., None] >= 0)
        & ((near_coord - coord[..., None]).abs() <= kernel_size // 2)
    )
    near[..., radius] = True  # the entry itself always counts (protected text too)
    return torch.where(near, near_scores, 0.0).sum(-1) / near.sum(-1)


def keydiff_working_bytes(keys: torch.Tensor) -> int:
    """Transient bytes `keydiff_scores` allocates: the float32 normalised keys (plus a float32 copy)."""
    return 2 * keys.numel() * 4


def snapkv_working_bytes(queries: torch.Tensor, keys: torch.Tensor) -> int:
    """Transient bytes `snapkv_scores` allocates: float32 keys, logits and probabilities (b, kv, g*w, n)."""
    batch, q_heads, window, _ = queries.shape
    return keys.numel() * 4 + 2 * batch * q_heads * window * keys.shape[2] * 4
