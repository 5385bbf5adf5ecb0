"""Block-wise StreamingLLM: attention sinks plus the most recent visual entries, under the budget.

StreamingLLM (Xiao et al., ICLR 2024, "Efficient Streaming Language Models with Attention Sinks") keeps the
first tokens, which draw attention whatever they hold ("attention sinks"; the paper keeps 4), and a window of the
most recent ones; kvpress's `StreamingLLMPress` scores the first `n_sink` entries and the last
`n_kept - n_sink` ones, the middle zero. Here the rule ranks a layer's visual entries: the first `sinks` visual
tokens of the media (default 4, the paper's), then the latest ones, so each layer keeps the `sinks` earliest and
the `budget - sinks` latest visual tokens read so far. Ranks depend on token order only, so evicting after every
block keeps exactly the set the rule gives over the whole input at once. Protected text (the prompt's first
tokens, the true sinks of the sequence, included) is kept on top, as in every block-wise method.
Limits: query- and content-agnostic: evidence early in a video is gone unless it is among the sinks. kvpress's
version keeps the positions as cached (no key re-rotation), as this one does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from visualkv.methods import register
from visualkv.methods.base import PrefillContext
from visualkv.methods.options import Options, option
from visualkv.methods.scorer import BlockwiseScorer


@dataclass
class StreamingLLMConfig(Options):
    label = "streamingllm"
    sinks: int = option(
        4, "first visual tokens always kept (attention sinks; the rest of the budget goes to the latest ones)",
        low=0, high=4096, whole=True, flag="--sinks",
    )  # fmt: skip


def streaming_scores(token_index: torch.Tensor, sink_end: int, end: int) -> torch.Tensor:
    """Keep scores (higher stays) of entries with global `token_index`: a sink (index < `sink_end`) above any
    other entry and earlier sinks first; otherwise later entries first. `end` exceeds every index."""
    index = token_index.to(torch.float32)
    return torch.where(token_index < sink_end, 2 * end - index, index)


@register
class StreamingLLM(BlockwiseScorer):
    name = "streamingllm"
    description = "Block-wise prefill; keep the first visual tokens (attention sinks) and the most recent ones."
    plain = "reads the media piece by piece and keeps only its first and its latest parts"
    Config = StreamingLLMConfig

    def begin(self, ctx: PrefillContext) -> None:
        """The global index just past the last sink: the `sinks`-th visual token of this input."""
        visual = ctx.prepared.visual_mask.nonzero().flatten()
        n = min(self.config.sinks, int(visual.numel()))
        self.sink_end = ctx.seq_offset + (int(visual[n - 1]) + 1 if n else 0)
        self.past_end = ctx.seq_offset + ctx.prepared.seq_len + 1

    def score(self, ctx: PrefillContext, layer_idx: int, keys: torch.Tensor, token_index: torch.Tensor) -> torch.Tensor:
        return streaming_scores(token_index, self.sink_end, self.past_end)
