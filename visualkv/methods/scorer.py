"""Score-only methods: a scorer ranks a layer's entries, the block-wise schedule here does everything else.

A scorer subclasses `BlockwiseScorer`, declares its name, description and `Config`, and defines `score` (plus
`begin` for what it precomputes, kept on `self`). After every decoder layer of every block this base keeps each
layer's `budget` highest-scoring visual entries per KV head over every precision tier (`evict_tiers`: Sali-Cache's
packed INT8 / INT4 too), so the cache never holds more than budget + one block + the protected tokens
(`capacity_bound`, which sizes its buffers once). The ACL Findings 2026 block-wise prefill, for any scorer.
"""

from __future__ import annotations

import torch

from visualkv.layout import Block
from visualkv.methods.base import LayerState, Method, PrefillContext
from visualkv.methods.eviction import evict_tiers
from visualkv.models.base import PreparedInput


class BlockwiseScorer(Method):
    default_prefill = "hybrid"
    needs_budget = True
    evicts_per_block = True
    compose_role = "evict"

    def layer_budget(self, ctx: PrefillContext, layer_idx: int) -> int:
        """Visual entries per KV head layer `layer_idx` keeps after a block: the budget M on every layer, unless a
        method spreads it over the layers (PyramidKV; its `capacity_hint` then sizes each layer)."""
        return ctx.budget

    def score(self, ctx: PrefillContext, layer_idx: int, keys: torch.Tensor, token_index: torch.Tensor) -> torch.Tensor:
        """(b, h, n) keep scores (higher stays) of a layer's entries with `keys` (b, h, n, d), post-RoPE as
        cached, and global `token_index` (b, h, n), in token order."""
        raise NotImplementedError

    def scratch_bytes(self, layer_idx: int, keys: torch.Tensor) -> int:
        """Transient bytes `score` allocates for `keys` (the device peak counts them): here its float32 scores."""
        return keys.shape[0] * keys.shape[1] * keys.shape[2] * 4

    @classmethod
    def capacity_bound(cls, budget: int | None, blocks: list[Block], prepared: PreparedInput) -> int | None:
        if budget is None or not blocks:
            return None
        protected = prepared.seq_len - int(prepared.visual_mask.sum())
        return min(budget + max(b.end - b.start for b in blocks) + protected, prepared.seq_len)  # never past the input

    def after_layer(self, ctx: PrefillContext, state: LayerState) -> None:
        if ctx.budget is not None and ctx.block is not None and ctx.block.units:
            i = state.layer_idx

            def scorer(keys: torch.Tensor, token_index: torch.Tensor) -> tuple[torch.Tensor, int]:
                return self.score(ctx, i, keys, token_index), self.scratch_bytes(i, keys)

            evict_tiers(ctx, i, scorer, self.layer_budget(ctx, i))
