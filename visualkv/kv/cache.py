"""The compressible KV cache: a transformers `Cache` with per-head bookkeeping, built for the device.

Each layer holds, per KV head, the kept entries in sequence order (full-precision K/V, optional packed INT8 /
INT4 segments) and each entry's `token_index`, its original position in the conversation, so nothing is ever
renumbered. Buffers are preallocated per layer on its own device and written in place; eviction compacts in
place; entry counts are host ints, so nothing here reads the device. Byte figures (`kv_bytes`,
`allocated_bytes`, `peak_device_bytes`) are exact, from tensor shapes. Layout and accounting:
docs/ARCHITECTURE.md#the-cache-on-the-device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from visualkv.attention import packed as packed_attention
from visualkv.attention import step as layer_step
from visualkv.kv.quant import PackedTensor, QuantSpec, quantize
from visualkv.models import compat

TIER_FULL, TIER_INT8, TIER_INT4 = 0, 1, 2
GROWTH = 1.25  # geometric growth factor of a buffer without a capacity hint
MIN_GROWTH = 256  # entries added at least per growth


def grown_capacity(needed: int, capacity: int, hint: int | None) -> int:
    """New capacity (entries) for `needed` entries in a buffer of `capacity` (the memory guard dry-runs it)."""
    if hint is not None and needed <= hint:
        return hint
    if capacity == 0:
        return needed  # the first allocation is exact (it already includes the answer's headroom)
    return max(needed, int(capacity * GROWTH), capacity + MIN_GROWTH)


def _alloc_like(t: torch.Tensor, capacity: int) -> torch.Tensor:
    """An empty buffer shaped like `t` with `capacity` entries along dim 2."""
    return t.new_empty((*t.shape[:2], capacity, *t.shape[3:]))


class _Rows:
    """A group of buffers sharing one entry axis (dim 2): append, view, compact in place."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self.n = 0  # entries held (host int)

    @property
    def capacity(self) -> int:
        return self.buffers[0].shape[2] if self.buffers else 0

    def ensure(self, needed: int, like: list[torch.Tensor], hint: int | None) -> int:
        """Room for `needed` entries; returns the bytes of the old buffers copied (transient), 0 if none."""
        if self.buffers and needed <= self.capacity:
            return 0
        cap = grown_capacity(needed, self.capacity, hint)
        old = self.buffers
        new = [_alloc_like(t, cap) for t in (old or like)]
        for dst, src in zip(new, old):
            dst[:, :, : self.n].copy_(src[:, :, : self.n])
        self.buffers = new
        return sum(b.nbytes for b in old)

    def append(self, tensors: list[torch.Tensor], hint: int | None) -> int:
        q = tensors[0].shape[2]
        moved = self.ensure(self.n + q, tensors, hint)
        for dst, src in zip(self.buffers, tensors):
            dst[:, :, self.n : self.n + q].copy_(src)
        self.n += q
        return moved

    def held_bytes(self, n_buffers: int) -> int:
        """Bytes of the entries held in the first `n_buffers` buffers (from shapes: no device read)."""
        return self.n * sum(b.nbytes // b.shape[2] for b in self.buffers[:n_buffers]) if self.capacity else 0

    def view(self, i: int, start: int = 0) -> torch.Tensor:
        return self.buffers[i][:, :, start : self.n]

    def compact(self, index: torch.Tensor, start: int = 0) -> int:
        """Keep entries `index` (b, h, m) of [start, n), sorted, in place; returns transient bytes."""
        m = index.shape[-1]
        working = 0
        expanded: dict[tuple, torch.Tensor] = {}  # one expanded index per trailing shape (keys and values share it)
        for buf in self.buffers:
            held = buf[:, :, start : self.n]
            trailing = tuple(held.shape[3:])
            if trailing not in expanded:  # the token-index buffer (no trailing dims) takes the index as it is
                expanded[trailing] = (
                    index.view(*index.shape, *([1] * len(trailing))).expand(*index.shape, *trailing)
                    if trailing
                    else index
                )
            kept = held.gather(2, expanded[trailing])  # transient: the kept entries, then copied to the front
            working += kept.nbytes
            buf[:, :, start : start + m].copy_(kept)
        self.n = start + m
        return working


@dataclass
class QuantSegment:
    """Packed keys/values of one precision tier, with their token indices (views of the layer's buffers)."""

    keys: PackedTensor
    values: PackedTensor
    token_index: torch.Tensor  # (batch, kv_heads, n) int32

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


class _PackedStore:
    """One tier's packed K/V (data, scale, zero for each) and token index, in growable buffers."""

    def __init__(self, spec: QuantSpec, head_dim: int, dtype: torch.dtype) -> None:
        self.spec, self.head_dim, self.dtype = spec, head_dim, dtype
        self.rows = _Rows()  # buffers: k data, k scale, k zero, v data, v scale, v zero, token index

    def append(self, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor) -> int:
        pk, pv = quantize(k, self.spec), quantize(v, self.spec)
        parts = [pk.data, pk.scale, pk.zero, pv.data, pv.scale, pv.zero, idx]
        return self.rows.append(parts, None)

    def segment(self) -> QuantSegment:
        r = self.rows
        b, h = r.buffers[0].shape[:2]
        shape = (b, h, r.n, self.head_dim)
        keys = PackedTensor(r.view(0), r.view(1), r.view(2), shape, self.dtype, self.spec)
        values = PackedTensor(r.view(3), r.view(4), r.view(5), shape, self.dtype, self.spec)
        return QuantSegment(keys, values, r.view(6))


class CompressibleLayer(compat.CacheLayerBase):
    """One decoder layer's cache: full-precision entries + packed tiers, in preallocated device buffers.

    Buffer layout along the entry axis: [full-precision entries | free]; each packed tier has its own buffers.
    `keys` / `values` / `token_index` are views of the full-precision entries.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = True  # `crop` drops the newest entries, which are full precision

    def __init__(self) -> None:
        self._rows = _Rows()  # buffers: keys, values, token index
        self._stores: dict[int, _PackedStore] = {}
        self.capacity_hint: int | None = None  # full-precision entries this layer will need at most, if known
        self.headroom = 0  # entries added to the first allocation (the answer to come), so decoding never grows
        self.visual_entries = 0  # visual entries held per head (host int, kept by the engine and eviction)
        self.quant_specs: dict[int, QuantSpec] = {}
        self.working_bytes = 0  # transient bytes of the last operation (read by the cache's peak)
        self.query_group = 1  # query heads per KV head (GQA): sizes a decode step's packed-attention transient
        self._segments: list[QuantSegment] | None = None  # `packed_segments()` until a packed tier changes
        super().__init__()

    # `keys` / `values` are views, not attributes: transformers' base class assigns None to them.
    @property
    def keys(self) -> torch.Tensor | None:
        return self._rows.view(0) if self.is_initialized else None

    @keys.setter
    def keys(self, value) -> None:
        if value is not None:
            raise AttributeError("CompressibleLayer.keys is a read-only view of the layer's buffer")

    @property
    def values(self) -> torch.Tensor | None:
        return self._rows.view(1) if self.is_initialized else None

    @values.setter
    def values(self, value) -> None:
        if value is not None:
            raise AttributeError("CompressibleLayer.values is a read-only view of the layer's buffer")

    @property
    def token_index(self) -> torch.Tensor | None:
        return self._rows.view(2) if self.is_initialized else None

    @property
    def n_full(self) -> int:
        return self._rows.n

    @property
    def quant(self) -> dict[int, QuantSegment]:
        """tier -> packed segment (views)."""
        return {tier: s.segment() for tier, s in self._stores.items() if s.rows.n}

    # -- transformers' layer protocol -------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        token_index: torch.Tensor | None = None,
        tiers: dict[int, torch.Tensor] | None = None,
        *args,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new entries; return the full-precision K/V to attend to (new entries last, in block order).

        The packed tiers held before this call are attended too: the runner puts them (`packed_segments()`, taken
        before the layer runs) in the layer call's step, and the attention call that reads what this returns adds
        them, dequantized for that call only.

        token_index: (q,) sequence indices of the new tokens (on this layer's
        device, or moved here). tiers: None (all full precision) or {tier: (k,)
        positions in the block} for every tier present (see `split_tiers`; a
        (q,) tensor of tier codes is also accepted and split here);
        quantized tiers are stored packed, while the current block still attends
        to its own new entries at full precision (they were just computed).
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if isinstance(tiers, torch.Tensor):  # (q,) tier codes, for direct callers: split here (reads them)
            tiers = split_tiers(tiers)
        b, h, q, _ = key_states.shape
        if token_index is None:
            start = self.total_entries_per_head()
            token_index = torch.arange(start, start + q, device=self.device)
        new_index = token_index.to(self.device, torch.int32, non_blocking=True).view(1, 1, q).expand(b, h, q)
        self.working_bytes = 0
        if not self._rows.buffers:  # sized for what this layer keeps at full precision, plus the answer
            first = q if tiers is None else (tiers[TIER_FULL].numel() if TIER_FULL in tiers else 0)
            self.working_bytes += self._rows.ensure(
                first + self.headroom, [key_states, value_states, new_index], self.capacity_hint
            )
        self.working_bytes += self._attention_working_bytes(q, b, h, self._rows.n + q, key_states.shape[-1])
        if tiers is None:
            # The common path (every decode step, every block without quantized tiers): write in place, read a view.
            self.working_bytes += self._rows.append([key_states, value_states, new_index], self.capacity_hint)
            return self._rows.view(0), self._rows.view(1)
        # A block with quantized tiers (Sali-Cache prefill): attend to [old entries, the whole block at full
        # precision], then store each tier (one concatenation per layer per such block; never while decoding).
        attend_k = torch.cat([self._rows.view(0), key_states], dim=-2)
        attend_v = torch.cat([self._rows.view(1), value_states], dim=-2)
        self.working_bytes += attend_k.nbytes + attend_v.nbytes
        for tier, sel in tiers.items():
            sel = sel.to(self.device, non_blocking=True)  # a no-op when the engine put it there (BlockPlan)
            k, v, idx = key_states[:, :, sel], value_states[:, :, sel], new_index[:, :, sel]
            if tier == TIER_FULL:
                self.working_bytes += self._rows.append([k, v, idx], self.capacity_hint)
            else:
                self._append_quant(tier, k, v, idx)
        return attend_k, attend_v

    def packed_segments(self) -> list[QuantSegment]:
        """The packed segments as they are now, for the attention call of the layer's next block or step (views
        fixed to their current length: entries a block adds to a tier after this are not part of them, as the
        block attends to its own entries at full precision). Built once until a packed tier changes."""
        if self._segments is None:
            self._segments = list(self.quant.values()) if self._stores else []
        return self._segments

    def _attention_working_bytes(self, queries: int, b: int, h: int, window: int, d: int) -> int:
        """The transient of the attention call that adds the packed segments for `queries` new tokens over a
        `window` of full-precision entries (`packed_attention.working_bytes`; one layer at a time)."""
        segments = self.packed_segments()
        if not segments:
            return 0
        return packed_attention.working_bytes(segments, queries, self.query_group, torch.Size((b, h, window, d)))

    def packed_working_bytes(self, queries: int = 1) -> int:
        """What the attention call of `queries` new tokens holds while it adds this layer's packed tiers (see
        `packed_attention.working_bytes`; one query: a decode step)."""
        if not self._stores or not self._rows.buffers:
            return 0
        b, h, _, d = self._rows.buffers[0].shape
        return self._attention_working_bytes(queries, b, h, self._rows.n + queries, d)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.total_entries_per_head()

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self._rows = _Rows()
        self._stores = {}
        self._segments = None
        self.visual_entries = 0
        self.is_initialized = False

    # -- storage -----------------------------------------------------------------------
    def reserve(self, extra: int) -> None:
        """Make room for `extra` more full-precision entries (one growth now instead of several later)."""
        if self.is_initialized and self._rows.buffers:
            self.working_bytes = self._rows.ensure(self._rows.n + extra, [], self._rows.n + extra)

    def _append_quant(self, tier: int, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor) -> None:
        store = self._stores.get(tier)
        if store is None:
            spec = (self.quant_specs.get(tier) or QuantSpec(bits=8 if tier == TIER_INT8 else 4)).resolved(k.shape[-1])
            store = self._stores[tier] = _PackedStore(spec, k.shape[-1], k.dtype)
        self.working_bytes += store.append(k, v, idx)
        self._segments = None

    # -- fixed-shape decoding (visualkv.runtime.static_decode) ----------------------------------
    def static_window(self, steps: int) -> int:
        """Prepare for `steps` fixed-shape decode steps; returns the entries the window holds (held + steps).

        Reserves the room now: during fixed-shape decoding nothing may reallocate, as a CUDA graph keeps the
        buffers' addresses. The window covers the full-precision entries; the packed tiers (`packed_segments`,
        unchanged while an answer decodes) are added by the attention call.
        """
        self.reserve(steps)
        if self._rows.capacity < self._rows.n + steps:
            raise RuntimeError("cache has no room reserved for fixed-shape decoding")
        for buf in self._rows.buffers[:2]:  # masked slots still meet the values (0 x NaN garbage = NaN): zero them
            buf[:, :, self._rows.n : self._rows.n + steps].zero_()
        return self._rows.n + steps

    def write_slot(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        token_index: torch.Tensor,
        slot: torch.Tensor,
        window: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write one entry at device index `slot` (1,) and return the first `window` entries of K / V.

        Fixed shapes, no host read: the caller masks the slots not yet written. The host count is
        advanced afterwards by `commit_slots`.
        """
        keys, values, index = self._rows.buffers[:3]
        keys.index_copy_(2, slot, key_states)
        values.index_copy_(2, slot, value_states)
        index.index_copy_(2, slot, token_index.to(torch.int32).view(1, 1, 1).expand(*index.shape[:2], 1))
        return keys[:, :, :window], values[:, :, :window]

    def commit_slots(self, n: int) -> None:
        """Count `n` entries written by `write_slot` as held (they follow the held ones, in order)."""
        self._rows.n += n

    def truncate(self, length: int) -> None:
        """Drop the newest full-precision entries so that `length` entries per head remain (decoded tokens are
        appended last, at full precision): undoes decode steps fed past the answer's end. A host count only; the
        dropped slots become free capacity, overwritten by the next append."""
        drop = self.total_entries_per_head() - length
        if not 0 <= drop <= self.n_full:
            raise ValueError(f"cannot truncate a layer of {self.total_entries_per_head()} entries to {length}")
        self._rows.n -= drop

    # -- compression -------------------------------------------------------------------
    def keep_full(self, index: torch.Tensor) -> None:
        """Keep only full-precision entries `index` (b, h, m), per head, in place (sorted first)."""
        index = index.sort(dim=-1).values
        self.working_bytes = index.nbytes + self._rows.compact(index)

    def keep_quant(self, tier: int, index: torch.Tensor) -> None:
        store = self._stores[tier]
        index = index.sort(dim=-1).values
        self.working_bytes = store.rows.compact(index.to(self.device))
        self._segments = None

    # -- accounting (host ints and tensor shapes only: nothing reads the device) --------
    def total_entries_per_head(self) -> int:
        if not self.is_initialized:
            return 0
        return self.n_full + sum(s.rows.n for s in self._stores.values())

    def visual_by_tier(self) -> dict[int, int]:
        """Visual entries per head in each tier present (host ints, no device read): full precision from
        `visual_entries`, packed tiers from their row counts (only visual tokens are ever quantized)."""
        counts = {TIER_FULL: self.visual_entries}
        counts.update({tier: s.rows.n for tier, s in sorted(self._stores.items()) if s.rows.n})
        return counts

    def all_token_index(self) -> torch.Tensor:
        """(b, h, n) token indices of every entry, quantized ones first."""
        if not self.is_initialized:
            return torch.zeros((1, 1, 0), dtype=torch.int32)
        return torch.cat([s.token_index for s in self.quant.values()] + [self.token_index], dim=-1)

    def _entry_bytes(self) -> int:
        """Bytes of one full-precision entry (K + V, all heads)."""
        if not self._rows.buffers:
            return 0
        k, v = self._rows.buffers[:2]
        return (k.nbytes + v.nbytes) // max(k.shape[2], 1)

    def kv_bytes(self) -> int:
        if not self.is_initialized:
            return 0
        # packed K/V: data, scale, zero of keys and values (the token index is bookkeeping)
        return self.n_full * self._entry_bytes() + sum(s.rows.held_bytes(6) for s in self._stores.values())

    def allocated_bytes(self) -> int:
        """K/V bytes of the buffers allocated (free capacity included; no token index)."""
        if not self.is_initialized:
            return 0
        kv = sum(b.nbytes for b in self._rows.buffers[:2])
        packed = sum(sum(b.nbytes for b in s.rows.buffers[:6]) for s in self._stores.values())
        return kv + packed

    def index_bytes(self) -> int:
        if not self.is_initialized:
            return 0
        return self.token_index.nbytes + sum(s.token_index.nbytes for s in self.quant.values())

    def tier_counts(self) -> dict[int, int]:
        """Entries per tier summed over heads (batch 0)."""
        if not self.is_initialized:
            return {}
        heads = self._rows.buffers[0].shape[1] if self._rows.buffers else 0
        counts = {TIER_FULL: self.n_full * heads}
        for tier, store in self._stores.items():
            if store.rows.n:
                counts[tier] = store.rows.n * store.rows.buffers[0].shape[1]
        return counts

    # -- transformers' other layer methods: refused, as the cache-level ones (see `CompressibleCache`) ----------
    def offload(self) -> None:
        raise NotImplementedError(NO_OFFLOAD)

    def prefetch(self) -> None:
        raise NotImplementedError(NO_OFFLOAD)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        _one_sequence(beam_idx.numel(), "reorder_cache (beam search)")

    def crop(self, tokens_to_remove: int) -> None:
        self.truncate(self.total_entries_per_head() - tokens_to_remove)


