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
from visualkv.layout import Block, plan_blocks
from visualkv.media import Media
from visualkv.methods import METHODS, capacity_bound, make_method, method_traits
from visualkv.runtime.engine import attention_working_bytes, needs_mask


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


def _cfg(obj, *names, default=None):
    """The first of `names` the config has; a per-axis pair (InternVL's patch_size [14, 14]) gives its first."""
    for name in names:
        value = getattr(obj, name, None)
        if isinstance(value, list | tuple) and value:
            value = value[0]
        if value is not None:
            return value
    return default


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
    `visualkv.methods.method_traits(name)` for any name, composed too).
    vision_ahead: blocks per vision-tower call (the engine's), where the adapter encodes ahead.
    headroom: entries the cache allocates beyond the prefill (`SessionConfig.cache_headroom`).
    method_options: the method's options (`SessionConfig.method_options`: Sali-Cache's tiers size its stores)."""
    itemsize = torch.empty((), dtype=adapter.dtype).element_size()
    kv_heads, head_dim = adapter.num_kv_heads, adapter.head_dim
    entry_bytes = 2 * kv_heads * head_dim * itemsize  # K and V of one token at one layer
    block_size = block_size or adapter.default_block_size
    mode = prefill_mode or method_cls.default_prefill
    visual = prepared.visual_mask & prepared.keep
    blocks = plan_blocks(
        prepared.seq_len, prepared.layout.units, mode, block_size, budget, question_apart=method_cls.question_apart
    )
    bound = capacity_bound(method_cls, budget, blocks, prepared)
    hint = bound + headroom if bound is not None else None  # as `CompressibleCache.set_capacity_hint`

    def new_stores() -> list[_Store]:  # one layer's buffers, as the cache sizes them
        return _layer_stores(adapter, prepared, method_cls, method_options, entry_bytes, hint, headroom)

    text = adapter.text_config
    hidden = _cfg(text, "hidden_size")
    heads = _cfg(text, "num_attention_heads")
    inter = _cfg(text, "intermediate_size", default=4 * hidden)
    # one decoder layer's transients: the residual stream (in, out) plus the larger of its two phases, which
    # never coexist: attention (per token of the block: normed input; q, k, v; rotated q, k; attention output;
    # o_proj; over every key: the mask, any K/V repeated to every query head, as `attention_working_bytes`)
    # or the MLP (per token: normed input; gate activation, up, their product)
    residual = 2 * hidden * itemsize
    attention = (
        2 * hidden + (heads + 2 * kv_heads) * head_dim + (heads + kv_heads) * head_dim + heads * head_dim
    ) * itemsize
    mlp = (hidden + 3 * inter) * itemsize
    vision = _VisionDims.of(adapter)

    walk = _CacheWalk(adapter, _kept_by_layer(adapter, prepared, method_cls, method_options), new_stores)
    evicts = method_cls.evicts_per_block and budget is not None
    kv_peak = alloc_peak = act_peak = vision_peak = peak = 0
    ahead = vision_ahead if adapter.encodes_ahead(prepared) else 1
    call_patches = [adapter.vision_call_patches(prepared, [b.units]) if b.units else 0 for b in blocks]
    patches_per_token = adapter.patches_per_token  # a call's output: its patches packed into tokens

    def tower_bytes(groups: list) -> int:  # the vision tower on `groups` (one block's units, or several blocks')
        patches = adapter.vision_call_patches(prepared, groups)
        prep_copies = adapter.vision_prep_copies_for(prepared, patches)
        return vision.bytes(patches, adapter.vision_output_tokens(prepared, groups), itemsize, prep_copies)

    ahead_until = 0
    for i, block in enumerate(blocks):
        stop_point()  # a running prefill's Stop (`stop_scope`): sizing an hour of video is many blocks
        q = int(prepared.keep[block.start : block.end].sum())
        q_vis = int(visual[block.start : block.end].sum())
        kv = walk.block(block, q, q_vis, budget if evicts and block.units else None)
        embeddings = 2 * q * hidden * itemsize  # the block's embeddings and the vision output folded in
        if ahead > 1 and i >= ahead_until and block.units:  # one tower call for this block and the next ones
            ahead_until = i + ahead
            units = [b.units for b in blocks[i:ahead_until] if b.units]
            vision_b = tower_bytes(units)
        else:
            vision_b = tower_bytes([block.units]) if ahead == 1 and block.units else 0
        # embeddings encoded ahead wait for their blocks: at most the rest of the call's output
        embeddings += sum(call_patches[i + 1 : ahead_until]) // patches_per_token * hidden * itemsize
        act_b = q * residual + max(q * attention + kv.attention_bytes, q * mlp)
        kv_peak, alloc_peak = max(kv_peak, kv.entries), max(alloc_peak, kv.allocated)
        act_peak, vision_peak = max(act_peak, act_b), max(vision_peak, vision_b)
        peak = max(peak, kv.allocated_before + vision_b + embeddings, kv.allocated + kv.growing + act_b + embeddings)
    kv_peak = max(kv_peak, walk.entries_with_answer(headroom))
    # the method's own pass before the first block (Sali-Cache's motion pass), with nothing of the cache yet
    peak = max(peak, make_method(method_cls.name, **(method_options or {})).begin_bytes(prepared))
    media_bytes = _media_bytes(prepared, blocks)
    return MemoryEstimate(
        kv_peak * entry_bytes,
        alloc_peak,
        act_peak,
        vision_peak,
        media_bytes,
        peak,
        kv_peak,
    )


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
    """The cache's entries and buffers walked over the planned blocks, per group of layers that store alike (one
    group unless the method merges between layers); its `_Store`s are sized as `visualkv.kv.cache` sizes them."""

    def __init__(
        self,
        adapter,
        kept_by_layer: Callable[[Block, int], list[tuple[int, int]]],
        new_stores: Callable[[], list[_Store]],
    ) -> None:
        self.adapter = adapter
        self.kept_by_layer = kept_by_layer
        self.new_stores = new_stores
        self.groups: list[_GroupState] = []

    def block(self, block: Block, q: int, q_vis: int, budget: int | None) -> _BlockKV:
        """Walk one block of `q` kept tokens (`q_vis` visual); `budget`: each layer evicts to it after the block."""
        adapter = self.adapter
        kept_by_group = self.kept_by_layer(block, q_vis)
        if not self.groups:
            self.groups = [_GroupState(n, self.new_stores()) for n, _ in kept_by_group]
        rise = block_peak = attention_bytes = 0  # rise: entries the earlier groups added (their layers done)
        entries = sum(g.layers * g.held for g in self.groups)  # the cache when the block starts
        for g, (_, kept) in zip(self.groups, kept_by_group):
            q_g = q - q_vis + kept  # what this group's layers store of the block
            vis_after = min(g.vis_held + kept, budget) if budget is not None else g.vis_held + kept
            after = g.held + (q - q_vis) + (vis_after - g.vis_held)
            # the block at this group's last layer: the group's other layers already evicted to `after`
            block_peak = max(block_peak, rise + (g.layers - 1) * (after - g.held) + q_g)
            rise += g.layers * (after - g.held)
            causal_flag = not needs_mask(q_g, g.held, implementation(adapter))  # as the engine's layer loop
            working = attention_working_bytes(adapter, q_g, g.held + q_g, causal_flag, adapter.dtype)
            attention_bytes = max(attention_bytes, working)
            g.q, g.after, g.vis_after = q_g, after, vis_after
        # the buffers before and during the block (a block that does not fit grows every layer in turn, the
        # layer being grown holding its old buffers and the new ones)
        allocated_before = sum(g.allocated() for g in self.groups)
        growing = 0
        for g in self.groups:
            before = [store.capacity for store in g.stores]
            if q:  # (a block with nothing kept never reaches the cache)
                for store in g.stores:
                    store.hold(g.held + g.q)
            old = sum(b * st.entry_bytes for b, st in zip(before, g.stores) if 0 < b < st.capacity)
            growing = max(growing, old)
            g.held, g.vis_held = g.after, g.vis_after
        allocated = sum(g.allocated() for g in self.groups)
        return _BlockKV(entries + block_peak, allocated_before, allocated, growing, attention_bytes)

    def entries_with_answer(self, headroom: int) -> int:
        """Entries held once the answer is decoded: at most `headroom` more in every layer."""
        return sum(g.layers * (g.held + headroom) for g in self.groups)


@dataclass
class _GroupState:
    """Consecutive decoder layers that store alike, while the guard walks the blocks: how many, and per layer the
    entries held before the block (per KV head), how many of them are visual, after the block, and its buffers."""

    layers: int
    stores: list[_Store]
    held: int = 0
    vis_held: int = 0
    q: int = 0  # of the block being walked: what a layer stores of it, then what it holds after it
    after: int = 0
    vis_after: int = 0

    def allocated(self) -> int:
        return self.layers * sum(store.capacity * store.entry_bytes for store in self.stores)


def _kept_by_layer(adapter, prepared, method_cls, method_options) -> Callable[[Block, int], list[tuple[int, int]]]:
    """(block, its kept visual tokens) -> per group of layers, (layers, visual tokens each stores of the block):
    one group of every layer storing all of them, unless the method merges between layers
    (`Method.visual_kept_by_layer`, LightKV)."""
    if not method_cls.merges_between_layers:
        return lambda block, q_vis: [(adapter.num_layers, q_vis)]
    method = make_method(method_cls.name, **(method_options or {}))
    visual_id = prepared.layout.visual_id_of_seq(prepared.seq_len)
    kept_visual = (prepared.visual_mask & prepared.keep).numpy()

    def kept(block: Block, q_vis: int) -> list[tuple[int, int]]:
        local = np.arange(block.start, block.end)
        return method.visual_kept_by_layer(adapter, prepared, visual_id[local[kept_visual[block.start : block.end]]])

    return kept


@dataclass
class _Store:
    """One group of a cache layer's buffers as `visualkv.kv.cache` sizes them: `entry_bytes` per entry, at most
    `limit` entries ever stored there (None: any), `hint` entries allocated up front (None: exactly what the first
    block stores + `headroom`, then grown by `grown_capacity`)."""

    entry_bytes: int
    limit: int | None = None
    hint: int | None = None
    headroom: int = 0
    capacity: int = 0

    def hold(self, entries: int) -> None:
        """Room for the layer's `entries` (or for this store's share of them, at most `limit`)."""
        n = entries if self.limit is None else min(entries, self.limit)
        if self.limit is not None and n and (self.hint is None or n > self.hint):
            # which block brings how many of a share is not known: whatever the order, the last growth stopped
            # below n, so the capacity is at most one growth past n
            self.capacity = max(self.capacity, grown_capacity(n + 1, n, None) + self.headroom)
            return
        if self.capacity == 0 and n:
            self.capacity = grown_capacity(n + self.headroom, 0, self.hint)
        if n > self.capacity:
            self.capacity = grown_capacity(n, self.capacity, self.hint)


def _layer_stores(adapter, prepared, method_cls, method_options, entry_bytes, hint, headroom) -> list[_Store]:
    """A layer's full-precision buffers, plus Sali-Cache's packed INT8 and INT4 stores (`Method.stores_packed`),
    each limited to its tier's share of the visual tokens (`Method.stored_shares`; `saliency.assign_tiers` keeps
    each within one token of its fraction), at the method's quantization group size."""
    if not method_cls.stores_packed:
        return [_Store(entry_bytes, None, hint, headroom)]
    method = make_method(method_cls.name, **(method_options or {}))
    shares = method.stored_shares or (1.0, 1.0, 1.0)
    n_visual = int(prepared.visual_mask.sum())
    limits = [math.ceil(share * n_visual) + 1 if share > 0 else 0 for share in shares]
    group = getattr(getattr(method, "config", None), "group_size", None) or QuantSpec(8).group_size
    kv_heads, head_dim = adapter.num_kv_heads, adapter.head_dim
    packed = [
        2 * kv_heads * packed_bytes_per_token(head_dim, QuantSpec(bits, group).resolved(head_dim), adapter.dtype)
        for bits in (8, 4)
    ]
    full = _Store(entry_bytes, prepared.seq_len - n_visual + limits[0], hint, headroom)
    return [full, *(_Store(b, limit) for b, limit in zip(packed, limits[1:]))]


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
    input_copies: float  # float32 copies of a call's pixel input while the tower runs (`vision_input_copies`)

    @classmethod
    def of(cls, adapter) -> _VisionDims:
        config = adapter.model.config
        vision = _cfg(config, "vision_config")
        if vision is None:
            return cls(0, 0, 0, 0, 0.0)
        patch = _cfg(vision, "patch_size", default=14)
        values = (
            _cfg(vision, "in_channels", "num_channels", default=3)
            * _cfg(vision, "temporal_patch_size", default=1)
            * patch
            * patch
        )
        v_hidden = _cfg(vision, "hidden_size", "embed_dim")
        return cls(
            values,
            v_hidden,
            _cfg(vision, "intermediate_size", default=4 * v_hidden),
            _cfg(adapter.text_config, "hidden_size"),
            adapter.vision_input_copies,
        )

    def bytes(self, patches: int, tokens: int, itemsize: int, prep_copies: float) -> int:
        """The larger of a call's two phases, over its `patches` (all it encodes, before any is sliced away:
        Qwen's whole-window strips, LLaVA-OneVision's whole tiles): the preparation of its pixel inputs (float32,
        as processors make them, `prep_copies` of them at once: `ModelAdapter.vision_prep_copies_for`), or the
        inputs it holds + one vision layer's activations; + its `tokens` of output."""
        pixels = patches * self.patch_values * 4
        tower = pixels * self.input_copies + patches * (6 * self.hidden + 3 * self.inter) * itemsize
        return int(max(pixels * prep_copies, tower)) + tokens * self.out_hidden * itemsize


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
        method_cls = method_traits(config.method)
        est = estimate_prefill(
            adapter,
            prepared,
            method_cls,
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
