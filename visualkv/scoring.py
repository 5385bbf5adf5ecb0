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
    return -F.cosine_similarity(normed, anchor, dim=-1)  # (b, h, n)


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
    are distinct and sorted, so every such neighbour lies within ``kernel_size // 2`` cache slots:
    ``kernel_size`` shifted views do it, with no host synchronisation.
    """
    radius = kernel_size // 2
    n = scores.shape[-1]
    total = scores.float().clone()
    count = torch.ones_like(total)
    for shift in range(1, radius + 1):
        if shift >= n:
            break
        for here, there in ((slice(shift, None), slice(None, n - shift)), (slice(None, n - shift), slice(shift, None))):
            near = (
                (group[..., here] == group[..., there])
                & (group[..., here] >= 0)
                & ((coord[..., here] - coord[..., there]).abs() <= radius)
            )
            total[..., here] += torch.where(near, scores[..., there].float(), 0.0)
            count[..., here] += near.float()
    return total / count


def keydiff_working_bytes(keys: torch.Tensor) -> int:
    """Transient bytes `keydiff_scores` allocates: the float32 normalised keys (plus a float32 copy)."""
    return 2 * keys.numel() * 4


def snapkv_working_bytes(queries: torch.Tensor, keys: torch.Tensor) -> int:
    """Transient bytes `snapkv_scores` allocates: float32 keys, logits and probabilities (b, kv, g*w, n)."""
    batch, q_heads, window, _ = queries.shape
    return keys.numel() * 4 + 2 * batch * q_heads * window * keys.shape[2] * 4
