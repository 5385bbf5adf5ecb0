"""One variable-length attention call per layer in the Qwen vision towers, instead of one per chunk.

Qwen2.5-VL's vision tower attends inside 112-px windows in most layers, Qwen3-VL's (and the full-attention layers
of both) inside each image or temporal patch: `cu_seqlens` lists the chunks. Under SDPA or eager attention
transformers splits q / k / v per chunk and calls attention once per chunk in a Python loop (with a `tolist()` of
the chunk lengths per layer): a 4K image is ~660 windows x 28 windowed layers, some 20,000 attention calls, which
leaves a GPU idle most of the time. Here every layer attends all its chunks in one call:

- FlashAttention-2's `flash_attn_varlen_func` on `cu_seqlens` as it is, when `flash_attn` is installed and the
  tensors are CUDA bf16 / fp16 (no padding, no mask);
- otherwise the module's SDPA (or eager) attention over a block-diagonal layout: the chunks padded to the longest
  one, side by side as a batch, padded keys masked out (no mask and no gather when all chunks have one length).

Scores never cross a chunk, so each chunk gets the arithmetic of its own call. The chunk lengths are read on the
host once per distinct `cu_seqlens` tensor (the tower passes the same two to every layer): the padded layout is
built then, and each layer only gathers.

No module's `forward` is replaced: inside `visualkv.attention.patched` the towers' vision configs name a function
registered through transformers' `AttentionInterface` (`WRAPPED`), which transformers' own forward calls with the
layer's `cu_seqlens`. In the threads inside the patch it attends in one call; in any other thread it makes
transformers' own per-chunk calls. A model configured for flash attention keeps transformers' own path.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers.modeling_utils import AttentionInterface

from visualkv.attention import packed as packed_attention
from visualkv.devices import to_device
from visualkv.models import compat

ATTENTION_CLASSES = ("Qwen2_5_VLVisionAttention", "Qwen3VLVisionAttention")

#: chunks per attention call at most: CUDA grids cap a launch dimension at 65,535 (batch, or batch x heads, by kernel)
MAX_CHUNKS_PER_CALL = 2048

#: distinct `cu_seqlens` tensors whose layouts are kept (a tower call makes two: windows and whole images)
CACHED_BOUNDARIES = 4


@dataclass
class _Entries:
    """One thread's entries of `one_call_in_this_thread`, and the chunk layouts built meanwhile."""

    depth: int = 0
    layouts: dict = field(default_factory=dict)


_THREAD = threading.local()  # .entries: this thread's `_Entries`


def _entries() -> _Entries:
    if not hasattr(_THREAD, "entries"):
        _THREAD.entries = _Entries()
    return _THREAD.entries


def vision_attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The Qwen vision towers' attention modules of `model` (their configs name `WRAPPED` while patched)."""
    return [m for m in model.modules() if type(m).__name__ in ATTENTION_CLASSES]


