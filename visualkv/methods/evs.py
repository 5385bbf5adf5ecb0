"""EVS (Efficient Video Sampling): drop the video patches least changed since the previous frame, before the LLM.

EVS (Bagrov et al., NVIDIA 2025, arXiv 2510.14624; vLLM's `vllm/multimodal/evs.py`, `--video-pruning-rate q`, for
Qwen2.5-VL and Qwen3-VL) scores each merged visual token of a video by its dissimilarity 1 - cos(x_t, x_t-1) with
the token at the same grid place in the previous frame (Qwen: the previous 2-frame temporal patch); the first
frame scores 255, so it is kept whole. Of the video's n tokens it keeps the max(tokens of the first frame,
int(n (1 - q))) most dissimilar (a stable descending sort, ties in token order) and drops the rest before the
LLM; kept tokens keep their original positions (M-RoPE included). vLLM runs without EVS unless the rate is given;
the default here, q = 0.75, keeps a quarter. Where it acts: before the LLM, once a block's frames went through the
vision tower (`Method.select_rows`), so a dropped token is never computed in a decoder layer, while the tower still
encodes every frame. It bounds nothing: the cache holds about 1 - q of the video. A still image has no previous
frame: every token is kept. A bulk prefill (the default) ranks the whole video at once, as vLLM does; a block-wise
one (composed with eviction, `blockwise-keydiff+evs`) ranks each block's tokens, against the frame before it (held
here: one frame's embeddings), and keeps what vLLM's count over the video read so far adds (same total, chosen
block by block). It is the entry stage of a composition, so it does not
stack with Sali-Cache, nor with LightKV, which plans its windows over every row before the first block.
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

FIRST_FRAME = 255.0  # vLLM's score of a token with no previous frame: above any 1 - cos (at most 2)


@dataclass
class EVSConfig(Options):
    label = "evs"
    pruning_rate: float = option(
        0.75, "q: share of a video's visual tokens dropped before the LLM, the least changed since the previous frame",
        low=0.0, high=1.0, flag="--video-pruning-rate",
    )  # fmt: skip


def dissimilarity(current: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """(n,) 1 - cos between each token's embedding (n, d) and its place's in the previous frame (n, d), in float32."""
    return 1 - torch.nn.functional.cosine_similarity(current.float(), previous.float(), dim=-1)


def retained(score: torch.Tensor, n_keep: int) -> torch.Tensor:
    """The (sorted) indices of the `n_keep` highest of `score` (n,), ties in token order (vLLM's stable sort)."""
    return torch.argsort(score, descending=True, stable=True)[:n_keep].sort().values


def _keys(frame: np.ndarray, row: np.ndarray, col: np.ndarray) -> np.ndarray:
    """One int64 per grid place of a frame (rows and columns below 2**20)."""
    return (frame.astype(np.int64) << 40) + (row.astype(np.int64) << 20) + col.astype(np.int64)


@register
class EVS(Method):
    name = "evs"
    description = "Before the LLM, drop the video patches least changed since the previous frame (vLLM's EVS); bounds nothing, images whole."
    plain = "drops the parts of a video that hardly change from one frame to the next, before the model reads them"
    Config = EVSConfig
    compose_role = "entry"
    compose_conflicts: ClassVar[dict[str, str]] = {
        "merge": "LightKV plans its windows over every row before the prefill; EVS drops rows later"
    }

    def begin(self, ctx: PrefillContext) -> None:
        frames = ctx.prepared.layout.frames
        self.visual_id = ctx.prepared.layout.visual_id_of_seq(ctx.prepared.seq_len)  # (L,) visual id, -1 for text
        self.is_video = np.array([f.kind == "frame" for f in frames], dtype=bool)
        same = [i > 0 and self.is_video[i - 1] and frames[i].grid == frames[i - 1].grid for i in range(len(frames))]
        self.previous = np.array([i - 1 if s else -1 for i, s in enumerate(same)], dtype=np.int64)  # -1: first
        self.held_keys, self.held = np.zeros(0, dtype=np.int64), None  # the latest video frame read: places, (m, d)
        self.read = self.first = self.kept = 0  # video tokens read, of them with no previous frame, kept

    def select_rows(self, ctx: PrefillContext, hidden: torch.Tensor, local: torch.Tensor) -> torch.Tensor | None:
        layout = ctx.prepared.layout
        vid = self.visual_id[local.numpy()]
        rows = np.flatnonzero(vid >= 0)
        rows = rows[self.is_video[layout.frame[vid[rows]]]]  # the block's video rows
        if rows.size == 0:
            return None
        ids, device = vid[rows], hidden.device
        frame, row, col = layout.frame[ids].astype(np.int64), layout.row[ids], layout.col[ids]
        emb = hidden[0].index_select(0, to_device(torch.from_numpy(rows), device))  # (n, d)
        # each token's place in the previous frame, among the held frame's and this block's tokens
        pool_keys = np.concatenate([self.held_keys, _keys(frame, row, col)])
        pool = emb if self.held is None else torch.cat([self.held, emb])
        order = np.argsort(pool_keys, kind="stable")
        want = _keys(self.previous[frame], row, col)
        at = order[np.minimum(np.searchsorted(pool_keys[order], want), order.size - 1)]
        found = np.flatnonzero((self.previous[frame] >= 0) & (pool_keys[at] == want))
        score = torch.full((rows.size,), FIRST_FRAME, device=device)
        if found.size:
            mine = to_device(torch.from_numpy(found), device)
            score[mine] = dissimilarity(emb[mine], pool[to_device(torch.from_numpy(at[found]), device)])
        # vLLM's count, max(first frame, int(n (1 - q))), over the video read so far: a block keeps what it adds
        n_first = rows.size - found.size
        self.read, self.first = self.read + rows.size, self.first + n_first
        n_keep = max(self.first, int(self.read * (1 - self.config.pruning_rate))) - self.kept
        kept = retained(score, min(rows.size, max(n_first, n_keep))).cpu().numpy()  # the block's one read
        self.kept += kept.size
        last = np.flatnonzero(frame == frame.max())
        self.held = emb[to_device(torch.from_numpy(last), device)]  # (m, d): the block's latest frame, all its places
        self.held_keys = pool_keys[len(self.held_keys) + last]
        if kept.size == rows.size:
            return None
        keep = np.ones(local.numel(), dtype=bool)
        keep[rows] = False
        keep[rows[kept]] = True
        return torch.from_numpy(np.flatnonzero(keep))

    def end(self, ctx: PrefillContext) -> None:
        self.held = None  # the last frame's embeddings: no later block compares with them

    def report(self, ctx: PrefillContext) -> dict[str, Any]:
        out = {"evs_pruning_rate": self.config.pruning_rate, "evs_video_tokens": self.read, "evs_kept": self.kept}
        if not self.read:
            out["evs_note"] = "no video frame: a still image has no previous frame, so every token was kept"
        return out
