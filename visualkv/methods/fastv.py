"""FastV: after layer K, drop the R% visual tokens the last prompt token attends to least.

FastV (Chen et al., ECCV 2024, "An Image is Worth 1/2 Tokens After Layer 2") observes that past the first layers a
VLM's attention to image tokens is sparse: at layer K it ranks the visual tokens by the attention the last prompt
token pays them (layer K-1's attention map, averaged over heads) and removes the lowest R% from the sequence for
every later layer. Defaults K = 2, R = 50% (the paper's setting on 32-layer LLaVA-1.5); here K defaults to 2 of 32
scaled to the model's depth (at least 1), so a 28-layer Qwen2.5-VL prunes after layer 2. Layers before K keep every
visual token; layers from K on never see (nor store) the dropped ones, which keep their original positions.
Where it acts: inside the one prefill forward, at one layer. It bounds the cache after that layer (the peak of a
prefill still holds the whole input in layers below K). The ranking needs the last prompt token in the same
forward as the media, so the whole prompt runs as one block (`--prefill bulk`, its default); block-wise
prefill and composition with block-wise eviction are refused. Limits: the kept set follows this question.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from visualkv.devices import to_device
from visualkv.errors import ConfigError
from visualkv.methods import register
from visualkv.methods.base import LayerState, Method, PrefillContext
from visualkv.methods.options import Options, option

PAPER_LAYER, PAPER_DEPTH = 2, 32  # K = 2 on LLaVA-1.5 7B's 32 decoder layers


@dataclass
class FastVConfig(Options):
    label = "fastv"
    layer: int = option(
        0, "K: layers from K on drop the tokens (0: the paper's 2 of 32 scaled to the model's depth, at least 1)",
        low=0, high=1000, whole=True, flag="--fastv-layer",
    )  # fmt: skip
    ratio: float = option(
        0.5, "R: fraction of the visual tokens dropped after layer K (lowest attention from the last token)",
        low=0.0, high=1.0, flag="--fastv-ratio",
    )  # fmt: skip


@register
class FastV(Method):
    name = "fastv"
    description = "One bulk prefill; after layer K drop the visual tokens the last token attends to least (bounds the cache after it, not the peak)."
    plain = "reads all the media at once; after the first layers drops the half the question looks at least"
    Config = FastVConfig
    query_aware = True
    compose_refusal = "it ranks by the last prompt token's attention, so it needs the whole prompt in one forward"

    def pruning_layer(self, num_layers: int) -> int:
        """K, 1 <= K < num_layers: the configured one or the paper's scaled; ConfigError if the model is too shallow."""
        k = self.config.layer or max(1, round(PAPER_LAYER * num_layers / PAPER_DEPTH))
        if k >= num_layers:
            raise ConfigError(f"fastv layer {k} must be below the model's {num_layers} decoder layers")
        return k

    def visual_kept_by_layer(self, adapter, prepared, visual_ids: np.ndarray) -> list[tuple[int, int]]:
        k, n = self.pruning_layer(adapter.num_layers), len(visual_ids)
        return [(k, n), (adapter.num_layers - k, n - int(self.config.ratio * n))]

    def begin(self, ctx: PrefillContext) -> None:
        prepared = ctx.prepared
        if len(ctx.blocks) != 1 or ctx.blocks[0].end != prepared.seq_len:
            raise ConfigError(
                "fastv ranks by the last prompt token's attention: run the prompt as one block (--prefill bulk)"
            )
        self.k = self.pruning_layer(ctx.adapter.num_layers)
        self.visual_of_block = (prepared.visual_mask & prepared.keep)[prepared.keep]  # (q,) host, kept tokens
        self.n_visual = int(self.visual_of_block.sum())
        self.n_dropped = int(self.config.ratio * self.n_visual)

    def after_layer(self, ctx: PrefillContext, state: LayerState) -> LayerState | None:
        if state.layer_idx != self.k - 1 or self.n_dropped == 0:
            return None
        adapter, i, q = ctx.adapter, state.layer_idx, state.hidden.shape[1]
        last = adapter.query_states(i, state.hidden_in[:, -1:], state.cos[:, -1:], state.sin[:, -1:])  # (1, Hq, 1, d)
        keys = ctx.cache.layers[i].keys[0]  # (Hkv, n, d): the whole conversation, nothing evicted below K
        scale = getattr(adapter.layers[i].self_attn, "scaling", adapter.head_dim**-0.5)
        hq, hkv = last.shape[1], keys.shape[0]
        query = last[0, :, 0].float().view(hkv, hq // hkv, -1)  # (Hkv, group, d)
        attention = (torch.einsum("hgd,hnd->hgn", query, keys.float()) * scale).softmax(-1).mean(dim=(0, 1))
        visual = to_device(self.visual_of_block, attention.device)
        ranked = attention[-q:].masked_fill(~visual, float("inf"))  # text always stays
        keep = ranked.topk(q - self.n_dropped).indices.sort().values  # kept rows, in order
        return LayerState(
            layer_idx=i,
            hidden_in=state.hidden_in,
            hidden=state.hidden.index_select(1, keep),
            # positions / token indices may sit on the host (a re-prefilled follow-up): moved, never read back
            positions=to_device(state.positions, keep.device).index_select(1, keep),
            token_index=to_device(state.token_index, keep.device).index_select(0, keep),
            cos=state.cos.index_select(1, keep),
            sin=state.sin.index_select(1, keep),
            n_visual=self.n_visual - self.n_dropped,
        )

    def report(self, ctx: PrefillContext) -> dict[str, Any]:
        return {"fastv_layer": self.k, "fastv_dropped": self.n_dropped}
