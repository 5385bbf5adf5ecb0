"""Block-wise PyramidKV: SnapKV's scores, the budget spread over the layers as a pyramid (more in lower layers).

PyramidKV (Cai et al. 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling")
keeps more entries in the lower layers, where attention is spread wide, and fewer in the upper ones, where it
funnels onto a few tokens; each layer ranks its entries by SnapKV's scores. kvpress's `PyramidKVPress` gives
layer l of L the budget `round(max - l * (max - min) / (L - 1))` with `min = n / beta`, `max = 2 n - min`
(n: the average kept count, beta = 20 by default), `max` capped at the input with `min` raised to keep the same
total, and every layer `n` where that pyramid does not fit. Here n is the budget M and the input is the visual
tokens that enter the LLM; kvpress's `window_size` term is 0, as the question's window is protected text here
(kept on top, never one of the ranked entries). So the layers together keep about L x M visual entries per KV
head, as block-wise SnapKV does; the lowest holds up to 2M - M/beta. Scores, proxy queries and limits: SnapKV's.
"""

from __future__ import annotations

from dataclasses import dataclass

from visualkv.layout import Block
from visualkv.methods import register
from visualkv.methods.base import PrefillContext
from visualkv.methods.blockwise import BlockwiseSnapKV, SnapKVConfig
from visualkv.methods.options import option
from visualkv.models.base import PreparedInput


@dataclass
class PyramidKVConfig(SnapKVConfig):
    label = "pyramidkv"
    beta: float = option(
        20.0, "pyramid steepness: the top layer keeps budget / beta, the bottom one 2 x budget minus that",
        low=1.0, high=1000.0, flag="--pyramid-beta",
    )  # fmt: skip


def pyramid_budgets(n_visual: int, budget: int, num_layers: int, beta: float) -> list[int]:
    """Visual entries kept per layer for `budget` (M) on average over `num_layers`, of `n_visual` tokens."""
    low = budget / beta
    high = 2 * budget - low
    if high >= n_visual:  # the bottom layer cannot hold more than the input: lift the top to keep the total
        high = n_visual
        low = 2 * budget - high
    if num_layers < 2 or not n_visual >= high >= low >= 0:
        return [budget] * num_layers  # no pyramid fits: SnapKV's uniform budget
    step = (high - low) / (num_layers - 1)
    return [round(high - layer * step) for layer in range(num_layers)]


@register
class PyramidKV(BlockwiseSnapKV):
    name = "pyramidkv"
    description = "Block-wise prefill; SnapKV's scores, the same total budget spread as a pyramid over the layers."
    plain = "keeps the parts your question looks at, more of them in the lower layers and fewer in the upper ones"
    Config = PyramidKVConfig

    def begin(self, ctx: PrefillContext) -> None:
        super().begin(ctx)
        n_visual = int((ctx.prepared.visual_mask & ctx.prepared.keep).sum())
        self.budgets = pyramid_budgets(n_visual, ctx.budget, ctx.adapter.num_layers, self.config.beta)

    def layer_budget(self, ctx: PrefillContext, layer_idx: int) -> int:
        return self.budgets[layer_idx]

    def capacity_hint(self, ctx: PrefillContext) -> list[int] | None:
        """Each layer sized for its own budget (the pyramid's lower layers hold more, the upper ones less)."""
        bound = super().capacity_bound  # the block-wise bound, at each layer's budget
        bounds = [bound(m, ctx.blocks, ctx.prepared) for m in self.budgets]
        return None if None in bounds else bounds

    @classmethod
    def capacity_bound(cls, budget: int | None, blocks: list[Block], prepared: PreparedInput) -> int | None:
        """Before a prefill (the options unknown): the bottom layer's bound for any beta, under 2 x budget."""
        return super().capacity_bound(cls.layer_budget_bound(budget), blocks, prepared)

    @classmethod
    def layer_budget_bound(cls, budget: int | None) -> int | None:
        return None if budget is None else 2 * budget
