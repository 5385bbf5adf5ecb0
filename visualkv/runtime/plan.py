"""A prefill's plan, shared by the engine that runs it and the memory guard that sizes it before it runs.

`plan_prefill` gives the blocks and the vision tower's calls (`PrefillPlan`); `attention_working_bytes` the
transient of one attention call (the engine notes it, the guard sums it), `LayerTransients` a decoder layer's;
`CacheDryRun` replays what the cache stores of each block on the meta device
with the cache's own code (`CompressibleLayer.update`: first allocation, capacity hint, growth), so the guard
reads buffer sizes and growth transients from the cache itself instead of re-deriving them. Nothing is
allocated: meta tensors have shapes and byte counts only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from visualkv.attention import block as block_attention
from visualkv.attention import implementation
from visualkv.kv.cache import CompressibleCache
from visualkv.layout import Block, plan_blocks
from visualkv.models.base import ModelAdapter, PreparedInput

META = torch.device("meta")


@dataclass(frozen=True)
class PrefillPlan:
    """The blocks of a prefill (`layout.plan_blocks` under the method's mode) and its tower calls.

    vision_ahead: blocks whose media one vision-tower call encodes (the engine's `vision_ahead`).
    """

    mode: str
    block_size: int
    blocks: list[Block]
    vision_ahead: int = 1

    def tower_calls(self) -> dict[int, range]:
        """Block index -> the blocks whose media one tower call made before it encodes ahead (each later block
        with media of a call only reads its share). Empty when every block encodes its own media."""
        calls: dict[int, range] = {}
        if self.vision_ahead <= 1:
            return calls
        until = 0
        for i, block in enumerate(self.blocks):
            if i >= until and block.units:
                until = i + self.vision_ahead
                calls[i] = range(i, min(until, len(self.blocks)))
        return calls


def plan_prefill(
    adapter: ModelAdapter,
    prepared: PreparedInput,
    method,
    budget: int | None,
    block_size: int | None,
    prefill_mode: str | None,
    vision_ahead: int = 1,
) -> PrefillPlan:
    """The plan of prefilling `prepared` under `method` (an instance, a class or its traits: its
    `default_prefill` and `question_apart` are read); unset block size and mode take the defaults."""
    block_size = block_size or adapter.default_block_size
    mode = prefill_mode or method.default_prefill
    blocks = plan_blocks(
        prepared.seq_len, prepared.layout.units, mode, block_size, budget, question_apart=method.question_apart
    )
    return PrefillPlan(mode, block_size, blocks, vision_ahead)


def needs_mask(q: int, n_past: int, impl: str) -> bool:
    """Does attention for q new tokens after n_past cached entries take a mask (`attention_mask`)?"""
    return not (q == 1 or (n_past == 0 and impl != "eager"))


def attention_working_bytes(
    adapter: ModelAdapter, q: int, n: int, causal_flag: bool, dtype: torch.dtype, impl: str | None = None
) -> int:
    """Transient bytes one attention call of q queries over n keys holds on top of the cache (from shapes);
    `impl`: the model's own attention kernel (default: `implementation(adapter)`).

    Without a mask (`causal_flag`: a first block, or one query) transformers' SDPA path uses the kernel's own
    GQA. With one (a block after cached entries) the wrapped sdpa takes `block_attention`'s kernel: "flash"
    holds nothing over the keys; "gqa" the bool mask plus the additive copy PyTorch's SDPA makes of it (seen in
    the CPU profiler); "stock" (and any unwrapped kernel) that and K/V repeated to every query head
    (`repeat_kv`). Eager attention always repeats K/V and materialises the (heads, q, n) scores and
    probabilities, and its mask is additive in `dtype`.
    """
    cfg = adapter.text_config
    hq, hkv, hd = cfg.num_attention_heads, adapter.num_kv_heads, adapter.head_dim
    itemsize = dtype.itemsize
    expanded = 0 if hq == hkv else 2 * hq * n * hd * itemsize
    impl = impl or implementation(adapter)
    if impl == "eager":
        return expanded + 2 * hq * q * n * itemsize + (0 if causal_flag else q * n * itemsize)
    if causal_flag:
        return 0
    kernel = block_attention.kernel_for(adapter.device, dtype, hd)
    if impl != "sdpa":
        kernel = "stock"
    mask = q * n * (1 + itemsize)
    return {"flash": 0, "gqa": mask, "stock": mask + expanded}[kernel]


@dataclass(frozen=True)
class StoredBlock:
    """One layer's dry run of a block: entries before, while the block is stored, after its eviction; the
    buffers' bytes before and after, and the old buffers' bytes copied by a growth (0: none)."""

    held: int
    stored: int
    after: int
    allocated_before: int
    allocated: int
    growing: int


class CacheDryRun:
    """One cache layer fed meta tensors of a prefill's shapes, block by block (`store`): its buffers are sized
    and grown by the cache's own code under the capacity hint and headroom the engine sets, and the visual
    entries above the budget are dropped after the block as a per-block eviction does (by count: which ones
    does not change a byte). Layers that store alike behave alike, so one run stands for all of them."""

    def __init__(self, adapter: ModelAdapter, capacity_bound: int | None, headroom: int) -> None:
        cache = CompressibleCache(1, headroom, adapter.query_group)
        cache.set_capacity_hint(capacity_bound)  # + headroom, as the engine sets it
        self.layer = cache.layers[0]
        self.shape = (1, adapter.num_kv_heads, adapter.head_dim)
        self.dtype = adapter.dtype

    def store(self, q: int, visual: int, budget: int | None) -> StoredBlock:
        """Append a block's `q` entries (`visual` of them visual), then evict the visual ones to `budget`."""
        layer = self.layer
        held, before = layer.get_seq_length(), layer.allocated_bytes()
        growing = 0
        if q:  # (a block with nothing kept never reaches the cache)
            b, h, d = self.shape
            kv = torch.empty((b, h, q, d), dtype=self.dtype, device=META)
            layer.update(kv, kv, torch.empty(q, dtype=torch.int32, device=META))
            growing = before if layer.allocated_bytes() != before else 0
            layer.visual_entries += visual
        stored = layer.get_seq_length()
        if budget is not None and layer.visual_entries > budget:
            layer.truncate(stored - (layer.visual_entries - budget))
            layer.visual_entries = budget
        return StoredBlock(held, stored, layer.get_seq_length(), before, layer.allocated_bytes(), growing)


def config_value(obj, *names, default=None):
    """The first of `names` the config has; a per-axis pair (InternVL's patch_size [14, 14]) gives its first."""
    for name in names:
        value = getattr(obj, name, None)
        if isinstance(value, list | tuple) and value:
            value = value[0]
        if value is not None:
            return value
    return default


@dataclass(frozen=True)
class LayerTransients:
    """One decoder layer's transients per token of a block, from the model's config: the residual stream (in,
    out) plus the larger of its two phases, which never coexist: attention (normed input; q, k, v; rotated q, k;
    attention output; o_proj; plus, over every key, `attention_working_bytes`) or the MLP (normed input; gate
    activation, up, their product)."""

    hidden: int
    residual: int
    attention: int
    mlp: int

    @classmethod
    def of(cls, adapter, itemsize: int) -> LayerTransients:
        text = adapter.text_config
        hidden, heads = config_value(text, "hidden_size"), config_value(text, "num_attention_heads")
        kv_heads, head_dim = adapter.num_kv_heads, adapter.head_dim
        inter = config_value(text, "intermediate_size", default=4 * hidden)
        attention = 2 * hidden + (heads + 2 * kv_heads) * head_dim + (heads + kv_heads) * head_dim + heads * head_dim
        return cls(hidden, 2 * hidden * itemsize, attention * itemsize, (hidden + 3 * inter) * itemsize)

    def bytes(self, q: int, attention_bytes: int) -> int:
        """The layer on a block of `q` tokens whose attention call holds `attention_bytes` over its keys."""
        return q * self.residual + max(q * self.attention + attention_bytes, q * self.mlp)
