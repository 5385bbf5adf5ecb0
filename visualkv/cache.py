"""The compressible KV cache: a transformers `Cache` with per-head bookkeeping.

Each layer holds, per KV head, the kept entries in original sequence order:
full-precision keys/values, optional packed INT8 / INT4 segments (Sali-Cache),
and for every entry the index of the token it came from in the conversation's
token sequence (`token_index`). That index is the entry's original position:
the engine keeps a table from sequence index to position ids (3-D M-RoPE ids
for Qwen), so nothing is ever renumbered.

Byte accounting is exact: `kv_bytes()` is the sum of `nbytes` of the K/V
tensors (packed data + scales + zero points included) really held.
Bookkeeping (`token_index`, int32) is reported separately as `index_bytes()`.
Tensors live on the device of the keys they were created from, i.e. of their
layer, so a model sharded with `device_map="auto"` keeps its cache sharded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from visualkv.quant import PackedTensor, QuantSpec, cat_packed, dequantize, quantize, select_tokens

TIER_FULL, TIER_INT8, TIER_INT4 = 0, 1, 2


@dataclass
class QuantSegment:
    """Packed keys/values of one precision tier, with their token indices."""

    keys: PackedTensor
    values: PackedTensor
    token_index: torch.Tensor  # (batch, kv_heads, n) int32

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


class CompressibleLayer(CacheLayerMixin):
    """One decoder layer's cache: full-precision segment + packed tiers."""

    is_sliding = False
    is_compileable = False

    def __init__(self) -> None:
        super().__init__()
        self.token_index: torch.Tensor | None = None  # (b, h, n) int32
        self.quant: dict[int, QuantSegment] = {}  # tier -> segment
        self.quant_specs: dict[int, QuantSpec] = {}

    # -- transformers' layer protocol -------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, d = key_states.shape
        self.keys = key_states.new_zeros((b, h, 0, d))
        self.values = value_states.new_zeros((b, h, 0, value_states.shape[-1]))
        self.token_index = torch.zeros((b, h, 0), dtype=torch.int32, device=self.device)
        self.is_initialized = True

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        token_index: torch.Tensor | None = None,
        tiers: torch.Tensor | None = None,
        *args,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new entries; return K/V to attend to (new entries last).

        token_index: (q,) sequence indices of the new tokens. tiers: optional
        (q,) tier per new token (TIER_FULL / TIER_INT8 / TIER_INT4); quantized
        tiers are stored packed, while the current block still attends to its
        own new entries at full precision (they were just computed).
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, h, q, _ = key_states.shape
        if token_index is None:
            start = self.total_entries_per_head()
            token_index = torch.arange(start, start + q)
        new_index = token_index.to(self.device, torch.int32).view(1, 1, q).expand(b, h, q)

        # What this block attends to: old quantized (dequantized just in time), old full, new.
        attend_k = [dequantize(seg.keys) for seg in self.quant.values()] + [self.keys, key_states]
        attend_v = [dequantize(seg.values) for seg in self.quant.values()] + [self.values, value_states]

        if tiers is None or bool((tiers == TIER_FULL).all()):
            self._append_full(key_states, value_states, new_index)
        else:
            tiers = tiers.to(self.device)
            for tier in (TIER_FULL, TIER_INT8, TIER_INT4):
                sel = (tiers == tier).nonzero().flatten()
                if sel.numel() == 0:
                    continue
                k, v, idx = key_states[:, :, sel], value_states[:, :, sel], new_index[:, :, sel]
                if tier == TIER_FULL:
                    self._append_full(k, v, idx)
                else:
                    self._append_quant(tier, k, v, idx)
        return torch.cat(attend_k, dim=-2), torch.cat(attend_v, dim=-2)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.total_entries_per_head()

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.keys = self.values = self.token_index = None
        self.quant = {}
        self.is_initialized = False

    # -- storage -----------------------------------------------------------------------
    def _append_full(self, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor) -> None:
        self.keys = torch.cat([self.keys, k], dim=-2)
        self.values = torch.cat([self.values, v], dim=-2)
        self.token_index = torch.cat([self.token_index, idx], dim=-1)

    def _append_quant(self, tier: int, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor) -> None:
        spec = self.quant_specs.get(tier) or QuantSpec(bits=8 if tier == TIER_INT8 else 4)
        pk, pv = quantize(k, spec), quantize(v, spec)
        seg = self.quant.get(tier)
        if seg is None:
            self.quant[tier] = QuantSegment(pk, pv, idx.contiguous())
        else:
            self.quant[tier] = QuantSegment(
                cat_packed(seg.keys, pk), cat_packed(seg.values, pv), torch.cat([seg.token_index, idx], dim=-1)
            )

    # -- compression -------------------------------------------------------------------
    def keep_full(self, index: torch.Tensor) -> None:
        """Keep only full-precision entries `index` (b, h, m), per head, sorted."""
        index = index.sort(dim=-1).values
        d = self.keys.shape[-1]
        self.keys = self.keys.gather(2, index[..., None].expand(-1, -1, -1, d)).contiguous()
        self.values = self.values.gather(2, index[..., None].expand(-1, -1, -1, self.values.shape[-1])).contiguous()
        self.token_index = self.token_index.gather(2, index).contiguous()

    def keep_quant(self, tier: int, index: torch.Tensor) -> None:
        seg = self.quant[tier]
        index = index.sort(dim=-1).values
        self.quant[tier] = QuantSegment(
            select_tokens(seg.keys, index), select_tokens(seg.values, index), seg.token_index.gather(2, index)
        )

    def replace_full(self, keys: torch.Tensor, values: torch.Tensor, token_index: torch.Tensor) -> None:
        """Overwrite the full-precision segment (used by merging methods)."""
        self.keys, self.values, self.token_index = keys.contiguous(), values.contiguous(), token_index.contiguous()

    # -- accounting --------------------------------------------------------------------
    def total_entries_per_head(self) -> int:
        if not self.is_initialized:
            return 0
        return int(self.keys.shape[-2]) + sum(int(s.token_index.shape[-1]) for s in self.quant.values())

    def all_token_index(self) -> torch.Tensor:
        """(b, h, n) token indices of every entry, quantized ones first."""
        if not self.is_initialized:
            return torch.zeros((1, 1, 0), dtype=torch.int32)
        return torch.cat([s.token_index for s in self.quant.values()] + [self.token_index], dim=-1)

    def kv_bytes(self) -> int:
        if not self.is_initialized:
            return 0
        return self.keys.nbytes + self.values.nbytes + sum(s.nbytes for s in self.quant.values())

    def index_bytes(self) -> int:
        if not self.is_initialized:
            return 0
        return self.token_index.nbytes + sum(s.token_index.nbytes for s in self.quant.values())

    def tier_counts(self) -> dict[int, int]:
        """Entries per tier summed over heads (batch 0)."""
        if not self.is_initialized:
            return {}
        counts = {TIER_FULL: int(self.token_index[0].numel())}
        for tier, seg in self.quant.items():
            counts[tier] = int(seg.token_index[0].numel())
        return counts


