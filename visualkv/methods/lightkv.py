"""LightKV ("Make Your LVLM KV Cache More Lightweight", TMLR): prompt-aware merging of visual tokens in the prefill.

After each merge layer λk the block's visual hidden states are merged, so every later layer runs on (and
caches) fewer tokens. Each tile / frame's own token grid is cut into Wk x Wk windows; in each window tokens
alternate into A and B, and the r = min(⌊P·n⌋, ⌊n/2⌋) A tokens most similar (cosine) to a B token merge into
it, weighted by ω = ξ · s: ξ is the attention the token pays to the question's text at that layer, s how many
original tokens it already stands for (at the first stage ω = ξ, the paper's formula). Kept tokens keep their
original position ids and token indices; with every ratio 0 the forward is the uncompressed model, bit for bit.
In a block-wise prefill or a follow-up the question is not in the forward yet, so ξ comes from a text-only
pass over it (an approximation). Merge counts are planned on the host in `begin`, so the layer loop reads
nothing back, except for a stage whose windows cut the previous stage's (read once per block).

Limits: a merged token attends and is attended like one token; merged KV cannot be un-merged for a follow-up
about a region that was merged away.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from visualkv.devices import to_device
from visualkv.errors import ConfigError, check_range
from visualkv.kv.cache import TIER_FULL, TIER_INT4, TIER_INT8
from visualkv.methods.base import LayerState, Method, PrefillContext
from visualkv.methods.options import option


@dataclass(frozen=True)
class PaperSchedule:
    """A schedule from the paper: merge layers (the paper's numbering) on a model of `depth` layers."""

    depth: int
    layers: tuple[int, ...]
    windows: tuple[int, ...]
    ratios: tuple[float, ...]


#: Qwen2.5-VL-7B (28 layers) and LLaVA-1.5-7B (32 layers); SmolVLM (Llama-style LLM, square tiles) uses LLaVA's.
PAPER_SCHEDULES: dict[str, PaperSchedule] = {
    "qwen2_5_vl": PaperSchedule(28, (12, 17, 22), (6, 4, 2), (0.5, 0.5, 0.5)),
    "smolvlm": PaperSchedule(32, (12, 18, 24), (4, 2, 1), (0.5, 0.5, 0.5)),
    # not in the paper: Qwen3-VL's rectangular row-major grids take Qwen2.5-VL's schedule
    "qwen3_vl": PaperSchedule(28, (12, 17, 22), (6, 4, 2), (0.5, 0.5, 0.5)),
    # the paper's LLaVA schedule, on LLaVA-OneVision's base tile, packed map and video frames
    "llava_onevision": PaperSchedule(32, (12, 18, 24), (4, 2, 1), (0.5, 0.5, 0.5)),
}


def scale_layers(paper_layers: tuple[int, ...], paper_depth: int, depth: int) -> list[int]:
    """Merge-after layers (0-based) for a model of `depth` layers, from the paper's schedule.

    The paper's "layer λ" is read as "λ layers see every token": merging happens after the λ-th layer
    (1-based), i.e. after our 0-based layer λ-1, which reproduces the paper's "55% of the vision tokens"
    (LLaVA, 32 layers: 12 x 576 + 6 x 288 + 6 x 145 + 8 x 73 ≈ 0.55 x 32 x 576). Scaled to another depth
    the same fraction of layers sees every token: after = round(λ · depth / paper_depth) - 1 (halves round
    up). A stage that lands on or before the previous one moves one layer deeper; stages that no longer fit
    before the last layer (merging after it would change nothing) are dropped.
    """
    out: list[int] = []
    for lam in paper_layers:
        after = max(math.floor(lam * depth / paper_depth + 0.5) - 1, 0)
        if out and after <= out[-1]:
            after = out[-1] + 1
        if after > depth - 2:
            break
        out.append(after)
    return out


def _as_tuple(value, cast, what: str) -> tuple | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = [v for v in value.replace(" ", "").split(",") if v]
    elif isinstance(value, (int, float)):
        value = [value]
    try:
        return tuple(cast(v) for v in value)
    except (TypeError, ValueError):
        raise ConfigError(f"lightkv {what} must be a comma-separated list of numbers, got {value!r}") from None


#: bounds of LightKV's settings: merge stages, the deepest layer index any model has, windows per grid side
MAX_STAGES = 64
MAX_LAYER = 1023
MAX_WINDOWS = 64


@dataclass
class LightKVConfig:
    """LightKV schedule; None = the family's paper schedule scaled to the model's depth.

    layers: 0-based decoder layers after which merging happens (each layer's own cache keeps every token
      it processed; strictly increasing, each < num_layers - 1).
    windows: windows per side of each tile / frame grid, per stage (one value = every stage).
    ratios: P per stage in [0, 1] (one value = every stage); r = min(⌊P·n⌋, ⌊n/2⌋) merges per window.
    """

    layers: tuple[int, ...] | None = option(
        None, "decoder layers after which visual tokens merge, e.g. 12,17,22 (default: the paper's schedule "
        "scaled to the model's depth)", flag="--lightkv-layers", metavar="L1,L2,...",
    )  # fmt: skip
    windows: tuple[int, ...] | None = option(
        None, "merge windows per side of each tile / frame grid at each merge layer, e.g. 6,4,2",
        flag="--lightkv-windows", metavar="W1,W2,...",
    )  # fmt: skip
    ratios: tuple[float, ...] | None = option(
        None, "merge ratio P per merge layer, r = min(floor(P*n), n/2) per window (default 0.5)",
        flag="--lightkv-ratios", metavar="P1,P2,...",
    )  # fmt: skip

    def __post_init__(self) -> None:
        self.layers = _as_tuple(self.layers, int, "layers")
        self.windows = _as_tuple(self.windows, int, "windows")
        self.ratios = _as_tuple(self.ratios, float, "ratios")
        for what, values in (("layers", self.layers), ("windows", self.windows), ("ratios", self.ratios)):
            if values is not None:
                check_range(f"lightkv {what}: the number of values", len(values), 1, MAX_STAGES, whole=True)
        if self.layers is not None:
            if any(b <= a for a, b in zip(self.layers, self.layers[1:])) or min(self.layers) < 0:
                raise ConfigError(f"lightkv layers must be increasing 0-based layer indices, got {self.layers}")
            check_range("lightkv layers: the last layer", self.layers[-1], 0, MAX_LAYER, whole=True)
        for window in self.windows or ():
            check_range("lightkv windows (per side of a tile / frame grid)", window, 1, MAX_WINDOWS, whole=True)
        if self.ratios is not None and not all(0.0 <= p <= 1.0 for p in self.ratios):
            raise ConfigError(f"lightkv ratios must lie in [0, 1], got {self.ratios}")

    def resolve(self, family: str, depth: int) -> list[tuple[int, int, float]]:
        """(layer, windows, ratio) per stage for a model of this family and depth."""
        paper = PAPER_SCHEDULES.get(family, PAPER_SCHEDULES["smolvlm"])
        layers = list(self.layers) if self.layers is not None else scale_layers(paper.layers, paper.depth, depth)
        if not layers:
            raise ConfigError(f"lightkv: a {depth}-layer model leaves no layer to merge after")
        if layers[-1] > depth - 2:
            raise ConfigError(
                f"lightkv layers must be < {depth - 1} on this {depth}-layer model (merging after the last layer "
                f"changes nothing), got {tuple(layers)}"
            )
        n = len(layers)

        def per_stage(given, default, what):
            if given is None:
                return list(default[:n]) + [default[-1]] * max(0, n - len(default))
            if len(given) == 1:
                return list(given) * n
            if len(given) != n:
                raise ConfigError(f"lightkv {what}: give one value or one per layer ({n}), got {len(given)}")
            return list(given)

        windows = per_stage(self.windows, paper.windows, "windows")
        ratios = per_stage(self.ratios, paper.ratios, "ratios")
        return list(zip(layers, windows, ratios))


# -- pure tensor functions ------------------------------------------------------------------------------------------
def token_places(layout, ids: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """(frame, row, col, grid_rows, grid_cols) of the visual tokens `ids` (indices into `layout`; all when None):
    each token's original place and its frame's grid size, all (n,)."""
    frame = torch.from_numpy(layout.frame).long()
    row, col = torch.from_numpy(layout.row).long(), torch.from_numpy(layout.col).long()
    if ids is not None:
        frame, row, col = frame[ids], row[ids], col[ids]
    if not len(frame):
        return frame, row, col, frame, frame
    grids = torch.tensor([f.grid for f in layout.frames], dtype=torch.long).view(-1, 2)
    return frame, row, col, grids[frame, 0], grids[frame, 1]


def window_ids(places: tuple[torch.Tensor, ...], windows: int) -> torch.Tensor:
    """Window id per token of `places` (`token_places`): W x W windows on each token's own tile / frame grid (W per
    side). Ids of different frames never collide."""
    frame, row, col, grid_rows, grid_cols = places
    wr = torch.div(row * windows, grid_rows, rounding_mode="floor")
    wc = torch.div(col * windows, grid_cols, rounding_mode="floor")
    return (frame * windows + wr) * windows + wc


@dataclass
class MergeResult:
    keep: torch.Tensor  # (n,) bool: token survives
    dest: torch.Tensor  # (n,) long: index of the token it merged into (itself when kept)
    x: torch.Tensor  # (n, d) hidden states; kept rows that absorbed tokens hold the weighted average
    weight: torch.Tensor  # (n,) weights after the merge (kept: ω_b + Σ ω_a)
    pairs: int  # A x B similarity entries computed (for the FLOPs estimate)
    merged: torch.Tensor  # (m,) indices of the merged-away tokens (m = Σ r, known on the host)


def _segment_sum(values: torch.Tensor, segment: torch.Tensor, n_segments: int) -> torch.Tensor:
    """Sum the rows of `values` (m, d) per `segment` id in [0, n_segments) (empty segments sum to 0), float32.

    A stable sort and a float64 prefix sum: much faster on CPU than index_add / scatter_add of float rows
    (which run a scalar loop there), exact to float32 precision, and fixed-size (no host synchronisation).
    """
    order = torch.sort(segment, stable=True).indices
    counts = torch.zeros(n_segments, dtype=torch.long, device=segment.device)
    counts.index_add_(0, segment, torch.ones_like(segment))  # not bincount: on CUDA that reads the max back
    prefix = values.index_select(0, order).double().cumsum(0)
    prefix = torch.cat([prefix.new_zeros(1, prefix.shape[1]), prefix])
    ends = torch.cumsum(counts, 0)
    return (prefix.index_select(0, ends) - prefix.index_select(0, ends - counts)).float()


def merge_counts(counts: np.ndarray, ratio: float) -> np.ndarray:
    """r per window: min(⌊P·n⌋, ⌊n/2⌋) for window sizes `counts` (host integers)."""
    counts = np.asarray(counts, dtype=np.int64)
    return np.minimum(np.floor(counts.astype(np.float64) * ratio).astype(np.int64), counts // 2)


def merge_in_windows(
    x: torch.Tensor,
    weight: torch.Tensor,
    group: torch.Tensor,
    counts: np.ndarray,
    ratio: float,
    max_elements: int = 1 << 25,
) -> MergeResult:
    """ToMe-style bipartite merge inside each group (window), weighted by `weight`, with no host read.

    x: (n, d) hidden states in sequence order; weight: (n,) positive weights (ω = ξ · size); group: (n,)
    window id in [0, G); counts: (G,) host integers, the number of tokens of each window (the caller knows
    them from the layout, so every shape below is known on the host). Within a group, tokens alternate
    A, B, A, B, ... in sequence order; every a ∈ A picks the b ∈ B of highest cosine similarity; the
    r = min(⌊ratio·n⌋, ⌊n/2⌋) A tokens with the highest similarity merge into their b:
    x_b ← (ω_b x_b + Σ ω_a x_a) / (ω_b + Σ ω_a). Rows nothing merged into are returned untouched (bit for
    bit). `max_elements` bounds the A x B similarity block computed at once.
    """
    n, d = x.shape
    device = x.device
    keep = torch.ones(n, dtype=torch.bool, device=device)
    dest = torch.arange(n, device=device)
    counts = np.asarray(counts, dtype=np.int64)
    r_host = merge_counts(counts, ratio)
    m = int(r_host.sum())
    max_c = int(counts.max()) if counts.size else 0
    max_a, max_b = (max_c + 1) // 2, max_c // 2
    if n < 2 or ratio <= 0 or max_b == 0 or m == 0:
        return MergeResult(keep, dest, x, weight, 0, dest[:0])
    n_groups = int(counts.shape[0])
    order = torch.sort(group, stable=True).indices  # grouped; sequence order inside a group
    n_in = torch.zeros(n_groups, dtype=torch.long, device=device)
    n_in.index_add_(0, group, torch.ones_like(group))  # = counts, made on the device (no copy)
    starts = torch.cumsum(n_in, 0) - n_in
    g_sorted = group.index_select(0, order)
    rank = torch.arange(n, device=device) - starts.index_select(0, g_sorted)
    members = torch.full((n_groups, 2 * max_a), -1, dtype=torch.long, device=device)
    members[g_sorted, rank] = order  # row g: the window's tokens in sequence order, -1 after them
    a_idx, b_idx = members[:, 0::2].contiguous(), members[:, 1::2][:, :max_b].contiguous()  # even / odd ranks
    r = torch.minimum(torch.floor(n_in.double() * ratio).long(), torch.div(n_in, 2, rounding_mode="floor"))

    xn = torch.nn.functional.normalize(x.float(), dim=-1)
    best_sim = torch.full((n_groups, max_a), -math.inf, device=device)
    best_b = torch.zeros((n_groups, max_a), dtype=torch.long, device=device)
    step = max(1, max_elements // max(1, max_a * max_b))
    for g0 in range(0, n_groups, step):  # chunks of groups bound the (g, A, B) similarity block
        ai, bi = a_idx[g0 : g0 + step], b_idx[g0 : g0 + step]
        xa = xn.index_select(0, ai.clamp(min=0).flatten()).view(*ai.shape, d)
        xb = xn.index_select(0, bi.clamp(min=0).flatten()).view(*bi.shape, d)
        sim = torch.bmm(xa, xb.transpose(1, 2))  # (g, max_a, max_b)
        sim = sim.masked_fill((bi < 0)[:, None, :], -math.inf)
        s, j = sim.max(dim=-1)
        best_sim[g0 : g0 + step] = s.masked_fill(ai < 0, -math.inf)
        best_b[g0 : g0 + step] = j
    # Rank the A tokens of each group by similarity (descending; ties: sequence order).
    a_rank_order = torch.sort(best_sim, dim=1, descending=True, stable=True).indices
    a_rank = torch.empty_like(a_rank_order)
    a_rank.scatter_(1, a_rank_order, torch.arange(max_a, device=device).expand(n_groups, max_a).contiguous())
    merge = (a_rank < r[:, None]) & (a_idx >= 0)  # exactly m entries: Σ r, known on the host
    flat = torch.nonzero_static(merge.flatten(), size=m)[:, 0]  # row-major, like a_idx[merge]
    src = a_idx.flatten().index_select(0, flat)  # (m,) merged-away tokens
    slot = (flat // max_a) * max_b + best_b.flatten().index_select(0, flat)  # their partners' (group, B) slots
    b_tok = b_idx.flatten()  # (G·max_b,) token of each B slot, -1 for padding
    dst = b_tok.index_select(0, slot)  # (m,) their partners
    keep[src] = False
    dest[src] = dst

    w = weight.float().clamp_min(1e-30)
    n_slots = b_tok.shape[0]
    absorbed = torch.zeros(n_slots, dtype=torch.long, device=device)
    absorbed = absorbed.index_add_(0, slot, torch.ones_like(slot)) > 0  # B slots that absorb something
    b_row = torch.where(b_tok >= 0, b_tok, n)  # padding slots write to a scratch row n
    b_safe = b_tok.clamp(min=0)
    w_b = w.index_select(0, b_safe)
    den = w_b + _segment_sum(w[src, None], slot, n_slots)[:, 0]  # ω_b + Σ ω_a
    x_src = x.index_select(0, src).float() * w[src, None]
    num = x.index_select(0, b_safe).float() * w_b[:, None] + _segment_sum(x_src, slot, n_slots)
    x_b = x.index_select(0, b_safe)
    out = torch.cat([x, x[:1]])  # a copy, plus the scratch row
    out.index_copy_(0, b_row, torch.where(absorbed[:, None], (num / den[:, None]).to(x.dtype), x_b))
    new_weight = torch.cat([w, w[:1]])
    new_weight.index_copy_(0, b_row, torch.where(absorbed, den, w_b))
    pairs = int((((counts + 1) // 2) * (counts // 2)).sum())
    return MergeResult(keep, dest, out[:n], new_weight[:n], pairs, src)


def prompt_attention(queries: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """ξ (n,) from visual queries (1, Hq, n, hd) and text keys (1, Hkv, T, hd), post-RoPE.

    Scores of the visual x text block only (no causal mask); for every (query head, text key) a softmax over
    the visual queries; summed over text keys, averaged over query heads. Σ_i ξ_i = T.
    """
    _, hq, n, hd = queries.shape
    hkv = keys.shape[1]
    q = queries[0].float().view(hkv, hq // hkv, n, hd)
    k = keys[0].float()
    scores = torch.einsum("hgnd,htd->hgnt", q, k) * scale  # (Hkv, group, n, T)
    return scores.softmax(dim=2).sum(dim=-1).mean(dim=(0, 1))


class _TextCapture(Method):
    """Records, at the merge layers, the layer input and cos/sin of the last `n` tokens (the question)."""

    def __init__(self, layers: set[int], n: int) -> None:
        self.layers, self.n, self.states = layers, n, {}

    def after_layer(self, ctx, state: LayerState) -> None:
        if state.layer_idx in self.layers:
            self.states[state.layer_idx] = tuple(
                t[:, -self.n :].detach() for t in (state.hidden_in, state.cos, state.sin)
            )


@dataclass
class _BlockWindows:
    """Host-side window plan of one prefill block (from the layout, before the prefill)."""

    vis_start: int  # the block's visual tokens: [vis_start, vis_start + n_visual) of the concatenated tables
    n_visual: int
    tok_start: int  # the block's tokens: [tok_start, tok_start + n_tokens) of the concatenated token table
    n_tokens: int
    n_text: int  # question tokens in the block (a contiguous tail: they follow every visual token)
    counts: np.ndarray  # (G0,) tokens per stage-0 window (compact window ids of this block)
    n_windows: list[int]  # G_k: stage-k windows this block's tokens fall in
    #: per stage k >= 1: stage-(k-1) window -> the stage-k window holding all of it, or None when stage k's
    #: windows cut stage k-1's (then how many survivors each stage-k window holds is data-dependent)
    parents: list[np.ndarray | None]


@dataclass
class _BlockState:
    """The block's visual tokens as the merge stages leave them (device tensors, host counts)."""

    block: int
    n: int  # visual tokens in the block now (host)
    vis_pos: torch.Tensor  # (n,) their rows in the block's hidden states
    vids: torch.Tensor  # (n,) their visual ids
    token_index: torch.Tensor  # (q,) the block's token indices (device copy)
    stage: int = -1  # last stage run
    survivors: np.ndarray | None = None  # tokens per window of `stage` after it (None: not known on the host)


#: synchronise CUDA around each merge stage so the report's xi/merge seconds are device times; off by default
#: (each synchronisation stalls the launch queue; without it the seconds are host-side launch times on CUDA)
SYNC_TIMING = False


def _sync(device: torch.device) -> None:
    if SYNC_TIMING and device.type == "cuda":
        torch.cuda.synchronize(device)


# -- the method -----------------------------------------------------------------------------------------------------
class LightKV(Method):
    name = "lightkv"
    description = "Prompt-aware merging of visual tokens inside the prefill (fewer tokens, FLOPs and KV after its first merge layer)."
    plain = "merges similar neighbouring parts of the picture while reading it"
    default_prefill = "bulk"
    needs_budget = False
    query_aware = True
    compose_role = "merge"
    Config = LightKVConfig
    #: (layer, windows, ratio) of each merge stage, resolved for the model in `begin`
    stages: tuple[tuple[int, int, float], ...] = ()

    def visual_kept_by_layer(self, adapter, prepared, visual_ids: np.ndarray) -> list[tuple[int, int]]:
        """Layers up to the first merge store every visual token of the block; after a stage (W windows per side,
        ratio P) at most n - Σ_w min(⌊P·n_w⌋, ⌊n_w/2⌋) of its n tokens go on. Exact at the first stage, whose
        windows are the block's tokens' own (as `_plan_windows` cuts them); at a later stage the window sizes
        depend on which tokens merged, so the merges are bounded below by min(P, 1/2)·n minus the windows the
        block's tokens fall in (each window rounds down by less than one)."""
        places = token_places(prepared.layout, torch.from_numpy(np.asarray(visual_ids, dtype=np.int64)))
        groups, kept, after = [], len(visual_ids), -1
        for k, (layer, windows, ratio) in enumerate(self.config.resolve(adapter.family, adapter.num_layers)):
            groups.append((layer - after, kept))
            win = window_ids(places, windows).numpy()
            counts = np.unique(win, return_counts=True)[1]
            if k == 0:
                kept -= int(merge_counts(counts, ratio).sum())
            else:
                kept -= max(0, math.ceil(min(ratio, 0.5) * kept - len(counts)))
            after = layer
        groups.append((adapter.num_layers - 1 - after, kept))
        return [(layers, n) for layers, n in groups if layers > 0]

    #: float32 copies of the block's visual states (n, d) a merge holds at once: normalised, the weighted sums and
    #: their quotient, the partners' rows, the merged copy (`merge_in_windows`)
    MERGE_STATE_COPIES = 5

    def layer_scratch_bytes(self, adapter, prepared, visual_ids: np.ndarray, q: int) -> int:
        """The largest stage's merge over the block (`merge_in_windows`, then `after_layer`): the (g, A, B)
        similarity chunk twice (`masked_fill` copies it) and the chunk's gathered A and B rows, `MERGE_STATE_COPIES`
        of the visual states, and the block's hidden states re-indexed twice. Every stage is counted over the
        block's own windows (later stages see fewer tokens: an upper bound). 27 MiB counted against 26 measured
        on CPU on LLaVA-OneVision's 4K image, where it outweighs the decoder layer; the engine cannot see it."""
        n, d = len(visual_ids), adapter.text_config.hidden_size
        if n < 2:
            return 0
        places = token_places(prepared.layout, torch.from_numpy(np.asarray(visual_ids, dtype=np.int64)))
        worst = 0
        for _layer, windows, ratio in self.config.resolve(adapter.family, adapter.num_layers):
            if ratio <= 0:
                continue
            counts = np.unique(window_ids(places, windows).numpy(), return_counts=True)[1]
            max_a, max_b = (int(counts.max()) + 1) // 2, int(counts.max()) // 2
            g = min(len(counts), max(1, (1 << 25) // max(1, max_a * max_b)))  # `merge_in_windows`' chunk
            chunk = (2 * g * max_a * max_b + g * (max_a + max_b) * d) * 4
            worst = max(worst, chunk + self.MERGE_STATE_COPIES * n * d * 4)
        itemsize = torch.empty((), dtype=adapter.dtype).element_size()
        return worst + 2 * q * d * itemsize if worst else 0

    # -- prefill hooks ----------------------------------------------------------------------------------------------
    def begin(self, ctx: PrefillContext) -> None:
        adapter, prepared = ctx.adapter, ctx.prepared
        self.stages = tuple(self.config.resolve(adapter.family, adapter.num_layers))
        self._stage_at = {layer: i for i, (layer, _, _) in enumerate(self.stages)}
        n_vis = prepared.layout.n_visual
        # running size of every visual token and the token it ended in, kept where the merges run
        self._size = torch.ones(n_vis, dtype=torch.float64, device=adapter.device)
        self._owner = torch.arange(n_vis, device=adapter.device)
        self._stage_log = [
            {
                "layer": layer,
                "windows": w,
                "ratio": p,
                "tokens_in": 0,
                "tokens_out": 0,
                "windows_used": 0,
                "xi_seconds": 0.0,
                "merge_seconds": 0.0,
            }
            for layer, w, p in self.stages
        ]
        self._layer_work = [[0, 0] for _ in range(adapter.num_layers)]  # per layer: tokens run, attention pairs
        self._overhead_flops = 0.0
        self.last_xi: dict[int, torch.Tensor] = {}  # stage layer -> ξ of the last merged block (for inspection)
        self._layer_tokens: list[dict[str, int]] = []
        self._plan_windows(ctx)
        # Where ξ's text keys come from: the question inside the forward (bulk), or a text-only proxy pass.
        whole = len(ctx.blocks) == 1  # the engine plans the blocks before `begin`
        self._xi_source = "inline" if whole and self.proxy_ids is None else "proxy"
        self._proxy: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._proxy_seconds = 0.0
        if self._xi_source == "proxy" and any(p > 0 for _, _, p in self.stages) and n_vis:
            t0 = time.perf_counter()
            self._proxy = self._proxy_text_states(ctx)
            _sync(adapter.device)
            self._proxy_seconds = time.perf_counter() - t0

    def _proxy_text_states(self, ctx: PrefillContext) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Question hidden states at each merge layer from one text-only pass [prefix + question]."""
        ids, positions, n = ctx.question_pass(self.proxy_ids)
        if n == 0:
            return {}
        capture = _TextCapture({layer for layer, _, p in self.stages if p > 0}, n)
        ctx.text_pass(ids, positions, capture)
        return capture.states

    def _plan_windows(self, ctx: PrefillContext) -> None:
        """Which tokens share a window at every stage of every block, planned on the host from the layout.

        Window ids are compacted per block and stage (0..G-1 over the windows the block's tokens fall in),
        so the layer loop only gathers them. The tables go to the merge layers' devices once, here.
        """
        prepared, layout = ctx.prepared, ctx.prepared.layout
        vid_of_seq = layout.visual_id_of_seq(prepared.seq_len)
        places = token_places(layout)
        wins = [window_ids(places, w).numpy() for _, w, _ in self.stages]
        gid = np.zeros((len(self.stages), layout.n_visual), dtype=np.int64)
        keep, visual = prepared.keep.numpy(), prepared.visual_mask.numpy()
        self._plans: dict[int, _BlockWindows] = {}
        vis_pos, vids_all, tokens = [], [], []
        n_v = n_t = 0
        for block in ctx.blocks:
            local = np.arange(block.start, block.end)[keep[block.start : block.end]]
            is_vis = visual[local]
            vids = vid_of_seq[local[is_vis]]
            n_windows = []
            for k, win in enumerate(wins):
                uniq, gid[k, vids] = np.unique(win[vids], return_inverse=True)
                n_windows.append(int(uniq.shape[0]))
            parents: list[np.ndarray | None] = [None]
            for k in range(1, len(wins)):
                parent = np.zeros(n_windows[k - 1], dtype=np.int64)
                parent[gid[k - 1, vids]] = gid[k, vids]
                parents.append(parent if np.array_equal(parent[gid[k - 1, vids]], gid[k, vids]) else None)
            counts = np.bincount(gid[0, vids], minlength=n_windows[0]) if wins else np.zeros(0, np.int64)
            n_text = int((local >= prepared.suffix_start).sum())
            self._plans[block.index] = _BlockWindows(
                n_v, len(vids), n_t, len(local), n_text, counts, n_windows, parents
            )
            vis_pos.append(np.flatnonzero(is_vis))
            vids_all.append(vids)
            tokens.append(local + ctx.seq_offset)
            n_v, n_t = n_v + len(vids), n_t + len(local)
        host = {
            "gid": torch.from_numpy(gid),
            "vis_pos": torch.from_numpy(np.concatenate(vis_pos or [np.zeros(0, np.int64)])).long(),
            "vids": torch.from_numpy(np.concatenate(vids_all or [np.zeros(0, np.int64)])).long(),
            "tokens": torch.from_numpy(np.concatenate(tokens or [np.zeros(0, np.int64)])).long(),
            "positions": prepared.position_ids,
        }
        if ctx.tiers is not None:  # set by a tiering stage's `begin`, which runs before this one
            host["tiers"] = ctx.tiers
        devices = {ctx.adapter.layers[layer].input_layernorm.weight.device for layer, _, _ in self.stages}
        self._tables = {device: {k: to_device(v, device) for k, v in host.items()} for device in devices}
        self._block_state: _BlockState | None = None

    def _state_for(self, ctx: PrefillContext, device: torch.device) -> _BlockState:
        """The current block's merge state, started from the plan at the block's first merge stage."""
        cur = self._block_state
        if cur is None or cur.block != ctx.block.index:
            p, t = self._plans[ctx.block.index], self._tables[device]
            cur = _BlockState(
                ctx.block.index,
                p.n_visual,
                t["vis_pos"][p.vis_start : p.vis_start + p.n_visual],
                t["vids"][p.vis_start : p.vis_start + p.n_visual],
                t["tokens"][p.tok_start : p.tok_start + p.n_tokens],
            )
            self._block_state = cur
        elif cur.vis_pos.device != device:  # the stages' layers sit on different devices
            cur.vis_pos, cur.vids, cur.token_index = (
                to_device(t, device) for t in (cur.vis_pos, cur.vids, cur.token_index)
            )
        return cur

    def _known_counts(self, cur: _BlockState, stage: int) -> np.ndarray | None:
        """Tokens per window at `stage` if the host knows them, else None.

        Known at the first stage (from the layout), and at a later stage whose windows each hold whole windows
        of the previous one (SmolVLM's 4-2-1, Qwen's 4 -> 2): r per window is known, so the survivors are.
        Where a stage's windows cut the previous stage's (Qwen's 6 -> 4), how many survivors each holds
        depends on which tokens merged.
        """
        plan = self._plans[cur.block]
        if stage == 0:
            return plan.counts
        parent = plan.parents[stage]
        if cur.stage != stage - 1 or cur.survivors is None or parent is None:
            return None
        return np.bincount(parent, weights=cur.survivors, minlength=plan.n_windows[stage]).astype(np.int64)

    def _window_counts(self, cur: _BlockState, stage: int, group: torch.Tensor) -> np.ndarray:
        """Tokens per window at `stage` (host integers): known on the host, or read once from the device.

        The read happens only where `_known_counts` cannot say: every shape after the merge depends on the
        counts, so they must be on the host; one small read per such stage and block.
        """
        counts = self._known_counts(cur, stage)
        if counts is not None:
            return counts
        on_device = torch.zeros(self._plans[cur.block].n_windows[stage], dtype=torch.long, device=group.device)
        on_device.index_add_(0, group, torch.ones_like(group))
        return np.array(on_device.tolist(), dtype=np.int64)  # the one host read of this stage (see above)

    def after_layer(self, ctx: PrefillContext, state: LayerState) -> LayerState | None:
        q_len = state.hidden_in.shape[1]
        n_total = ctx.cache.layers[state.layer_idx].get_seq_length()
        work = self._layer_work[state.layer_idx]
        work[0] += q_len
        work[1] += q_len * (n_total - q_len) + q_len * (q_len + 1) // 2
        stage = self._stage_at.get(state.layer_idx)
        if stage is None:
            return None
        layer_idx, _, ratio = self.stages[stage]
        log = self._stage_log[stage]
        device = state.hidden.device
        cur = self._state_for(ctx, device)
        n = cur.n
        log["tokens_in"] += n
        if ratio <= 0 or n < 2:
            log["tokens_out"] += n
            cur.survivors = self._known_counts(cur, stage)  # nothing merged: the windows' sizes, if known
            cur.stage = stage
            return None
        group = self._tables[device]["gid"][stage].index_select(0, cur.vids)
        counts = self._window_counts(cur, stage, group)

        # ξ: visual queries of this layer x the question's keys.
        _sync(device)
        t0 = time.perf_counter()
        xi, n_text = self._xi(ctx, state, cur)
        _sync(device)
        t1 = time.perf_counter()

        size = self._size.index_select(0, to_device(cur.vids, self._size.device))
        weight = xi * to_device(size, device).to(torch.float32)
        res = merge_in_windows(state.hidden[0].index_select(0, cur.vis_pos), weight, group, counts, ratio)
        m = int(res.merged.shape[0])  # Σ r over the windows: a host integer
        cur.survivors, cur.stage = counts - merge_counts(counts, ratio), stage
        new_state = None
        if m:
            keep_block = torch.ones(q_len, dtype=torch.bool, device=device)
            keep_block[cur.vis_pos.index_select(0, res.merged)] = False
            keep_idx = torch.nonzero_static(keep_block, size=q_len - m)[:, 0]  # kept rows, in order
            # every visual row takes its merge result (rows nothing merged into are unchanged), then kept rows
            hidden = state.hidden.index_copy(1, cur.vis_pos, res.x[None]).index_select(1, keep_idx)
            token_index = cur.token_index.index_select(0, keep_idx)
            positions = self._tables[device]["positions"].index_select(1, token_index - ctx.seq_offset)
            tiers, tier_split, n_visual = None, None, n - m
            if state.tiers is not None:  # a tiering stage (Sali-Cache) composed before this one
                tiers = self._tables[device]["tiers"].index_select(0, token_index - ctx.seq_offset)
                tier_split, n_visual = self._split_tiers(ctx, tiers, token_index)
            new_state = replace(
                state,
                hidden=hidden,
                positions=positions,
                token_index=token_index,
                cos=state.cos.index_select(1, keep_idx),
                sin=state.sin.index_select(1, keep_idx),
                tiers=tiers,
                n_visual=n_visual,
                tier_split=tier_split,
            )
            # Book-keeping: sizes and the final owner of every original visual token.
            src_v = to_device(cur.vids.index_select(0, res.merged), self._size.device)
            dst_v = to_device(cur.vids.index_select(0, res.dest.index_select(0, res.merged)), self._size.device)
            self._size.index_add_(0, dst_v, self._size.index_select(0, src_v))
            self._size.index_fill_(0, src_v, 0)
            remap = torch.arange(self._owner.shape[0], device=self._owner.device)
            remap[src_v] = dst_v
            self._owner = remap.index_select(0, self._owner)
            kept_vis = torch.nonzero_static(res.keep, size=n - m)[:, 0]
            new_place = torch.cumsum(keep_block, 0) - 1  # row of each kept token in the reduced block
            cur.vis_pos = new_place.index_select(0, cur.vis_pos.index_select(0, kept_vis))
            cur.vids, cur.token_index, cur.n = cur.vids.index_select(0, kept_vis), token_index, n - m
        _sync(device)
        t2 = time.perf_counter()

        self.last_xi[layer_idx] = xi.detach()
        log["tokens_out"] += n - m
        log["windows_used"] += int((counts > 0).sum())
        log["xi_seconds"] += t1 - t0
        log["merge_seconds"] += t2 - t1
        cfg = ctx.adapter.text_config
        hq, hd = cfg.num_attention_heads, ctx.adapter.head_dim
        self._overhead_flops += 2.0 * n * cfg.hidden_size * hq * hd + 2.0 * hq * n * n_text * hd  # q proj + scores
        self._overhead_flops += 2.0 * res.pairs * cfg.hidden_size  # cosine similarities
        return new_state

    def _split_tiers(
        self, ctx: PrefillContext, tiers: torch.Tensor, token_index: torch.Tensor
    ) -> tuple[dict[int, torch.Tensor] | None, int]:
        """The reduced block's {tier: positions} (None: all full precision) and its visual full-precision count.

        A merge mixes tiers, so how many tokens of each tier survive depends on which merged: the counts are
        read back, in one read per merge stage; the positions are then selected on the device.
        """
        visual = ctx.is_visual(token_index)
        codes = (TIER_FULL, TIER_INT8, TIER_INT4)
        masks = [tiers == t for t in codes]
        *counts, n_visual = torch.stack([mk.sum() for mk in masks] + [(masks[0] & visual).sum()]).tolist()
        split = {t: torch.nonzero_static(mk, size=c)[:, 0] for t, mk, c in zip(codes, masks, counts) if c}
        return (None if set(split) <= {TIER_FULL} else split), n_visual

    def _xi(self, ctx: PrefillContext, state: LayerState, cur: _BlockState) -> tuple[torch.Tensor, int]:
        """ξ (n,) float32 for the block's visual tokens at this layer (uniform if there is no question), and the
        number of question tokens it reads."""
        adapter, layer_idx, device = ctx.adapter, state.layer_idx, state.hidden.device
        if self._xi_source == "proxy":
            text = self._proxy.get(layer_idx)
        else:  # the question is the block's tail (it follows every visual token; merging removes none of it)
            n_text = self._plans[cur.block].n_text
            text = tuple(t[:, -n_text:] for t in (state.hidden_in, state.cos, state.sin)) if n_text else None
        if text is None:
            return torch.ones(cur.n, device=device), 0
        h_text, cos_t, sin_t = (t.to(device) for t in text)
        keys = adapter.key_states(layer_idx, h_text, cos_t, sin_t)
        vis = cur.vis_pos
        queries = adapter.query_states(
            layer_idx,
            state.hidden_in.index_select(1, vis),
            state.cos.index_select(1, vis),
            state.sin.index_select(1, vis),
        )
        scale = getattr(adapter.layers[layer_idx].self_attn, "scaling", adapter.head_dim**-0.5)
        return prompt_attention(queries, keys, scale), h_text.shape[1]

    def end(self, ctx: PrefillContext) -> None:
        self.last_xi = {layer: xi.cpu() for layer, xi in self.last_xi.items()}  # after the layer loop
        self._block_state = None
        # Snapshot of the media prefill (follow-up turns append text later).
        self._layer_tokens = []
        for i, layer in enumerate(ctx.cache.layers):
            idx = layer.all_token_index()[0, 0].long() if layer.is_initialized else torch.zeros(0, dtype=torch.long)
            self._layer_tokens.append(
                {
                    "layer": i,
                    "tokens": layer.total_entries_per_head(),
                    "visual_tokens": int(ctx.is_visual(idx).sum()) if idx.numel() else 0,
                    "kv_bytes": layer.kv_bytes(),
                }
            )

    # -- report -----------------------------------------------------------------------------------------------------
    def flops_estimate(self, ctx: PrefillContext) -> dict[str, float]:
        """Decoder FLOPs of this prefill vs the same prefill without merging (vision tower, LM head excluded).

        Per layer: 2 x tokens x (linear weights of the layer) + 4 x query heads x head_dim x (query, key)
        pairs (causal). Full = every layer doing layer 0's work (layer 0 never loses a token).
        """
        layer0 = ctx.adapter.layers[0]
        params = sum(p.numel() for name, p in layer0.named_parameters() if p.dim() == 2)
        cfg = ctx.adapter.text_config
        per_pair = 4.0 * cfg.num_attention_heads * ctx.adapter.head_dim

        def layer_flops(tokens: int, pairs: int) -> float:
            return 2.0 * tokens * params + per_pair * pairs

        full = layer_flops(*self._layer_work[0]) * len(self._layer_work)
        merged = sum(layer_flops(t, p) for t, p in self._layer_work)
        total = merged + self._overhead_flops
        return {
            "llm_full": full,
            "llm_lightkv": merged,
            "overhead": self._overhead_flops,
            "reduction": 1.0 - total / full if full else 0.0,
        }

    def report(self, ctx: PrefillContext) -> dict[str, Any]:
        if not self.stages:
            return {}
        stages = [dict(s) for s in self._stage_log]
        xi_s = sum(s["xi_seconds"] for s in stages) + self._proxy_seconds
        merge_s = sum(s["merge_seconds"] for s in stages)
        return {
            "layer_tokens": self._layer_tokens,
            "merge_map": self._owner.tolist(),
            "lightkv": {
                "layers": [s[0] for s in self.stages],
                "windows": [s[1] for s in self.stages],
                "ratios": [s[2] for s in self.stages],
                "schedule": "user" if self.config.layers is not None else "paper, scaled to depth",
                "xi_source": self._xi_source,
                "stages": stages,
                "overhead_seconds": {
                    "xi": xi_s,
                    "proxy_pass": self._proxy_seconds,
                    "merge": merge_s,
                    "total": xi_s + merge_s,
                },
                "flops": self.flops_estimate(ctx),
            },
        }
