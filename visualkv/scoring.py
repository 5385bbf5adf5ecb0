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
    # -cos(key, anchor) with the keys already unit length: the product with the anchor's unit vector, negated on
    # the (b, h, 1, d) anchor rather than on the scores; an elementwise product and a sum dispatch 2 operations
    # where a matmul's reshapes dispatch 8 (this runs for every layer of every block: host time on a GPU)
    minus_unit = anchor / anchor.norm(dim=-1, keepdim=True).clamp_min(1e-8).neg()
    return (normed * minus_unit).sum(dim=-1)  # (b, h, n)


def snapkv_scores(
    queries: torch.Tensor,
    keys: torch.Tensor,
    kernel_size: int = 5,
    key_mask: torch.Tensor | None = None,
    grid_keys: torch.Tensor | None = None,
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
    tokens are kept together, as in the SnapKV paper). With ``grid_keys``
    ((batch, kv_heads, tokens) int64, from `grid_keys`), the pool runs along
    each key's *original* token order within its tile / frame instead of cache
    order (see `pool_along_grid`): after eviction, neighbours in the cache are
    not neighbours in the image.
    """
    return snapkv_scores_grouped(snapkv_query_groups(queries, keys.shape[1]), keys, kernel_size, key_mask, grid_keys)


def snapkv_query_groups(queries: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(batch * kv_heads, group * window, head_dim): the queries that read each KV head, in their own dtype (a
    view of contiguous queries). A block-wise prefill groups them once per layer and scores every block with
    them."""
    batch, q_heads, window, head_dim = queries.shape
    if q_heads % kv_heads:
        raise ValueError(f"q_heads={q_heads} is not a multiple of kv_heads={kv_heads}")
    return queries.reshape(batch * kv_heads, q_heads // kv_heads * window, head_dim)


def snapkv_scores_grouped(
    query_groups: torch.Tensor,
    keys: torch.Tensor,
    kernel_size: int = 5,
    key_mask: torch.Tensor | None = None,
    grid_keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """`snapkv_scores` with the queries made by `snapkv_query_groups` (a few operations per call: it runs for
    every layer of every block, and each operation is host time on a GPU)."""
    batch, kv_heads, n_tokens, head_dim = keys.shape
    if n_tokens == 0:
        return keys.new_zeros((batch, kv_heads, 0), dtype=torch.float32)
    flat_keys = keys.float().reshape(batch * kv_heads, n_tokens, head_dim)
    logits = torch.bmm(query_groups.float(), flat_keys.transpose(1, 2)).view(batch, kv_heads, -1, n_tokens)
    logits.div_(head_dim**0.5)
    if key_mask is not None:
        logits = logits.masked_fill(~key_mask.expand(batch, kv_heads, n_tokens)[:, :, None, :], float("-inf"))
    probs = logits.softmax(dim=-1).mean(dim=2)  # (b, kv, n)
    if kernel_size > 1 and grid_keys is not None:
        return pool_along_grid(probs, grid_keys, kernel_size=kernel_size)
    if kernel_size > 1:
        probs = F.avg_pool1d(
            probs.reshape(batch * kv_heads, 1, n_tokens),
            kernel_size=kernel_size,
            stride=1,
            padding=kernel_size // 2,
            count_include_pad=False,
        )[..., :n_tokens].reshape(batch, kv_heads, n_tokens)
    return probs


#: how far apart `grid_keys` puts entries that must never pool together: more than any pooling radius
GRID_KEY_GAP = 1 << 16
_PAD_KEY = -(1 << 52)  # the pad of `pool_along_grid`'s key windows: farther than the gap from every key


def grid_keys(coord: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """One int64 key per entry for `pool_along_grid`, from its place in the original token order `coord`
    (>= 0) and its tile / frame `group` (-1: an entry that pools with nobody, e.g. protected text): two entries
    are neighbours within a radius r < GRID_KEY_GAP exactly when their keys differ by at most r (same group,
    coordinates within r). Groups lie a stride apart; each group -1 entry gets a key of its own, below every
    other. Reads no tensor value on the host."""
    coord, group = coord.long(), group.long()
    stride = (coord.max() if coord.numel() else 0) + GRID_KEY_GAP
    own = -GRID_KEY_GAP * (torch.arange(1, coord.numel() + 1).view(coord.shape))  # distinct, far below the groups
    return torch.where(group >= 0, group * stride + coord, own)


def pool_along_grid(scores: torch.Tensor, keys: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """Average each score with those of its neighbours in original token order, within one tile/frame.

    scores, keys: (batch, kv_heads, n), keys from `grid_keys`, sorted along the last axis (as the cache keeps
    its entries). A neighbour counts when its key is within ``kernel_size // 2`` of the centre's: same tile /
    frame, original coordinate that close; evicted neighbours are simply absent (like padding that is not
    counted). With nothing evicted and one group this is ``avg_pool1d`` with ``count_include_pad=False``.
    Within a tile / frame the keys are distinct and increase with the cache slot, so every such neighbour lies
    within ``kernel_size // 2`` cache slots: one windowed view (`unfold`) of that many slots either side does it
    in a dozen operations, with no host synchronisation (a loop over shifts cost ~50 launches per layer per
    block).
    """
    if kernel_size // 2 >= GRID_KEY_GAP:
        raise ValueError(f"kernel_size {kernel_size} is too wide for grid keys (at most {2 * GRID_KEY_GAP - 1})")
    n = scores.shape[-1]
    radius = min(kernel_size // 2, n - 1)
    if radius <= 0:
        return scores.float().clone()
    width, pad = 2 * radius + 1, (radius, radius)
    # (b, h, n, width): each entry's neighbourhood in cache order (itself included: a key is near itself)
    near_scores = F.pad(scores.float(), pad).unfold(-1, width, 1)
    near = (F.pad(keys, pad, value=_PAD_KEY).unfold(-1, width, 1) - keys[..., None]).abs() <= kernel_size // 2
    return (near_scores * near).sum(-1) / near.sum(-1)


def keydiff_working_bytes(keys: torch.Tensor) -> int:
    """Transient bytes `keydiff_scores` allocates: the float32 normalised keys (plus a float32 copy)."""
    return 2 * keys.numel() * 4


def snapkv_working_bytes(query_groups: torch.Tensor, keys: torch.Tensor) -> int:
    """Transient bytes `snapkv_scores_grouped` allocates with `query_groups` (from `snapkv_query_groups`): float32
    keys, logits and probabilities (b * kv, g * w, n)."""
    return keys.numel() * 4 + 2 * query_groups.shape[0] * query_groups.shape[1] * keys.shape[2] * 4