@dataclass
class ChunkLayout:
    """Where the chunks of one `cu_seqlens` sit in the padded (chunks, longest, ...) batch.

    gather: per call, the sequence position of every padded slot (a pad slot repeats its chunk's first position);
    None when all chunks have one length and tile the sequence (a reshape). scatter: each position's slot in the
    concatenated calls' output. key_valid: per call, (chunks, longest) True where a key is a real token.
    """

    cu_seqlens: torch.Tensor
    longest: int
    gather: list[torch.Tensor] | None
    scatter: torch.Tensor | None
    key_valid: list[torch.Tensor]
    masks: dict = field(default_factory=dict)  # dtype -> additive masks per call, made on first use

    def additive_masks(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """(chunks, 1, 1, longest): 0 where a key is real, the dtype's minimum on padding (SDPA and eager add it)."""
        if dtype not in self.masks:
            low = torch.finfo(dtype).min
            self.masks[dtype] = [
                torch.zeros(v.shape, dtype=dtype, device=v.device).masked_fill_(~v, low)[:, None, None]
                for v in self.key_valid
            ]
        return self.masks[dtype]


def _build_layout(cu_seqlens: torch.Tensor) -> ChunkLayout:
    """The padded layout of `cu_seqlens`'s chunks, indices built on the host (numpy) and moved to its device once."""
    # The one host read (a sync on a GPU) per distinct tensor, so per tower call and not per layer: the padded
    # shape and the gather indices depend on the chunk lengths.
    bounds = np.asarray(cu_seqlens.tolist(), dtype=np.int64)
    lengths = np.diff(bounds)
    starts, lengths = bounds[:-1][lengths > 0], lengths[lengths > 0]
    longest = int(lengths.max()) if len(lengths) else 0
    device = cu_seqlens.device
    if len(np.unique(lengths)) <= 1 and bounds[0] == 0:  # equal chunks in order: views, no mask
        return ChunkLayout(cu_seqlens, longest, None, None, [])
    offsets = np.arange(longest)
    valid = offsets < lengths[:, None]  # (chunks, longest)
    slots = np.where(valid, starts[:, None] + offsets, starts[:, None])  # a pad slot reads its chunk's first token
    scatter = np.empty(int(bounds[-1]), dtype=np.int64)
    scatter[slots[valid]] = np.flatnonzero(valid)

    def on_device(a: np.ndarray) -> torch.Tensor:
        return to_device(torch.from_numpy(np.ascontiguousarray(a)), device)

    per_call = range(0, len(lengths), MAX_CHUNKS_PER_CALL)
    gather = [on_device(slots[i : i + MAX_CHUNKS_PER_CALL].reshape(-1)) for i in per_call]
    key_valid = [on_device(valid[i : i + MAX_CHUNKS_PER_CALL]) for i in per_call]
    return ChunkLayout(cu_seqlens, longest, gather, on_device(scatter), key_valid)


def _layout(cu_seqlens: torch.Tensor, cache: dict) -> ChunkLayout:
    """The layout of `cu_seqlens`, built once per tensor: the tower passes the same two objects to every layer.
    The cache keeps the tensor alive, so its id is not reused while cached."""
    hit = cache.get(id(cu_seqlens))
    if hit is not None and hit.cu_seqlens is cu_seqlens:
        return hit
    layout = _build_layout(cu_seqlens)
    if len(cache) >= CACHED_BOUNDARIES:  # list(): one step under the GIL, safe while another thread inserts
        for stale in list(cache)[: len(cache) - CACHED_BOUNDARIES + 1]:
            cache.pop(stale, None)
    cache[id(cu_seqlens)] = layout
    return layout


@functools.cache
def _flash_varlen_function() -> Callable | None:
    """FlashAttention-2's `flash_attn_varlen_func`, or None where `flash_attn` is not installed."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def _varlen_kernel(q: torch.Tensor) -> Callable | None:
    """The varlen kernel for `q`: FlashAttention-2's on CUDA bf16 / fp16 where installed, else None (SDPA)."""
    if not (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)):
        return None
    return _flash_varlen_function()


def _attend_padded(fn: Callable, module, q, k, v, scaling: float, layout: ChunkLayout) -> torch.Tensor:
    """q / k / v (seq, heads, dim); attention inside each chunk over the padded layout with `fn` (the model's own
    sdpa or eager function), one call per at most `MAX_CHUNKS_PER_CALL` chunks (one for every input VisualKV
    makes); returns (seq, heads, dim)."""

    def attend(batch: list[torch.Tensor], mask: torch.Tensor | None) -> torch.Tensor:
        # (chunks, length, heads, dim) in and out, as transformers' interfaces return it
        qkv = [t.transpose(1, 2) for t in batch]
        return fn(module, *qkv, attention_mask=mask, scaling=scaling, dropout=0.0, is_causal=False)[0]

    seq, tail = q.shape[0], q.shape[1:]
    if layout.gather is None:  # equal chunks tiling the sequence: views, no gather, no mask
        n = seq // max(layout.longest, 1)
        views = [t.view(n, layout.longest, *tail) for t in (q, k, v)]
        parts = [
            attend([t[i : i + MAX_CHUNKS_PER_CALL] for t in views], None) for i in range(0, n, MAX_CHUNKS_PER_CALL)
        ]
        return (parts[0] if len(parts) == 1 else torch.cat(parts)).reshape(seq, *tail)
    parts = []
    for index, mask in zip(layout.gather, layout.additive_masks(q.dtype), strict=True):
        batch = [t[index].view(-1, layout.longest, *tail) for t in (q, k, v)]
        parts.append(attend(batch, mask).reshape(-1, *tail))
    padded = parts[0] if len(parts) == 1 else torch.cat(parts)
    return padded[layout.scatter]


