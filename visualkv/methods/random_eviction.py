"""Block-wise random eviction: the control baseline every KV-compression study reports.

The same budget and block schedule as block-wise KeyDiff / SnapKV, but the kept set is chance: each visual token
gets a fixed uniform priority per layer (drawn once from `seed`), and every eviction keeps the highest priorities.
Fixed priorities make the surviving set, over all blocks, a uniform random M-subset of the visual tokens read
(reservoir sampling), the same whatever the block size; one seed gives the same kept set run to run and on any
device (drawn on the host, copied once per prefill). Read a method's accuracy and evidence recall against it.
"""

from __future__ import annotations

import torch

from visualkv.errors import check_range
from visualkv.methods.base import PrefillContext
from visualkv.methods.blockwise import BlockwiseKeyDiff

MAX_SEED = 2**32 - 1


class BlockwiseRandom(BlockwiseKeyDiff):
    name = "blockwise-random"
    description = "Block-wise prefill; keep a uniformly random set of visual tokens (the chance baseline, seeded)."
    compose_role = None
    compose_refusal = "it is the chance baseline: compare against it rather than stack it"

    def __init__(self, seed: int = 0) -> None:
        check_range("blockwise-random seed", seed, 0, MAX_SEED, whole=True)
        self.seed = int(seed)

    def scores(
        self, ctx: PrefillContext, layer_idx: int, keys: torch.Tensor, token_index: torch.Tensor
    ) -> torch.Tensor:
        """(b, h, n): each entry's fixed random priority at this layer (the same on every KV head)."""
        table = ctx.table_on("random_priority", token_index.device, lambda: self._priorities(ctx))
        return table[layer_idx][token_index.long().clamp(max=table.shape[1] - 1)]

    def scratch_bytes(self, ctx: PrefillContext, layer_idx: int, keys: torch.Tensor) -> int:
        return keys.shape[0] * keys.shape[1] * keys.shape[2] * 4  # the gathered priorities (float32)

    def _priorities(self, ctx: PrefillContext) -> torch.Tensor:
        """(layers, conversation length + 1) uniform priorities from `seed`, layer by layer."""
        n = ctx.seq_offset + ctx.prepared.seq_len + 1
        generator = torch.Generator().manual_seed(self.seed)
        return torch.rand((ctx.adapter.num_layers, n), generator=generator)

    def config_dict(self) -> dict:
        return {"method": self.name, "seed": self.seed}
