"""Estimate a turn's peak memory before its prefill, refuse what cannot fit, survive an OOM.

A shared instance must not be killed mid-turn by one user's `full` prefill of a long video
(that would take every user's chat with it). Before a prefill, `MemoryGuard.check` estimates
the turn's peak from the model's dimensions and the planned blocks, weights aside:

- **KV**: the cache's high-water mark, walked over the blocks the engine will run. A method
  that evicts per block (`Method.evicts_per_block`) holds, while block i passes layer l, the
  evicted entries of layers < l, its previous entries + block i at layer l, and its previous
  entries at layers > l; any other method keeps everything it read (salicache and lightkv
  store less than that, so for them this is an upper bound).
- **LLM activations** of the largest block: hidden states, q/k/v, the MLP's gate/up/act for
  every token of the block, plus the attention mask; SDPA's fused kernels (CPU and CUDA) never
  hold the (queries × keys) score matrix, so none is counted.
- **Vision tower** on its largest unit (a tile, a row strip, a frame): its patch inputs and one
  layer's activations over that unit's patches.
- **Decoded media**: the frames as held in memory (already resident when the check runs, so they
  are reported but not asked of the free memory).

`check` compares the part still to be allocated with the free memory of the device the cache lives
on (CUDA: `torch.cuda.mem_get_info` plus what PyTorch's allocator holds unused; CPU: psutil's
available memory) and raises `MemoryGuardError` with one line naming the estimate, the free memory
and a method that would fit. The free-memory figure is injectable (`free_bytes=`) for tests.

`out_of_memory_caught(session)` wraps a turn: a CUDA or host OOM that happens anyway becomes one
line, the turn's cache is freed, and the session is rolled back to before the turn.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import psutil
import torch

from visualkv.errors import VisualKVError
from visualkv.layout import plan_blocks
from visualkv.methods import METHODS


class MemoryGuardError(VisualKVError):
    """A turn would not fit in memory (or ran out of it); the chat and the model are kept."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a turn needs above the weights, by part (see the module doc)."""

    kv_bytes: int
    activation_bytes: int
    vision_bytes: int
    media_bytes: int
    peak_entries: int  # KV entries per KV head, summed over layers, at the peak

    @property
    def to_allocate(self) -> int:
        """What the prefill still has to allocate (the decoded media are already held)."""
        return self.kv_bytes + self.activation_bytes + self.vision_bytes

    @property
    def total_bytes(self) -> int:
        return self.to_allocate + self.media_bytes