def _one_call(fn: Callable, module, q, k, v, cu_seqlens: torch.Tensor, scaling: float) -> torch.Tensor:
    """q / k / v (seq, heads, dim): every chunk of `cu_seqlens` attended in one call; returns (seq, heads, dim)."""
    layout = _layout(cu_seqlens, _entries().layouts)
    varlen = _varlen_kernel(q)
    if varlen is None:
        return _attend_padded(fn, module, q, k, v, scaling, layout)
    return varlen(  # one call on the packed sequence: no padding, no mask
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        cu_seqlens_q=cu_seqlens.to(torch.int32),
        cu_seqlens_k=cu_seqlens.to(torch.int32),
        max_seqlen_q=layout.longest,
        max_seqlen_k=layout.longest,
        dropout_p=0.0,
        softmax_scale=scaling,
        causal=False,
    )


def _per_chunk(fn: Callable, module, query, key, value, cu_seqlens: torch.Tensor, **kwargs) -> torch.Tensor:
    """transformers' own path for these towers, call for call: one `fn` call per chunk (outside VisualKV's
    threads, so another thread using the model meanwhile gets exactly what it gets alone)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    splits = [torch.split(t, lengths, dim=2) for t in (query, key, value)]
    return torch.cat([fn(module, q, k, v, attention_mask=None, **kwargs)[0] for q, k, v in zip(*splits)], dim=1)


def _registered(base: str) -> Callable:
    """The attention function registered as `WRAPPED[base]`: a tower layer's chunks in one call in a thread
    inside `visualkv.attention.patched`, transformers' per-chunk calls of `base` in any other thread."""

    def attention(module, query, key, value, attention_mask=None, **kwargs):
        fn = packed_attention.base_function(base, module)
        cu_seqlens = kwargs.pop(compat.VARLEN_BOUNDARIES)
        for name in compat.VARLEN_OTHERS:
            kwargs.pop(name, None)
        if not _entries().depth:
            return _per_chunk(fn, module, query, key, value, cu_seqlens, **kwargs), None
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (1, heads, seq, dim) -> (seq, heads, dim)
        out = _one_call(fn, module, q, k, v, cu_seqlens, kwargs["scaling"])
        return out.unsqueeze(0), None  # (1, seq, heads, dim), as transformers' functions return it

    return attention


#: base implementation -> the name its one-call form is registered under. transformers' Qwen vision attention
#: hands a layer's chunk boundaries to the attention function in one call only when the function's name says
#: flash (`compat.VARLEN_NAME_MARKER`); under any other name it splits the layer into one call per chunk itself.
WRAPPED = {base: f"visualkv_{base}_{compat.VARLEN_NAME_MARKER}_varlen" for base in ("sdpa", "eager")}
BASE_OF = {name: base for base, name in WRAPPED.items()}

for _base, _name in WRAPPED.items():
    AttentionInterface.register(_name, _registered(_base))


@contextlib.contextmanager
def one_call_in_this_thread() -> Iterator[None]:
    """Within the block, the tower layers this thread runs attend in one call (nested entries only count); the
    chunk layouts built meanwhile are dropped on leaving the outermost entry."""
    entries = _entries()  # the entering thread's, also if the exit runs elsewhere (a generator closed there)
    entries.depth += 1
    try:
        yield
    finally:
        entries.depth -= 1
        if not entries.depth:
            entries.layouts.clear()
