"""Sali-Cache (arXiv 2602.14236): decide before attention what each patch deserves.

A temporal filter (video only; `visualkv.media.saliency.MotionFilter`: optical flow plus a photometric check
against the last kept frame) marks redundant frames `keep=False` in `begin`, so they never reach the vision
encoder; a Qwen temporal patch is skipped only when all its frames are, so a one-frame event is never lost.
A spatial filter (edge density and colour variance in each token's pixel box, `token_saliency`) ranks the
visual tokens of kept frames into tiers (`TierSpec`): full precision, INT8 and INT4 (stored packed in the
cache, dequantized at every later attention) or pruned (never in the LLM). Text stays full precision.
`report` lists per sampled frame its motion and decision, the tier counts, and per token its saliency and tier.

Limits: the flow threshold is calibrated on synthetic footage (heavy noise keeps frames, never wrongly skips
them); saliency is a pixel heuristic, blind to what the question asks.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from visualkv.errors import ConfigError
from visualkv.kv.cache import TIER_FULL, TIER_INT4, TIER_INT8
from visualkv.kv.quant import QuantSpec
from visualkv.media.saliency import (
    MAX_CUT_THRESHOLD,
    MAX_DOWNSCALE_WIDTH,
    MAX_FLOW_THRESHOLD,
    TIER_PRUNED,
    MotionConfig,
    TierSpec,
    assign_tiers,
    frame_decisions,
    motion_pass_bytes,
    parse_tiers,
    saliency_pass_bytes,
    token_saliency,
)
from visualkv.methods.base import Method, PrefillContext
from visualkv.methods.options import Options, option

#: tier code of a token whose frame was skipped by the temporal filter (report only)
TIER_SKIPPED = 4
TIER_NAMES = ("full", "int8", "int4", "pruned", "skipped")
#: the paper's patch split (LLaVA-1.6-Mistral-7B), for side-by-side reports
PAPER_TIER_FRACTIONS = {"skipped": 0.267, "pruned": 0.131, "int4": 0.214, "int8": 0.071, "full": 0.317}
MAX_GROUP_SIZE = 1024  # channels per quantization scale (a group shrinks to head_dim when larger)


@dataclass
class SaliCacheConfig(Options):
    """Sali-Cache settings (all printable, all in the report); `tiers` may be a string ``"0.43,0.1,0.29"``.

    Raises ConfigError (one line) on any invalid value.
    """

    label = "salicache"

    flow_threshold: float = option(
        0.1, "tau_t: frames moving less than this (px at 160 px width) may be redundant and skipped; 0 keeps every "
        "frame", low=0.0, high=MAX_FLOW_THRESHOLD, flag="--flow-threshold",
    )  # fmt: skip
    cut_threshold: float = option(
        8.0, "photometric change (0-255) at or above which a frame is always kept (cuts, flashes)",
        low=0.0, high=MAX_CUT_THRESHOLD,
    )  # fmt: skip
    tiers: tuple[float, float, float] = option(
        TierSpec().fractions, "fractions of tokens kept FP16, INT8, INT4 by saliency (the rest is pruned), e.g. "
        "0.43,0.1,0.29; with another method, stacks the tiers on it", flag="--tiers", metavar="FP,INT8,INT4",
    )  # fmt: skip
    group_size: int = option(
        32, "values sharing one scale and zero point when quantizing (shrinks to head_dim when larger)",
        low=1, high=MAX_GROUP_SIZE, whole=True,
    )  # fmt: skip
    flow: str = option("farneback", "optical flow algorithm: farneback or dis")
    downscale_width: int = option(
        160, "frames are downscaled to this width before measuring motion",
        low=16, high=MAX_DOWNSCALE_WIDTH, whole=True, shared_max=320,
    )  # fmt: skip
    edge_weight: float = option(
        0.5, "weight of edge density against LAB colour variance in the saliency", low=0.0, high=1.0
    )

    def __post_init__(self) -> None:
        super().__post_init__()  # the bounds, one line naming the setting, before anything is computed
        try:
            tiers = parse_tiers(self.tiers) if isinstance(self.tiers, str) else TierSpec(tuple(map(float, self.tiers)))
            self.tiers = tiers.fractions
            self.flow_threshold, self.cut_threshold = float(self.flow_threshold), float(self.cut_threshold)
            self.edge_weight = float(self.edge_weight)
            self.group_size, self.downscale_width = int(self.group_size), int(self.downscale_width)
            self.motion_config()  # validates the flow's name
            QuantSpec(8, self.group_size)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"salicache: {exc}") from None

    def motion_config(self) -> MotionConfig:
        return MotionConfig(self.downscale_width, self.flow, self.flow_threshold, self.cut_threshold)


class SaliCache(Method):
    name = "salicache"
    description = "Skip redundant video frames before encoding; keep tokens at FP / INT8 / INT4 / pruned by saliency."
    plain = "for videos: skips frames that barely change and stores the less important parts more coarsely"
    default_prefill = "bulk"
    question_apart = True  # the question reads the media as stored (packed tiers), see the module doc
    compose_role = "entry"  # composes with block-wise eviction (visualkv.methods.compose)
    Config = SaliCacheConfig

    def __init__(self, config: SaliCacheConfig | None = None, **options: Any) -> None:
        super().__init__(config, **options)
        self.motion = self.config.motion_config()
        self.tier_spec = TierSpec(self.config.tiers)
        self.state: dict[str, Any] | None = None  # what `begin` decided, for the report

    @property
    def stored_shares(self) -> tuple[float, float, float]:
        return self.config.tiers

    def begin_bytes(self, prepared) -> int:
        """The larger of its passes, which run one after the other: a video's motion pass, the saliency pass."""
        media = prepared.media
        if media is None:
            return 0
        motion = motion_pass_bytes(media.size, self.motion) if media.kind == "video" else 0
        return max(motion, saliency_pass_bytes(media.size))

    # -- decisions before any block ----------------------------------------------------
    def begin(self, ctx: PrefillContext) -> None:
        t0 = time.perf_counter()
        prepared, layout = ctx.prepared, ctx.prepared.layout
        head_dim = ctx.adapter.head_dim
        specs = {TIER_INT8: QuantSpec(8, self.config.group_size), TIER_INT4: QuantSpec(4, self.config.group_size)}
        try:
            specs = {tier: spec.resolved(head_dim) for tier, spec in specs.items()}
        except ValueError as exc:
            raise ConfigError(f"salicache: {exc} (model head_dim {head_dim}); choose another group_size") from None
        for layer in ctx.cache.layers:
            layer.quant_specs = dict(specs)

        n_visual = layout.n_visual
        media = prepared.media
        keep = torch.ones(prepared.seq_len, dtype=torch.bool)
        tiers = torch.full((prepared.seq_len,), TIER_FULL, dtype=torch.long)
        decisions = []
        unit_skipped = np.zeros(len(layout.frames), dtype=bool)
        saliency = np.full(n_visual, np.nan, dtype=np.float32)  # NaN: not computed (skipped frame)
        tier_of_token = np.full(n_visual, TIER_FULL, dtype=np.int64)
        if n_visual and media is not None:
            is_video = media.kind == "video"
            if is_video:
                # one streaming pass over frames downscaled right after decoding (a lazy video never
                # holds more than one full-size frame here); same pixels as downscaling full frames
                decisions = frame_decisions(media.iter_small(self.motion.downscale_width), self.motion, ctx.should_stop)
                redundant = [d.redundant for d in decisions]
                for f, info in enumerate(layout.frames):
                    unit_skipped[f] = all(redundant[s] for s in info.source_frames)
            token_skipped = unit_skipped[layout.frame]
            active = np.flatnonzero(~token_skipped)
            saliency = _token_saliency(media.frames, layout, self.config.edge_weight, active, ctx.should_stop)
            if media.is_lazy:  # the last decoded frames it cached (full size) are not what the blocks read first
                media.frames.clear_cache()
            tier_of_token[token_skipped] = TIER_SKIPPED
            tier_of_token[active] = assign_tiers(saliency[active], self.tier_spec)
            seq = torch.from_numpy(layout.seq_index.astype(np.int64))
            codes = torch.from_numpy(tier_of_token)
            keep[seq[codes >= TIER_PRUNED]] = False
            quantized = (codes == TIER_INT8) | (codes == TIER_INT4)
            tiers[seq[quantized]] = codes[quantized]
        prepared.keep = keep
        ctx.tiers = tiers if bool((tiers != TIER_FULL).any()) else None
        ctx.tier_shares = self.config.tiers  # an eviction stage splits its budget M by them (all tiers bounded)
        self.state = {
            "decisions": decisions,
            "unit_skipped": unit_skipped,
            "saliency": saliency,
            "tier_of_token": tier_of_token,
            "seconds": time.perf_counter() - t0,
        }

    # -- report --------------------------------------------------------------------------
    def report(self, ctx: PrefillContext) -> dict[str, Any]:
        state = self.state
        if state is None:
            return {}
        layout, media = ctx.prepared.layout, ctx.prepared.media
        codes = state["tier_of_token"]
        counts = np.bincount(codes, minlength=len(TIER_NAMES))
        n_visual = max(int(codes.size), 1)
        tiers = {name: int(counts[code]) for code, name in reversed(list(enumerate(TIER_NAMES)))}
        encoded_units = sorted(set(ctx.encoded_frames))
        out: dict[str, Any] = {
            "flow_threshold": self.config.flow_threshold,
            "cut_threshold": self.config.cut_threshold,
            "tier_spec": {**dict(zip(TIER_NAMES, self.config.tiers)), "pruned": round(self.tier_spec.pruned, 6)},
            "quant_group_size": self.config.group_size,
            "tiers": tiers,
            "tier_fractions": {name: count / n_visual for name, count in tiers.items()},
            "tier_names": list(TIER_NAMES),
            "tier": codes.tolist(),
            "saliency": [None if np.isnan(v) else round(float(v), 4) for v in state["saliency"]],
            "llm_tokens": int(ctx.prepared.keep.sum()),
            "vision_encoder_frames": len(encoded_units),
            "vision_encoder_units": encoded_units,
            "vision_encoder_source_frames": sum(len(layout.frames[u].source_frames) for u in encoded_units),
            "kv_bytes_by_tier": _bytes_by_tier(ctx),
            "salicache_seconds": state["seconds"],
        }
        if media is not None and media.kind == "video":
            unit_of_frame: dict[int, int] = {}
            for f, info in enumerate(layout.frames):
                for s in info.source_frames:
                    unit_of_frame.setdefault(s, f)
            frames = []
            for d in state["decisions"]:
                unit = unit_of_frame.get(d.index)
                frames.append(
                    {
                        "index": d.index,
                        "time": float(media.times[d.index]),
                        "motion": None if d.reference is None else round(float(d.motion), 4),
                        "photometric": None if d.reference is None else round(float(d.photometric), 3),
                        "reference": d.reference,
                        "redundant": bool(d.redundant),
                        "skipped": bool(state["unit_skipped"][unit]) if unit is not None else True,
                        "unit": unit,
                    }
                )
            out["frames"] = frames
        return out