def split_tiers(tiers: torch.Tensor | None) -> dict[int, torch.Tensor] | None:
    """{tier: positions} of a block's (q,) host tier codes, or None when all are full precision.

    Computed on the host once per block, so no layer looks at tier codes on the device.
    """
    if tiers is None:
        return None
    tiers = tiers.cpu()
    present = {int(t): (tiers == t).nonzero().flatten() for t in (TIER_FULL, TIER_INT8, TIER_INT4)}
    present = {t: sel for t, sel in present.items() if sel.numel()}
    return None if set(present) <= {TIER_FULL} else present


_NO_STEP = layer_step.Step()  # outside the engine's layer calls: new entries follow the held ones, full precision


class CompressibleCache(Cache):
    """A transformers `Cache` made of `CompressibleLayer`s.

    transformers' attention modules call `update(key, value, layer_idx)` only: the new entries' indices, tiers
    and visual count come from the layer call's step (`visualkv.attention.step`; none outside the engine: the
    entries follow the held ones at full precision). See the module docstring for `peak_kv_bytes` and
    `peak_device_bytes`.
    """

    def __init__(self, num_layers: int, headroom: int = 0, query_group: int = 1) -> None:
        """headroom: entries to allocate beyond the prefill (e.g. the answer's tokens), so decoding appends
        in place without growing a buffer. query_group: the model's query heads per KV head (sizes the
        transient of attention over packed tiers, `packed_attention.working_bytes`)."""
        super().__init__(layers=[CompressibleLayer() for _ in range(num_layers)])
        self.headroom = headroom
        for layer in self.layers:
            layer.headroom, layer.query_group = headroom, query_group
        self.static = None  # a `StaticDecoder` while it decodes: it routes `update` to `write_slot`
        self.peak_kv_bytes = 0
        self.peak_allocated_bytes = 0
        self.peak_device_bytes = 0
        self._layer_bytes = [0] * num_layers
        self._layer_alloc = [0] * num_layers

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[layer_idx]
        if self.static is not None:  # fixed-shape decoding: no host bookkeeping per step (see static_decode)
            return self.static.update(layer, layer_idx, key_states, value_states)
        step = layer_step.current() or _NO_STEP
        out = layer.update(key_states, value_states, step.token_index, step.tiers)
        layer.visual_entries += step.n_visual
        self.refresh_bytes(layer_idx, layer.working_bytes)
        return out

    def set_capacity_hint(self, entries: int | list[int] | None) -> None:
        """Entries each layer will hold at most (eviction methods know it), the same for all or one per layer:
        buffers are allocated once."""
        per_layer = entries if isinstance(entries, list) else [entries] * len(self.layers)
        for layer, n in zip(self.layers, per_layer):
            layer.capacity_hint = n + self.headroom if n is not None else None

    def reserve(self, extra: int) -> None:
        """Room for `extra` more entries in every layer (e.g. a whole answer before decoding)."""
        for i, layer in enumerate(self.layers):
            layer.reserve(extra)
            self.refresh_bytes(i, layer.working_bytes)

    def truncate(self, lengths: int | list[int]) -> None:
        """Keep the first `lengths[i]` entries per head of layer i (an int: of every layer), dropping the newest
        (see `CompressibleLayer.truncate`); `entries_per_layer()` taken earlier gives the lengths to go back to."""
        if isinstance(lengths, int):
            lengths = [lengths] * len(self.layers)
        if len(lengths) != len(self.layers):
            raise ValueError(f"{len(lengths)} lengths for {len(self.layers)} layers")
        for i, (layer, length) in enumerate(zip(self.layers, lengths)):
            layer.truncate(length)
            self.refresh_bytes(i)

    def refresh_bytes(self, layer_idx: int, working: int = 0) -> None:
        """Re-count one layer's bytes (after append or eviction) and track the peaks.

        working: transient bytes that existed on top of the buffers during the operation just done.
        """
        layer = self.layers[layer_idx]
        self._layer_bytes[layer_idx] = layer.kv_bytes()
        self._layer_alloc[layer_idx] = layer.allocated_bytes()
        self.peak_kv_bytes = max(self.peak_kv_bytes, sum(self._layer_bytes))
        self.peak_allocated_bytes = max(self.peak_allocated_bytes, sum(self._layer_alloc))
        self.note_working(working)

    def note_working(self, nbytes: int) -> None:
        """Record transient working memory that exists on top of the allocated buffers right now."""
        self.peak_device_bytes = max(self.peak_device_bytes, sum(self._layer_alloc) + nbytes)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].get_seq_length()

    def kv_bytes(self) -> int:
        return sum(layer.kv_bytes() for layer in self.layers)

    def allocated_bytes(self) -> int:
        return sum(layer.allocated_bytes() for layer in self.layers)

    def index_bytes(self) -> int:
        return sum(layer.index_bytes() for layer in self.layers)

    def entries_per_layer(self) -> list[int]:
        """Entries per KV head in each layer (all heads hold the same count)."""
        return [layer.total_entries_per_head() for layer in self.layers]

    # -- the rest of transformers' Cache API: what works on a compressible cache, and why the rest is refused ----
    def offload(self, layer_idx: int, only_non_sliding: bool = True) -> None:
        raise NotImplementedError(NO_OFFLOAD)

    def prefetch(self, layer_idx: int, only_non_sliding: bool = True) -> None:
        raise NotImplementedError(NO_OFFLOAD)

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the newest `tokens_to_remove` entries of every layer (they are full precision: see `truncate`)."""
        self.truncate([n - tokens_to_remove for n in self.entries_per_layer()])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """The one sequence held is its own order; several beams are refused."""
        _one_sequence(beam_idx.numel(), "reorder_cache (beam search)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        _one_sequence(repeats, "batch_repeat_interleave")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        _one_sequence(indices.numel(), "batch_select_indices")

    def early_initialization(self, *args, **kwargs) -> None:
        raise NotImplementedError(
            "a VisualKV cache sizes its buffers at its first update (the prompt and the method's capacity hint); "
            "early_initialization has nothing to allocate"
        )

    def has_previous_state(self, *args, **kwargs) -> bool:
        raise NotImplementedError(NO_LINEAR)

    def get_conv_state(self, *args, **kwargs) -> torch.Tensor | None:
        raise NotImplementedError(NO_LINEAR)

    def update_conv_state(self, *args, **kwargs) -> torch.Tensor:
        raise NotImplementedError(NO_LINEAR)

    def get_recurrent_state(self, *args, **kwargs) -> torch.Tensor | None:
        raise NotImplementedError(NO_LINEAR)

    def update_recurrent_state(self, *args, **kwargs) -> torch.Tensor:
        raise NotImplementedError(NO_LINEAR)

    def update_indexer(self, *args, **kwargs) -> torch.Tensor:
        raise NotImplementedError(NO_LINEAR)


NO_OFFLOAD = (
    "a VisualKV cache stays on its layers' devices: its buffers are preallocated and written in place, and its "
    "byte counts and the memory guard assume they stay there"
)
NO_LINEAR = "a VisualKV cache holds attention layers only: it has no linear-attention or indexer state"


def _one_sequence(rows: int, what: str) -> None:
    """Accept a batch operation on the one sequence a VisualKV cache holds (a no-op); refuse several rows."""
    if rows != 1:
        raise NotImplementedError(f"{what}: a VisualKV cache holds one sequence, not {rows} rows")
