"""Prefill driver (bulk / block-wise / hybrid) and single decode steps.

The engine runs the decoder layers itself, one block at a time:

    for block in plan_blocks(...):
        embeddings of the block's tokens (text embedding, or the vision tower
          run on just this block's tiles / rows / frames)
        for each decoder layer: attend to cache ∪ block, append, then let the
          method evict / merge for that layer
        emit a BlockEvent (bytes, entries, RSS, seconds)

So neither the full visual embedding sequence nor the full KV cache ever
exists in a block-wise prefill. Positions come from the prepared input's table
(computed once over the uncompressed sequence), so kept entries keep their
original positions and new tokens continue the original numbering.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from visualkv.cache import CompressibleCache
from visualkv.layout import Block, plan_blocks
from visualkv.methods.base import LayerState, Method, PrefillContext
from visualkv.models.base import LayerFeatures, ModelAdapter, PreparedInput
from visualkv.telemetry import BlockEvent, cuda_allocated, rss_bytes

BlockCallback = Callable[[BlockEvent], None]


@dataclass
class PrefillResult:
    logits: torch.Tensor  # (vocab,) logits of the last prompt token
    blocks: list[BlockEvent]
    context: PrefillContext
    seconds: float


def attention_mask(q: int, n_past: int, impl: str, dtype: torch.dtype, device) -> torch.Tensor | None:
    """Mask for q new tokens after n_past cached entries (all of which are older).

    Every cached entry is visible, whatever was evicted; the block itself is
    causal. One query token needs no mask, nor does a first block under an
    SDPA-like kernel (its own causal flag is used, as transformers does).
    Bool for SDPA-like kernels, additive float for eager attention.
    """
    if q == 1 or (n_past == 0 and impl != "eager"):
        return None  # SDPA-like kernels then run causally without materialising a mask
    allowed = torch.ones((q, n_past + q), dtype=torch.bool, device=device)
    allowed[:, n_past:] = torch.ones((q, q), dtype=torch.bool, device=device).tril()
    allowed = allowed[None, None]
    if impl == "eager":
        return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    return allowed


class Engine:
    """Runs blocks of tokens through the LLM with a `CompressibleCache`."""

    def __init__(self, adapter: ModelAdapter) -> None:
        self.adapter = adapter

    # -- the layer loop -------------------------------------------------------------
    @torch.no_grad()
    def run_layers(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        token_index: torch.Tensor,
        cache: CompressibleCache,
        method: Method | None = None,
        ctx: PrefillContext | None = None,
        tiers: torch.Tensor | None = None,
        layer_features: LayerFeatures | None = None,
    ) -> torch.Tensor:
        """hidden (1, q, d) through every decoder layer; returns the last hidden states.

        layer_features: the block's DeepStack-style additions, added after their layers (before the
        method sees the layer's output, as they are part of the model's own layer output).
        """
        adapter = self.adapter
        cos, sin = adapter.rotary(hidden, positions)
        for layer_idx, layer in enumerate(adapter.layers):
            device = layer.input_layernorm.weight.device
            hidden, cos, sin = hidden.to(device), cos.to(device), sin.to(device)
            n_past = cache.layers[layer_idx].get_seq_length()
            mask = attention_mask(hidden.shape[1], n_past, adapter.attn_implementation, hidden.dtype, device)
            cache.pending_token_index = token_index
            cache.pending_tiers = tiers
            out = layer(
                hidden, attention_mask=mask, position_embeddings=(cos, sin), past_key_values=cache, use_cache=True
            )
            if layer_features is not None:
                out = layer_features.add_after_layer(layer_idx, out, token_index)
            if method is not None:
                state = LayerState(layer_idx, hidden, out, positions, token_index, cos, sin, tiers)
                new = method.after_layer(ctx, state)
                if new is not None:
                    out, positions, token_index, cos, sin, tiers = (
                        new.hidden, new.positions, new.token_index, new.cos, new.sin, new.tiers
                    )
            hidden = out
        cache.pending_token_index = cache.pending_tiers = None
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.adapter.final_hidden_to_logits(hidden[:, -1:])[0, -1]

    # -- prefill --------------------------------------------------------------------
    def block_embeddings(
        self, prepared: PreparedInput, block: Block, encoded: list[int] | None = None, seq_offset: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, LayerFeatures | None]:
        """(1, q, d) embeddings of the block's kept tokens, their local indices (q,) and the kept visual
        tokens' per-layer features (DeepStack; None for families without), indexed by `seq_offset + local`.

        Units none of whose tokens are kept (skipped frames) never reach the
        vision tower; `encoded` collects the frame/tile index of each unit sent.
        """
        local = torch.arange(block.start, block.end)
        keep = prepared.keep[block.start : block.end]
        local = local[keep]
        ids = prepared.input_ids[local]
        hidden = self.adapter.embed(ids)
        units = [u for u in block.units if bool(prepared.keep[u.seq_start : u.seq_end].any())]
        layer_features = None
        if units:
            if encoded is not None:
                encoded.extend(u.frame for u in units)
            # (n_unit_tokens, d), all tokens of those units, and any per-layer features of the same tokens
            visual, per_layer = self.adapter.encode_units_with_layer_features(prepared, units)
            unit_idx = torch.cat([torch.arange(u.seq_start, u.seq_end) for u in units])
            kept = prepared.keep[unit_idx]
            visual, unit_idx = visual[kept.to(visual.device)], unit_idx[kept]
            where = torch.searchsorted(local, unit_idx)
            hidden[0, where.to(hidden.device)] = visual.to(hidden.device, hidden.dtype)
            if per_layer:
                layer_features = LayerFeatures(unit_idx + seq_offset, [f[kept.to(f.device)] for f in per_layer])
        return hidden, local, layer_features

    @torch.no_grad()
    def prefill(
        self,
        prepared: PreparedInput,
        cache: CompressibleCache,
        method: Method,
        budget: int | None,
        block_size: int | None = None,
        prefill_mode: str | None = None,
        seq_offset: int = 0,
        on_block: BlockCallback | None = None,
    ) -> PrefillResult:
        """Run the whole prepared input into `cache` under `method`."""
        t_start = time.perf_counter()
        block_size = block_size or self.adapter.default_block_size
        mode = prefill_mode or method.default_prefill
        ctx = PrefillContext(self.adapter, cache, prepared, budget, block_size, mode, seq_offset)
        self.adapter.reset_stream()
        method.begin(ctx)
        ctx.blocks = plan_blocks(prepared.seq_len, prepared.layout.units, mode, block_size, budget)
        events: list[BlockEvent] = []
        last_hidden = None
        for block in ctx.blocks:
            t0 = time.perf_counter()
            ctx.block = block
            hidden, local, layer_features = self.block_embeddings(prepared, block, ctx.encoded_frames, seq_offset)
            if local.numel() == 0:
                continue
            tiers = ctx.tiers[local] if ctx.tiers is not None else None
            hidden = self.run_layers(
                hidden, prepared.position_ids[:, local], local + seq_offset, cache, method, ctx, tiers, layer_features
            )
            last_hidden = hidden
            per_layer = cache.entries_per_layer()
            event = BlockEvent(
                index=len(events),
                kind=block.kind,
                tokens_in=int(local.numel()),
                visual_tokens_in=int(prepared.visual_mask[local].sum()),
                kv_tokens=max(per_layer),
                kv_tokens_per_layer=per_layer,
                kv_bytes=cache.kv_bytes(),
                peak_kv_bytes=cache.peak_kv_bytes,
                rss_bytes=rss_bytes(),
                seconds=time.perf_counter() - t0,
                cuda_allocated_bytes=cuda_allocated(),
                n_blocks=len(ctx.blocks),
            )
            events.append(event)
            if on_block is not None:
                on_block(event)
        if last_hidden is None:
            raise ValueError("nothing to prefill: every token was dropped")
        method.end(ctx)
        self.adapter.reset_stream()
        logits = self.logits(last_hidden)
        return PrefillResult(logits, events, ctx, time.perf_counter() - t_start)

    @torch.no_grad()
    def extend(self, ids: torch.Tensor, start_position: int, seq_offset: int, cache: CompressibleCache) -> torch.Tensor:
        """Run plain text tokens (protected) after the cache; returns last logits."""
        n = int(ids.shape[0])
        positions = (torch.arange(n) + start_position).view(1, n).expand(self.adapter.position_axes, n)
        hidden = self.adapter.embed(ids)
        hidden = self.run_layers(hidden, positions, torch.arange(n) + seq_offset, cache)
        return self.logits(hidden)