class CompressibleCache(Cache):
    """A transformers `Cache` made of `CompressibleLayer`s.

    The engine sets `pending_token_index` / `pending_tiers` before running a
    layer, because transformers' attention modules call
    `update(key, value, layer_idx)` without them. `peak_kv_bytes` is the
    high-water mark of `kv_bytes()` observed right after every append (that is,
    before any eviction), which is when a block-wise cache is fullest.
    """

    def __init__(self, num_layers: int) -> None:
        super().__init__(layers=[CompressibleLayer() for _ in range(num_layers)])
        self.pending_token_index: torch.Tensor | None = None
        self.pending_tiers: torch.Tensor | None = None
        self.peak_kv_bytes = 0
        self._layer_bytes = [0] * num_layers

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[layer_idx]
        out = layer.update(key_states, value_states, self.pending_token_index, self.pending_tiers)
        self.refresh_bytes(layer_idx)
        return out

    def refresh_bytes(self, layer_idx: int) -> None:
        """Re-count one layer's bytes (after append or eviction) and track the peak."""
        self._layer_bytes[layer_idx] = self.layers[layer_idx].kv_bytes()
        self.peak_kv_bytes = max(self.peak_kv_bytes, sum(self._layer_bytes))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].get_seq_length()

    def kv_bytes(self) -> int:
        return sum(layer.kv_bytes() for layer in self.layers)

    def index_bytes(self) -> int:
        return sum(layer.index_bytes() for layer in self.layers)

    def entries_per_layer(self) -> list[int]:
        """Entries per KV head in each layer (all heads hold the same count)."""
        return [layer.total_entries_per_head() for layer in self.layers]
