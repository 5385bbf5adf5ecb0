"""VisionZip: before the LLM, keep each image's dominant visual tokens and merge the rest into a few contextual ones.

VisionZip (Yang et al., CVPR 2025, arXiv 2412.04467; github.com/dvlab-research/VisionZip) keeps per image the
tokens the vision encoder attends to most ("dominant": CLIP's CLS attention at the second-last layer) and splits the
others, in token order, into `contextual` groups: every (others // contextual)-th one is a target, each other token
joins the target its key is most similar to (cosine), and each group becomes one token. LLaVA-1.5's defaults: 54
dominant + 10 contextual of 576 (11 %); here fractions of each unit's visual tokens (an image, tile, video frame
or temporal patch), 54/576 and 10/576 by default, rounded per unit, at least one token kept per unit.
Deviations, because the engine hands a method the LLM's input embeddings and not the encoder's attention, on every
family: (1) the dominant ranking is a proxy, the mean attention each token receives over the unit's tokens as
queries, softmax(h h^T / sqrt(d)) column means on the embeddings h (no CLS; the common no-CLS adaptation uses the
encoder's own attention); (2) similarity is cosine on those embeddings, not on the encoder's keys; (3) a group
becomes its mean (the target included) written into the target's row, where the official code adds the mean of
the others to the target's encoder state. A target keeps its original position (M-RoPE included); VisionZip's
LLaVA renumbers the kept tokens. Where it acts: before the LLM, through `Method.select_rows`, once a block's units
went through the vision tower (which still encodes every token). It bounds nothing: the cache holds the kept
share. dominant = 1, or dominant + contextual = 1, keeps everything unchanged (the full model). It is an entry
stage: it composes with block-wise eviction (a block never splits a unit), not with Sali-Cache nor LightKV.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from visualkv.devices import to_device
from visualkv.methods import register
from visualkv.methods.base import Method, PrefillContext
from visualkv.methods.options import Options, option

SCORE_BYTES = 2**22  # the dominant ranking's scores at once: a chunk of queries against the unit, not (n, n)


def query_chunk(n: int) -> int:
    """Queries per chunk of the dominant ranking over a unit of n tokens (float32 scores within SCORE_BYTES)."""
    return max(1, SCORE_BYTES // (4 * max(n, 1)))


@dataclass
class VisionZipConfig(Options):
    label = "visionzip"
    dominant: float = option(
        54 / 576, "share of each image's / frame's visual tokens kept as dominant (most attended); paper 54/576",
        low=0.0, high=1.0, flag="--visionzip-dominant",
    )  # fmt: skip
    contextual: float = option(
        10 / 576, "share of each image's / frame's visual tokens kept as contextual (merged groups); paper 10/576",
        low=0.0, high=1.0, flag="--visionzip-contextual",
    )  # fmt: skip


def counts(n: int, dominant: float, contextual: float) -> tuple[int, int]:
    """(dominant, contextual) tokens kept of a unit of n: each share of n rounded half up, the contextual ones at
    most what the dominant leave, at least one token."""
    n_dom = min(n, int(dominant * n + 0.5))
    n_ctx = min(n - n_dom, int(contextual * n + 0.5))
    return max(n_dom, min(n, 1) - n_ctx), n_ctx


def zip_unit(h: torch.Tensor, n_dom: int, n_ctx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One unit's embeddings h (n, d) -> (dominant indices (n_dom,), target indices (n_ctx,), the targets' merged
    embeddings (n_ctx, d) float32), indices into h, on its device, no host read."""
    x, chunk = h.float(), query_chunk(len(h))
    received = torch.zeros(len(x), device=x.device)
    for i in range(0, len(x), chunk):  # the softmax in place: one (chunk, n) buffer of scores
        scores = (x[i : i + chunk] @ x.T).mul_(x.shape[1] ** -0.5)
        scores.sub_(scores.amax(-1, keepdim=True)).exp_()
        received += scores.div_(scores.sum(-1, keepdim=True)).sum(0)
    order = torch.argsort(received, descending=True, stable=True)  # ties to the earlier token
    rest = order[n_dom:].sort().values  # the others, in token order
    if n_ctx == 0:
        return order[:n_dom], rest[:0], x[:0]
    pick = torch.arange(0, len(rest), max(1, len(rest) // n_ctx), device=x.device)[:n_ctx]
    unit = torch.nn.functional.normalize(x[rest], dim=-1)
    group = (unit @ unit[pick].T).argmax(-1)  # each other's most similar target
    group[pick] = torch.arange(n_ctx, device=x.device)  # a target is in its own group
    merged = torch.zeros(n_ctx, x.shape[1], device=x.device).index_add_(0, group, x[rest])
    return order[:n_dom], rest[pick], merged / torch.bincount(group, minlength=n_ctx).clamp(min=1)[:, None]


@register
class VisionZip(Method):
    name = "visionzip"
    description = "Before the LLM, keep each image's / frame's most attended visual tokens and merge the rest into a few (VisionZip); bounds nothing."
    plain = "before the model reads a picture, keeps its most looked-at parts and blends the rest into a few summaries"
    Config = VisionZipConfig
    compose_role = "entry"
    compose_conflicts: ClassVar[dict[str, str]] = {
        "merge": "LightKV plans its windows over every row before the prefill; VisionZip drops rows later"
    }

    def begin(self, ctx: PrefillContext) -> None:
        self.visual_id = ctx.prepared.layout.visual_id_of_seq(ctx.prepared.seq_len)  # (L,) visual id, -1 for text
        self.counted = np.zeros(3, dtype=np.int64)  # visual tokens read, kept as dominant, as contextual

    def select_rows(self, ctx: PrefillContext, hidden: torch.Tensor, local: torch.Tensor) -> torch.Tensor | None:
        vid = self.visual_id[local.numpy()]
        rows = np.flatnonzero(vid >= 0)
        unit_of = ctx.prepared.layout.frame[vid[rows]]
        kept, host = [], [np.flatnonzero(vid < 0)]  # text rows always stay
        for unit in np.unique(unit_of):
            mine = rows[unit_of == unit]
            n_dom, n_ctx = counts(mine.size, self.config.dominant, self.config.contextual)
            self.counted += (mine.size, n_dom, n_ctx)
            if n_dom + n_ctx == mine.size:
                host.append(mine)  # everything kept, unchanged
                continue
            idx = to_device(torch.from_numpy(mine), hidden.device)
            dom, targets, merged = zip_unit(hidden[0, idx], n_dom, n_ctx)
            hidden[0].index_copy_(0, idx[targets], merged.to(hidden.dtype))  # the hook's in-place write
            kept += [idx[dom], idx[targets]]
        if not kept:
            return None
        chosen = np.concatenate([*host, torch.cat(kept).cpu().numpy()])  # the block's one device read
        return torch.from_numpy(np.sort(chosen))

    def _units(self, prepared, visual_ids: np.ndarray) -> list[tuple[int, int, int]]:
        """(n, dominant, contextual) of each unit among a block's visual tokens, as `select_rows` groups them."""
        sizes = np.unique(prepared.layout.frame[np.asarray(visual_ids, dtype=np.int64)], return_counts=True)[1]
        return [(n, *counts(n, self.config.dominant, self.config.contextual)) for n in sizes.tolist()]

    def visual_kept_by_layer(self, adapter, prepared, visual_ids: np.ndarray) -> list[tuple[int, int]]:
        """For the memory guard: the rows that enter the LLM, in every layer."""
        return [(adapter.num_layers, sum(dom + ctx for _, dom, ctx in self._units(prepared, visual_ids)))]

    def layer_scratch_bytes(self, adapter, prepared, visual_ids: np.ndarray, q: int) -> int:
        """For the memory guard: `zip_unit`'s float32 work on its largest unit (the unit's copy and a chunk of its
        scores; the others' normalised copy, their similarity to the targets), beside the block's embeddings."""
        d = adapter.text_config.hidden_size
        return max(
            (4 * (2 * n * d + query_chunk(n) * n + 2 * (n - dom) * d + (n - dom) * ctx + 4 * n)
             for n, dom, ctx in self._units(prepared, visual_ids) if dom + ctx < n),
            default=0,
        )  # fmt: skip

    def report(self, ctx: PrefillContext) -> dict[str, Any]:
        read, dominant, contextual = (int(c) for c in self.counted)
        return {
            "visionzip_visual_tokens": read,
            "visionzip_dominant": dominant,
            "visionzip_contextual": contextual,
            "visionzip_note": "dominant ranked by a proxy (attention among the LLM's input embeddings), not the encoder's",
        }
