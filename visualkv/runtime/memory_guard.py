"""Estimate a turn's peak memory before its prefill, refuse what cannot fit, survive an OOM.

A shared instance must not be killed mid-turn by one user's `full` prefill of a long video. `MemoryGuard.check`
walks the planned blocks and estimates the peak of what coexists (the cache's buffers and entries, one decoder
layer's activations, the vision tower on a block, the method's pass before the first block), compares it with
the free memory of the cache's device and raises `MemoryGuardError` with one line naming a method that fits.
`out_of_memory_caught(session)` turns an OOM that happens anyway into one line and rolls the session back.
What each term counts: docs/ARCHITECTURE.md#memory-guard.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import psutil
import torch

from visualkv.attention import implementation
from visualkv.errors import VisualKVError, stop_point
from visualkv.kv.cache import grown_capacity
from visualkv.kv.quant import QuantSpec, packed_bytes_per_token
from visualkv.media import Media
from visualkv.methods import METHODS, capacity_bound, layer_budget_bound, make_method, method_traits
from visualkv.runtime.plan import (
    CacheDryRun,
    LayerTransients,
    attention_working_bytes,
    config_value,
    needs_mask,
    plan_prefill,
)


class MemoryGuardError(VisualKVError):
    """A turn would not fit in memory (or ran out of it); the chat and the model are kept."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a turn needs above the weights (see the module doc).

    kv_bytes: the high-water mark of the entries held (the cache's `peak_kv_bytes`), the answer's included.
    kv_allocated_bytes: of its buffers, free capacity included (its `peak_allocated_bytes`). activation_bytes / vision_bytes: the
    largest transient of the LLM layers / the vision tower over one block. peak_bytes: the largest sum of
    what coexists, over the blocks: the cache's buffers before the block + the vision tower on it, or its
    buffers during it (a layer being grown counted twice) + its LLM layer.
    """

    kv_bytes: int
    kv_allocated_bytes: int
    activation_bytes: int
    vision_bytes: int
    media_bytes: int
    peak_bytes: int
    peak_entries: int  # KV entries per KV head, summed over layers, at the cache's peak

    @property
    def to_allocate(self) -> int:
        """What the prefill still has to allocate (the decoded media are already held)."""
        return self.peak_bytes

    def summary(self) -> dict[str, int]:
        """What the prefill was to allocate above the weights, and its parts (the session report's `memory_estimate`)."""
        return {
            "to_allocate_bytes": self.to_allocate,
            "kv_bytes": self.kv_bytes,
            "kv_allocated_bytes": self.kv_allocated_bytes,
            "activation_bytes": self.activation_bytes,
            "vision_bytes": self.vision_bytes,
            "media_bytes": self.media_bytes,
        }


def format_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def estimate_prefill(
    adapter,
    prepared,
    method_cls,
    budget: int | None,
    block_size: int | None,
    prefill_mode: str | None,
    vision_ahead: int = 1,
    headroom: int = 0,
    method_options: dict | None = None,
) -> MemoryEstimate:
    """The estimate for prefilling `prepared` with `method_cls` (a class of visualkv.methods.METHODS, or
    `visualkv.methods.method_traits(name)` for any name, composed too), over the engine's own plan
    (`plan_prefill`) and the cache's own sizing (`CacheDryRun`).
    vision_ahead: blocks per vision-tower call (the engine's), where the adapter encodes ahead.
    headroom: entries the cache allocates beyond the prefill (`SessionConfig.cache_headroom`).
    method_options: the method's options (`SessionConfig.method_options`: Sali-Cache's tiers size its stores)."""
    itemsize = torch.empty((), dtype=adapter.dtype).element_size()
    entry_bytes = 2 * adapter.num_kv_heads * adapter.head_dim * itemsize  # K and V of one token at one layer
    visual = prepared.visual_mask & prepared.keep
    ahead = vision_ahead if adapter.encodes_ahead(prepared) else 1
    plan = plan_prefill(adapter, prepared, method_cls, budget, block_size, prefill_mode, ahead)
    blocks = plan.blocks
    bound = capacity_bound(method_cls, budget, blocks, prepared)
    method = make_method(method_cls.name, **(method_options or {}))
    walk = _CacheWalk(adapter, bound, headroom, _packed_stores(adapter, prepared, method, entry_bytes, bound, headroom))
    visual_id = prepared.layout.visual_id_of_seq(prepared.seq_len)
    layer = LayerTransients.of(adapter, itemsize)
    vision = _VisionDims.of(adapter)
    evicts = method_cls.evicts_per_block and budget is not None
    kv_peak = act_peak = vision_peak = peak = 0
    call_patches = [adapter.vision_call_patches(prepared, [b.units]) if b.units else 0 for b in blocks]

    def tower_bytes(groups: list) -> int:  # the vision tower on `groups` (one block's units, or several blocks')
        patches = adapter.vision_call_patches(prepared, groups)
        return vision.bytes(
            patches,
            adapter.vision_output_tokens(prepared, groups),
            itemsize,
            adapter.vision_prep_copies_for(prepared, patches),
            adapter.vision_input_copies_for(prepared, groups),
            adapter.vision_cut_tokens(prepared, groups),
        )

    calls, call = plan.tower_calls(), range(0)
    for i, block in enumerate(blocks):
        stop_point()  # a running prefill's Stop (`stop_scope`): sizing an hour of video is many blocks
        q = int(prepared.keep[block.start : block.end].sum())
        ids = visual_id[np.flatnonzero(visual[block.start : block.end].numpy()) + block.start]  # its visual tokens
        kept = method.visual_kept_by_layer(adapter, prepared, ids)  # one group of layers, unless it merges (LightKV)
        kv = walk.block(q, len(ids), kept, layer_budget_bound(method_cls, budget) if evicts and block.units else None)
        if i in calls:  # one tower call for this block and the next ones
            call = calls[i]
            vision_b = tower_bytes([blocks[j].units for j in call if blocks[j].units])
        else:
            vision_b = tower_bytes([block.units]) if ahead == 1 and block.units else 0
        # the block's embeddings and the vision output folded in; vision features buffered for later blocks: those
        # encoded ahead, or what this block read that the next reads again (one buffer: the larger of the two)
        waiting = sum(call_patches[j] for j in call if j > i) // adapter.patches_per_token
        held = adapter.vision_held_tokens(prepared, [block.units]) if block.units else 0
        embeddings = (2 * q + max(waiting, held)) * layer.hidden * itemsize
        q -= len(ids) - max(n for _, n in kept)  # visual rows a method drops before the LLM never reach a layer
        # a decoder layer, or the method's pass after it over the block's hidden states (LightKV's merge)
        scratch = method.layer_scratch_bytes(adapter, prepared, ids, q)
        act_b = max(layer.bytes(q, kv.attention_bytes), q * layer.residual + scratch)
        kv_peak = max(kv_peak, kv.entries)
        act_peak, vision_peak = max(act_peak, act_b), max(vision_peak, vision_b)
        peak = max(peak, kv.allocated_before + vision_b + embeddings, kv.allocated + kv.growing + act_b + embeddings)
    kv_peak = max(kv_peak, walk.entries_with_answer(headroom))
    # the method's own pass before the first block (Sali-Cache's motion pass), with nothing of the cache yet
    peak = max(peak, method.begin_bytes(prepared))
    media_bytes = _media_bytes(prepared, blocks)
    return MemoryEstimate(kv_peak * entry_bytes, walk.allocated_peak, act_peak, vision_peak, media_bytes, peak, kv_peak)


@dataclass(frozen=True)
class _BlockKV:
    """The cache while one block passes: entries held at the peak (per KV head, summed over layers), its buffers
    before and after the block, the old buffers of a layer being grown, and the largest attention transient."""

    entries: int
    allocated_before: int
    allocated: int
    growing: int
    attention_bytes: int


class _CacheWalk:
    """The cache over the planned blocks, per group of layers that store alike (one group unless the method
    merges between layers), each group's layers dry-run as one (`CacheDryRun`: the cache's own sizing). The
    engine runs the layers in order, so while a block passes layer l the layers below it have evicted and
    those above still hold their previous entries. A method storing packed tiers has its buffers bounded by
    `_Store`s instead (which tier gets how many tokens is data-dependent)."""

    def __init__(self, adapter, bound: int | None, headroom: int, packed) -> None:
        self.adapter, self.packed = adapter, packed
        self.bound = bound
        self.headroom = headroom
        self.groups: list[tuple[int, CacheDryRun, list[_Store]]] = []
        self.allocated_peak = 0

    def block(self, q: int, q_vis: int, kept_by_group: list[tuple[int, int]], budget: int | None) -> _BlockKV:
        """Walk one block of `q` kept tokens (`q_vis` visual), of which each group of layers stores `kept_by_group`
        (`Method.visual_kept_by_layer`); `budget`: each layer evicts to it after the block."""
        adapter, impl = self.adapter, implementation(self.adapter)
        if not self.groups:
            self.groups = [
                (n, CacheDryRun(adapter, self.bound, self.headroom), self.packed()) for n, _ in kept_by_group
            ]
        rise = block_peak = attention_bytes = growing = before = after = 0
        entries = sum(n * run.layer.get_seq_length() for n, run, _ in self.groups)  # when the block starts
        for (n, run, stores), (_, kept) in zip(self.groups, kept_by_group):
            q_g = q - q_vis + kept  # what this group's layers store of the block
            s = run.store(q_g, kept, budget)
            # the block at this group's last layer: the group's other layers already evicted
            block_peak = max(block_peak, rise + (n - 1) * (s.after - s.held) + s.stored - s.held)
            rise += n * (s.after - s.held)
            causal_flag = not needs_mask(q_g, s.held, impl)  # as the engine's layer loop
            working = attention_working_bytes(adapter, q_g, s.held + q_g, causal_flag, adapter.dtype)
            attention_bytes = max(attention_bytes, working)
            alloc = _bounded(stores, s.stored if q else 0) if stores else (s.allocated_before, s.allocated, s.growing)
            before, after, growing = before + n * alloc[0], after + n * alloc[1], max(growing, alloc[2])
        self.allocated_peak = max(self.allocated_peak, after)
        return _BlockKV(entries + block_peak, before, after, growing, attention_bytes)

    def entries_with_answer(self, headroom: int) -> int:
        """Entries held once the answer is decoded: at most `headroom` more in every layer."""
        return sum(n * (run.layer.get_seq_length() + headroom) for n, run, _ in self.groups)


@dataclass
class _Store:
    """One of a packed-tier method's buffers, bounded: `entry_bytes` per entry, at most `limit` entries ever
    stored there, `hint` entries allocated up front (None: exactly what the first block stores + `headroom`,
    then grown by `grown_capacity`)."""

    entry_bytes: int
    limit: int
    hint: int | None = None
    headroom: int = 0
    capacity: int = 0

    def hold(self, entries: int) -> None:
        """Room for this store's share of the layer's `entries` (at most `limit`)."""
        n = min(entries, self.limit)
        if n and (self.hint is None or n > self.hint):
            # which block brings how many of a share is not known: whatever the order, the last growth stopped
            # below n, so the capacity is at most one growth past n
            self.capacity = max(self.capacity, grown_capacity(n + 1, n, None) + self.headroom)
            return
        if self.capacity == 0 and n:
            self.capacity = grown_capacity(n + self.headroom, 0, self.hint)


def _bounded(stores: list[_Store], entries: int) -> tuple[int, int, int]:
    """A packed-tier layer's buffers before and after holding `entries`, and the old bytes of those grown."""
    before = [store.capacity * store.entry_bytes for store in stores]
    for store in stores:
        store.hold(entries)
    after = [store.capacity * store.entry_bytes for store in stores]
    return sum(before), sum(after), sum(b for b, a in zip(before, after) if 0 < b < a)


def _packed_stores(adapter, prepared, method, entry_bytes, bound, headroom):
    """() -> a layer's buffers for a method storing packed INT8 and INT4 tiers (Sali-Cache): the full-precision
    one plus a packed one per tier, each limited to its tier's share of the visual tokens (`Method.stored_shares`;
    `saliency.assign_tiers` keeps each within one token of its fraction), at the method's quantization group
    size. () -> [] for any other method."""
    shares = method.stored_shares
    if shares is None:
        return list
    n_visual = int(prepared.visual_mask.sum())
    limits = [math.ceil(share * n_visual) + 1 if share > 0 else 0 for share in shares]
    group = getattr(getattr(method, "config", None), "group_size", None) or QuantSpec(8).group_size
    kv_heads, head_dim = adapter.num_kv_heads, adapter.head_dim
    packed = [
        2 * kv_heads * packed_bytes_per_token(head_dim, QuantSpec(bits, group).resolved(head_dim), adapter.dtype)
        for bits in (8, 4)
    ]
    hint = bound + headroom if bound is not None else None
    full = prepared.seq_len - n_visual + limits[0]
    return lambda: [_Store(entry_bytes, full, hint, headroom), *(_Store(b, n) for b, n in zip(packed, limits[1:]))]


def _media_bytes(prepared, blocks) -> int:
    """Decoded frames held at the peak, from metadata (nothing is decoded): an eager Media holds every
    frame; a lazy video its small cache plus one block's frames, twice (the list and the processor's
    stacked copy), at the size the vision side reads them (resized at decode: see
    `ModelAdapter.video_for_encoding`; then plus the one full-size frame being resized)."""
    media = prepared.media
    if media is None:
        return 0
    if not media.is_lazy:
        return media.resident_frame_bytes
    frames = prepared.layout.frames
    per_block = max(
        (len({s for u in b.units if u.frame < len(frames) for s in frames[u.frame].source_frames}) for b in blocks),
        default=0,
    )
    read = prepared.vision_inputs.get("video")
    if isinstance(read, Media) and read.is_lazy and read.frames.is_resized:
        return (read.frames.cache_size + 2 * per_block) * read.frame_bytes + media.frame_bytes
    return (media.frames.cache_size + 2 * per_block) * media.frame_bytes


@dataclass(frozen=True)
class _VisionDims:
    """What the vision tower's memory depends on, read from the model's config."""

    patch_values: int  # input values per patch: channels x temporal x patch x patch
    hidden: int
    inter: int
    out_hidden: int

    @classmethod
    def of(cls, adapter) -> _VisionDims:
        config = adapter.model.config
        vision = config_value(config, "vision_config")
        if vision is None:
            return cls(0, 0, 0, 0)
        patch = config_value(vision, "patch_size", default=14)
        channels = config_value(vision, "in_channels", "num_channels", default=3)
        values = channels * config_value(vision, "temporal_patch_size", default=1) * patch * patch
        v_hidden = config_value(vision, "hidden_size", "embed_dim")
        return cls(
            values,
            v_hidden,
            config_value(vision, "intermediate_size", default=4 * v_hidden),
            config_value(adapter.text_config, "hidden_size"),
        )

    def bytes(
        self, patches: int, tokens: int, itemsize: int, prep_copies: float, input_copies: float, cut_tokens: int = 0
    ) -> int:
        """The largest of a call's phases, over its `patches` (all it encodes, before any is sliced away: Qwen's
        whole-window strips, LLaVA-OneVision's whole tiles): the preparation of its pixel inputs (float32, as
        processors make them, `prep_copies` of them at once: `ModelAdapter.vision_prep_copies_for`), or the
        `input_copies` of them it holds (`ModelAdapter.vision_input_copies_for`) + one vision layer's
        activations, either + its `tokens` of output; or, the tower done, its `cut_tokens` of features while the
        block's tokens are cut from them (`ModelAdapter.vision_cut_tokens`)."""
        pixels = patches * self.patch_values * 4
        tower = pixels * input_copies + patches * (6 * self.hidden + 3 * self.inter) * itemsize
        out = self.out_hidden * itemsize
        return int(max(max(pixels * prep_copies, tower) + tokens * out, cut_tokens * out))


def free_memory_bytes(device) -> int | None:
    """Free memory where the cache will live: CUDA free + allocator-cached, or host available.

    None when the device cannot say (a CUDA runtime without a usable driver): the guard then does not
    refuse, and a real out-of-memory is still caught by the turn.
    """
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        try:
            free, _total = torch.cuda.mem_get_info(device)
            reusable = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        except RuntimeError:
            return None
        return int(free + reusable)
    return int(psutil.virtual_memory().available)


class MemoryGuard:
    """Refuses a prefill whose estimate exceeds `headroom` × the free memory.

    free_bytes: a callable giving the free memory (default: measured on the adapter's device);
    tests inject a figure. enabled=False turns the check off (the OOM catch stays).
    """

    def __init__(self, free_bytes: Callable[[], int] | None = None, headroom: float = 0.9, enabled: bool = True):
        self.free_bytes = free_bytes
        self.headroom = headroom
        self.enabled = enabled

    def _free(self, adapter) -> int | None:
        return int(self.free_bytes()) if self.free_bytes is not None else free_memory_bytes(adapter.device)

    def check(self, adapter, prepared, config) -> MemoryEstimate:
        """Raise MemoryGuardError (one line) when the prefill of `prepared` under `config` would not fit."""
        est = estimate_prefill(
            adapter,
            prepared,
            method_traits(config.method),
            config.budget,
            config.block_size,
            config.prefill,
            config.vision_ahead,
            config.cache_headroom,
            config.method_options,
        )
        if not self.enabled:
            return est
        free = self._free(adapter)
        if free is None or est.to_allocate <= self.headroom * free:
            return est
        hint = self._suggest(adapter, prepared, config, free)
        raise MemoryGuardError(
            f"{config.method} needs ~{format_bytes(est.to_allocate)}, {format_bytes(free)} free: {hint}"
        )

    def check_evidence(self, adapter, prepared, config, queries: int, block_size: int | None) -> MemoryEstimate:
        """Raise MemoryGuardError (one line) when evidence recall's uncompressed pass would not fit: a `full`
        prefill of `prepared` block by block (`block_size`) with room for `queries` answer tokens, plus the
        attention probabilities of those queries over every key of one KV head group (see
        visualkv.runtime.evidence). The compressed cache is already held, so the free memory excludes it."""
        est = estimate_prefill(
            adapter, prepared, METHODS["full"], None, block_size, "blockwise", config.vision_ahead, queries
        )
        group = adapter.query_group
        scores = 3 * group * queries * (prepared.seq_len + queries) * 4  # logits, mask, probabilities (float32)
        est = dataclasses.replace(est, peak_bytes=est.peak_bytes + scores)
        free = self._free(adapter) if self.enabled else None
        if free is None or est.to_allocate <= self.headroom * free:
            return est
        raise MemoryGuardError(
            f"evidence recall needs ~{format_bytes(est.to_allocate)} for its uncompressed pass (the memory of "
            f"`full`), {format_bytes(free)} free: leave evidence off for this media, or use a smaller one"
        )

    def _suggest(self, adapter, prepared, config, free: int) -> str:
        """A method (with the budget it would use) whose estimate fits, else what to reduce."""
        budget = config.budget or max(1, min(1024, prepared.layout.n_visual // 10))
        for name, cls in METHODS.items():
            if name == config.method or not cls.evicts_per_block:
                continue
            for b in (budget, max(1, budget // 4)):
                est = estimate_prefill(
                    adapter, prepared, cls, b, config.block_size, None, config.vision_ahead, config.cache_headroom
                )
                if est.to_allocate <= self.headroom * free:
                    return f"try {name} with budget {b}"
        return "try fewer video frames, a smaller image, or a smaller model"


# -- out-of-memory during a turn ------------------------------------------------------------------
def is_out_of_memory(exc: BaseException) -> bool:
    """A CUDA OOM (torch.OutOfMemoryError) or a host allocation failure (MemoryError, or a RuntimeError
    from PyTorch's CPU allocator)."""
    if isinstance(exc, (MemoryError, getattr(torch, "OutOfMemoryError", MemoryError))):
        return True
    return isinstance(exc, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(exc)


def release_memory() -> None:
    """Give freed tensors back: collect cycles and empty CUDA's allocator cache."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextlib.contextmanager
def out_of_memory_caught(session) -> Iterator[None]:
    """Run a turn of `session`; on an OOM roll it back (cache of the turn freed) and raise one line."""
    snapshot = session.snapshot()
    failed = False
    try:
        yield
    except BaseException as exc:
        if not is_out_of_memory(exc):
            raise
        failed = True  # handled below, outside this block, so the traceback's tensors can be freed
    if failed:
        session.restore(snapshot)
        release_memory()
        raise MemoryGuardError(
            "out of memory during this turn: its cache was freed and the chat kept; try a smaller budget, "
            "blockwise-keydiff, or fewer video frames"
        )