def _token_saliency(
    frames: Sequence[np.ndarray], layout, edge_weight: float, active: np.ndarray, should_stop=None
) -> np.ndarray:
    """Saliency of the ``active`` visual tokens (NaN elsewhere): max over the token's source
    frames (2 for a Qwen patch), normalised over all active tokens. Skipped frames cost nothing.

    Streams: ``token_saliency`` visits the referenced frames once each, in ascending order, and
    drops each after its box statistics, so a lazy video (``visualkv.media.LazyFrames``) holds one
    decoded full-resolution frame at a time (plus its small cache); only per-token arrays grow."""
    sources = [layout.frames[f].source_frames or (0,) for f in range(len(layout.frames))]
    depth = max(len(s) for s in sources)
    token_ids, frame_ids = [], []
    for k in range(depth):
        source_k = np.array([s[k] if k < len(s) else -1 for s in sources])[layout.frame[active]]
        ids = active[source_k >= 0]
        token_ids.append(ids)
        frame_ids.append(source_k[source_k >= 0])
    token_ids_all = np.concatenate(token_ids)
    out = np.full(layout.n_visual, np.nan, dtype=np.float32)
    if token_ids_all.size == 0:
        return out
    values = token_saliency(
        frames,
        layout.box,
        np.concatenate(frame_ids),
        edge_weight=edge_weight,
        box_index=token_ids_all,
        should_stop=should_stop,
    )
    out[active] = 0.0
    np.maximum.at(out, token_ids_all, values)
    return out


def _bytes_by_tier(ctx: PrefillContext) -> dict[str, int]:
    """KV bytes (K and V, all layers) held per precision tier right now."""
    out = {"full": 0, "int8": 0, "int4": 0}
    for layer in ctx.cache.layers:
        if not layer.is_initialized:
            continue
        out["full"] += layer.keys.nbytes + layer.values.nbytes
        for tier, seg in layer.quant.items():
            out[TIER_NAMES[tier]] += seg.nbytes
    return out
