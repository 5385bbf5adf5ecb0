"""Post-prefill SnapKV: the baseline whose peak the block-wise paper removes.

The whole input is prefilled into a full cache (bulk), then each layer is
compressed once to the same budget, scoring with the real observation window
(the question's own queries, captured during the forward). Same final size as
block-wise, but the peak is the full cache.
"""

from __future__ import annotations

import torch

from visualkv.methods.base import LayerState, Method, PrefillContext
from visualkv.methods.blockwise import SnapKVConfig, grid_keys_of, proxy_queries
from visualkv.methods.eviction import evict_to_budget
from visualkv.scoring import snapkv_scores


class PostPrefillSnapKV(Method):
    name = "post-snapkv"
    description = "Full prefill, then SnapKV compression to the budget (full peak memory)."
    plain = "reads all the media at once, then keeps the parts your question looks at (needs the full memory first)"
    default_prefill = "bulk"
    needs_budget = True
    query_aware = True
    compose_refusal = (
        "it compresses once after a full prefill, so it bounds nothing per block; compose blockwise-snapkv"
    )

    Config = SnapKVConfig

    def begin(self, ctx: PrefillContext) -> None:
        self.window_queries: dict[int, torch.Tensor] = {}

    def after_layer(self, ctx: PrefillContext, state: LayerState) -> None:
        # Capture the observation window where the question's tokens are in the block (they end it, and
        # text is never dropped): counted from the block's host-side span, so no tensor is read.
        n_suffix = ctx.block.end - max(ctx.block.start, ctx.prepared.suffix_start) if ctx.block is not None else 0
        if n_suffix > 0:
            w = min(self.config.window, n_suffix, state.hidden_in.shape[1])
            q = ctx.adapter.query_states(state.layer_idx, state.hidden_in[:, -w:], state.cos[:, -w:], state.sin[:, -w:])
            self.window_queries[state.layer_idx] = q

    def end(self, ctx: PrefillContext) -> None:
        if ctx.budget is None:
            return
        window = self.window_queries
        if self.proxy_ids is not None:  # follow-up re-prefill: score with the new question
            window = dict(enumerate(proxy_queries(ctx, self.config.window, self.proxy_ids)))
        for layer_idx, queries in window.items():
            ctx.stop_if_asked()  # scoring a long video's whole cache, layer by layer
            layer = ctx.cache.layers[layer_idx]
            scores = snapkv_scores(
                queries.to(layer.keys.device),
                layer.keys,
                kernel_size=self.config.kernel_size,
                grid_keys=grid_keys_of(ctx, layer.token_index),
            )
            evict_to_budget(ctx, layer_idx, scores, ctx.budget)
