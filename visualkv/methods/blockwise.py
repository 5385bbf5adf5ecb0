"""Block-wise prefill under a fixed budget (ACL Findings 2026): KeyDiff and SnapKV.

After every block, each layer keeps at most `budget` visual entries per KV head, so the cache never holds
more than budget + block + protected entries. Eviction happens right after the layer has processed the block,
the earliest moment all scores are known. Stacked with Sali-Cache (compose.py) the budget bounds every
precision tier (`evict_tiers`).

Each is a scorer (visualkv.methods.scorer): the schedule, every tier and the cache bound come from the base.
SnapKV needs queries from the question, which comes after the media: before the first visual block one
text-only pass over [prompt prefix + question + assistant prompt], the question at the positions it will
really occupy, gives each layer's post-RoPE query states as proxy queries (they see the prefix, not the image).
Limits: SnapKV's kept set is tuned to this question; a follow-up about something else may find its evidence
evicted (use KeyDiff, or `followup="reprefill"`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from visualkv.methods.base import LayerState, Method, PrefillContext
from visualkv.methods.options import Options, option
from visualkv.methods.scorer import BlockwiseScorer
from visualkv.scoring import (
    grid_keys,
    keydiff_scores,
    keydiff_working_bytes,
    snapkv_query_groups,
    snapkv_scores_grouped,
    snapkv_working_bytes,
)


@dataclass
class SnapKVConfig(Options):
    label = "snapkv"
    window: int = option(
        64, "question tokens whose attention scores the cached keys (proxy / observation queries)",
        low=1, high=4096, whole=True, shared_max=512,
    )  # fmt: skip
    kernel_size: int = option(
        5, "1-D pooling width that smooths scores over neighbouring tokens of a tile / frame",
        low=1, high=63, whole=True,
    )  # fmt: skip


class BlockwiseKeyDiff(BlockwiseScorer):
    name = "blockwise-keydiff"
    description = "Block-wise prefill; keep the most distinctive keys (query-agnostic, good for follow-ups)."
    plain = "reads the media piece by piece and keeps its most distinctive parts, whatever the question"

    def score(self, ctx: PrefillContext, layer_idx: int, keys: torch.Tensor, token_index: torch.Tensor) -> torch.Tensor:
        return keydiff_scores(keys)

    def scratch_bytes(self, layer_idx: int, keys: torch.Tensor) -> int:
        return keydiff_working_bytes(keys)


class BlockwiseSnapKV(BlockwiseScorer):
    name = "blockwise-snapkv"
    description = "Block-wise prefill; keep what the question attends to (query-aware)."
    plain = "reads the media piece by piece and keeps the parts your question looks at"
    query_aware = True
    Config = SnapKVConfig

    def begin(self, ctx: PrefillContext) -> None:
        queries = proxy_queries(ctx, self.config.window, self.proxy_ids)
        # grouped once per layer here (views), not once per block and layer
        self.query_groups = [snapkv_query_groups(q, ctx.adapter.num_kv_heads) for q in queries]

    def score(self, ctx: PrefillContext, layer_idx: int, keys: torch.Tensor, token_index: torch.Tensor) -> torch.Tensor:
        # a model split over devices: each layer's queries moved to its own device once
        groups = self.query_groups[layer_idx] = self.query_groups[layer_idx].to(keys.device)
        return snapkv_scores_grouped(groups, keys, self.config.kernel_size, grid_keys=grid_keys_of(ctx, token_index))

    def scratch_bytes(self, layer_idx: int, keys: torch.Tensor) -> int:
        return snapkv_working_bytes(self.query_groups[layer_idx], keys)


def grid_keys_of(ctx: PrefillContext, token_index: torch.Tensor) -> torch.Tensor:
    """`pool_along_grid`'s keys of cache entries with global `token_index` (b, h, n): from a visual entry's id in
    layout order and its tile / frame; an entry of anything else (protected text, earlier turns) pools with
    nobody. Entries past the input share the table's last slot: none exists while a prefill scores its cache.
    """

    def build() -> torch.Tensor:
        layout, seq_len = ctx.prepared.layout, ctx.prepared.seq_len
        vid = torch.from_numpy(layout.visual_id_of_seq(seq_len)).long()  # -1 for text
        frame = torch.full((seq_len,), -1, dtype=torch.long)
        frame[torch.from_numpy(layout.seq_index).long()] = torch.from_numpy(layout.frame).long()
        return grid_keys(ctx.conversation_table(vid, -1).clamp(min=0), ctx.conversation_table(frame, -1))

    return ctx.lookup(ctx.table_on("grid_keys", token_index.device, build), token_index)


class _QueryCapture(Method):
    """Records each layer's post-RoPE queries of the last `window` block tokens."""

    def __init__(self, adapter, window: int) -> None:
        self.adapter, self.window, self.queries = adapter, window, []

    def after_layer(self, ctx, state: LayerState) -> None:
        w = min(self.window, state.hidden_in.shape[1])
        queries = self.adapter.query_states(
            state.layer_idx, state.hidden_in[:, -w:], state.cos[:, -w:], state.sin[:, -w:]
        )
        self.queries.append(queries.detach())


def proxy_queries(ctx: PrefillContext, window: int, proxy_ids: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Per-layer proxy queries (1, q_heads, w, head_dim) from a text-only pass over the question, as it will
    stand after the media (`PrefillContext.question_pass`; `proxy_ids`: a follow-up question re-prefilled)."""
    ids, positions, n_question = ctx.question_pass(proxy_ids)
    # The window holds the question and the assistant prompt only (never the system prompt before the
    # media): the same tokens post-prefill SnapKV observes.
    capture = _QueryCapture(ctx.adapter, max(1, min(window, n_question)))
    ctx.text_pass(ids, positions, capture)
    return capture.queries
