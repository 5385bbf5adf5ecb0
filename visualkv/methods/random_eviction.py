"""Block-wise random eviction: the control baseline every KV-compression study reports.

The same budget and block schedule as block-wise KeyDiff / SnapKV, but the kept set is chance: each visual token
gets a fixed uniform priority per layer (drawn once from `seed`), and every eviction keeps the highest priorities.
Fixed priorities make the surviving set, over all blocks, a uniform random M-subset of the visual tokens read
(reservoir sampling), the same whatever the block size; one seed gives the same kept set run to run and on any
device (drawn on the host, copied once per prefill). Read a method's accuracy and evidence recall against it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from visualkv.devices import to_device
from visualkv.methods.base import PrefillContext
from visualkv.methods.options import Options, option
from visualkv.methods.scorer import BlockwiseScorer


@dataclass
class RandomConfig(Options):
    label = "blockwise-random"
    seed: int = option(
        0, "seed of the random priorities that decide the kept set (one seed, one kept set)",
        low=0, high=2**32 - 1, whole=True, flag="--random-seed",
    )  # fmt: skip


class BlockwiseRandom(BlockwiseScorer):
    name = "blockwise-random"
    description = "Block-wise prefill; keep a uniformly random set of visual tokens (the chance baseline, seeded)."
    plain = "keeps a random share of the media: the baseline any method should beat"
    compose_role = None
    compose_refusal = "it is the chance baseline: compare against it rather than stack it"
    Config = RandomConfig

    def begin(self, ctx: PrefillContext) -> None:
        """(layers, conversation length + 1) uniform priorities from `seed`, layer by layer, on the host."""
        generator = torch.Generator().manual_seed(self.config.seed)
        n = ctx.seq_offset + ctx.prepared.seq_len + 1
        self.priorities = {torch.device("cpu"): torch.rand((ctx.adapter.num_layers, n), generator=generator)}

    def score(self, ctx: PrefillContext, layer_idx: int, keys: torch.Tensor, token_index: torch.Tensor) -> torch.Tensor:
        """(b, h, n): each entry's fixed random priority at this layer (the same on every KV head)."""
        if token_index.device not in self.priorities:  # copied once per device
            self.priorities[token_index.device] = to_device(self.priorities[torch.device("cpu")], token_index.device)
        table = self.priorities[token_index.device]
        return table[layer_idx][token_index.long().clamp(max=table.shape[1] - 1)]