def format_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def _cfg(obj, *names, default=None):
    for name in names:
        value = getattr(obj, name, None)
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
    seq_offset_entries: int = 0,
) -> MemoryEstimate:
    """The estimate for prefilling `prepared` with `method_cls` (a class of visualkv.methods.METHODS).

    seq_offset_entries: entries already in the cache per layer and KV head (a re-prefill replays none;
    kept for callers that extend a cache).
    """
    itemsize = torch.empty((), dtype=adapter.dtype).element_size()
    layers, kv_heads, head_dim = adapter.num_layers, adapter.num_kv_heads, adapter.head_dim
    entry_bytes = 2 * kv_heads * head_dim * itemsize  # K and V of one token at one layer
    block_size = block_size or adapter.default_block_size
    mode = prefill_mode or method_cls.default_prefill
    visual = prepared.visual_mask & prepared.keep
    blocks = plan_blocks(prepared.seq_len, prepared.layout.units, mode, block_size, budget)

    # KV: walk the blocks (entries per layer and KV head)
    held = seq_offset_entries  # entries of one layer before the block
    vis_held = 0
    peak = 0
    largest_q = 0
    for block in blocks:
        q = int(prepared.keep[block.start : block.end].sum())
        q_vis = int(visual[block.start : block.end].sum())
        largest_q = max(largest_q, q)
        if method_cls.evicts_per_block and budget is not None and block.units:
            vis_after = min(vis_held + q_vis, budget)
        else:
            vis_after = vis_held + q_vis
        after = held + (q - q_vis) + (vis_after - vis_held)
        # block at the last layer: the other layers already evicted (or held) `after`
        peak = max(peak, (layers - 1) * after + held + q, layers * held + q)
        held, vis_held = after, vis_after
    kv_bytes = peak * entry_bytes

    # LLM activations of the largest block (one layer's transients; SDPA holds no score matrix)
    text = adapter.text_config
    hidden = _cfg(text, "hidden_size")
    heads = _cfg(text, "num_attention_heads")
    inter = _cfg(text, "intermediate_size", default=4 * hidden)
    per_token = 4 * hidden + (heads + 2 * kv_heads) * head_dim + 3 * inter + 2 * head_dim  # + cos/sin
    mask = largest_q * (peak // max(layers, 1) + largest_q)  # bool mask over cache + block
    activation_bytes = largest_q * per_token * itemsize + mask

    vision_bytes = _vision_bytes(adapter, prepared, itemsize)
    media = prepared.media
    media_bytes = sum(int(f.nbytes) for f in media.frames) if media is not None else 0
    return MemoryEstimate(kv_bytes, activation_bytes, vision_bytes, media_bytes, peak)


def _vision_bytes(adapter, prepared, itemsize: int) -> int:
    """Patch inputs + one vision layer's activations over the largest unit's patches."""
    units = prepared.layout.units
    if not units:
        return 0
    config = adapter.model.config
    vision = _cfg(config, "vision_config")
    if vision is None:
        return 0
    largest = max(u.seq_end - u.seq_start for u in units)
    merge = _cfg(vision, "spatial_merge_size")
    patches_per_token = merge**2 if merge else _cfg(config, "scale_factor", default=1) ** 2
    temporal = _cfg(vision, "temporal_patch_size", default=1)
    patch = _cfg(vision, "patch_size", default=14)
    channels = _cfg(vision, "in_channels", "num_channels", default=3)
    v_hidden = _cfg(vision, "hidden_size", "embed_dim")
    v_inter = _cfg(vision, "intermediate_size", default=4 * v_hidden)
    patches = largest * patches_per_token
    pixel_values = patches * channels * temporal * patch * patch
    per_patch = 6 * v_hidden + 3 * v_inter  # residual, norm, q/k/v, attention out; gate/up/act
    out = largest * _cfg(adapter.text_config, "hidden_size")
    return (pixel_values + patches * per_patch + out) * itemsize


def free_memory_bytes(device) -> int:
    """Free memory where the cache will live: CUDA free + allocator-cached, or host available."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        free, _total = torch.cuda.mem_get_info(device)
        reusable = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
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

    def _free(self, adapter) -> int:
        return int(self.free_bytes()) if self.free_bytes is not None else free_memory_bytes(adapter.device)

    def check(self, adapter, prepared, config) -> MemoryEstimate:
        """Raise MemoryGuardError (one line) when the prefill of `prepared` under `config` would not fit."""
        method_cls = METHODS[config.method]
        est = estimate_prefill(adapter, prepared, method_cls, config.budget, config.block_size, config.prefill)
        if not self.enabled:
            return est
        free = self._free(adapter)
        if est.to_allocate <= self.headroom * free:
            return est
        hint = self._suggest(adapter, prepared, config, free)
        raise MemoryGuardError(
            f"{config.method} needs ~{format_bytes(est.to_allocate)}, {format_bytes(free)} free: {hint}"
        )

    def _suggest(self, adapter, prepared, config, free: int) -> str:
        """A method (with the budget it would use) whose estimate fits, else what to reduce."""
        budget = config.budget or max(1, min(1024, prepared.layout.n_visual // 10))
        for name, cls in METHODS.items():
            if name == config.method or not cls.evicts_per_block:
                continue
            for b in (budget, max(1, budget // 4)):
                est = estimate_prefill(adapter, prepared, cls, b, config.block_size, None)
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
