"""Attention over a layer's full-precision entries plus its packed INT8 / INT4 segments, without keeping a
dequantized copy of them.

A `CompressibleLayer.update` returns only the full-precision K/V (views of its buffers, no copy) and
`announce`s the packed segments the attention call about to read them must add. That call is transformers'
own attention function, wrapped: the model's text config names `visualkv_sdpa` / `visualkv_eager` (registered
here with transformers' `AttentionInterface` and `AttentionMaskInterface`, `install`), which delegate to
`sdpa` / the model's eager function unchanged unless the keys they receive were announced. For announced keys:

- one query token (a decode step): the segments are read on their codes, never dequantized. With k = (code -
  mid) * scale + z per channel group, q . k is a matmul over the planes (code - mid) * scale (one conversion of
  the packed bytes and one in-place multiply, in the model dtype) plus each group's z times the sum of the
  query's channels in it, and p @ v likewise (`_coded_scores`, `_coded_values`). The scores over
  [segments | full-precision window] are one softmax; each part's values are multiplied by its share of
  the probabilities, so nothing of the cache is copied (the mask, if any, covers the window only). On a
  Qwen2.5-VL-7B-shaped layer this moves about half the bytes dequantizing did (scripts/packed_decode.py);
- several query tokens (a prefill block after packed ones): the segments are dequantized and concatenated with
  the block's K/V for this call (one copy per layer per block, as a quantized block already makes) and the
  wrapped function runs as usual; the engine's mask already spans every entry before the block.

Either way what a call derives from the packed segments lives for that layer's attention only, so the device
holds the packed bytes plus one layer's transient (`working_bytes`), never a full-precision copy of every
packed tier. Announcements are kept
per thread (the app serves chats from threads) and match the exact key tensor returned by `update`, so an
attention call that reads any other keys (transformers' own forward, another model) is untouched.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from visualkv.quant import PackedTensor, centred_zero, code_planes_possible, dequantize, scaled_code_planes

#: the wrapped name of each implementation that takes an explicit mask (flash attention is left alone)
WRAPPED = {"sdpa": "visualkv_sdpa", "eager": "visualkv_eager"}
_BASE = {wrapped: base for base, wrapped in WRAPPED.items()}
_pending = threading.local()  # .keys: the key tensor announced last in this thread; .segments: its segments


def announce(keys: torch.Tensor, segments: list) -> None:
    """Tell the next attention call in this thread that reads `keys` to add `segments` (QuantSegments)."""
    _pending.keys, _pending.segments = keys, segments


def _take(keys: torch.Tensor) -> list | None:
    if getattr(_pending, "keys", None) is keys:
        segments = _pending.segments
        _pending.keys = _pending.segments = None
        return segments
    return None


def base_implementation(name: str | None) -> str:
    """The implementation a wrapped name stands for ("visualkv_sdpa" -> "sdpa"); other names unchanged."""
    return _BASE.get(name or "sdpa", name or "sdpa")


def install(text_config: Any) -> None:
    """Route a model's decoder attention through the wrappers (sdpa and eager; other kernels unchanged)."""
    name = text_config._attn_implementation or "sdpa"
    if name in WRAPPED:
        text_config._attn_implementation = WRAPPED[name]


def installed(text_config: Any) -> bool:
    """Whether the model's decoder attention adds announced packed segments (sdpa and eager do, once installed;
    flash attention takes no explicit mask and is not wrapped)."""
    return text_config._attn_implementation in _BASE


@contextlib.contextmanager
def stock(text_config: Any) -> Iterator[None]:
    """transformers' own attention function for the duration (the `bench gpu` reference runs it unwrapped)."""
    name = text_config._attn_implementation
    text_config._attn_implementation = base_implementation(name)
    try:
        yield
    finally:
        text_config._attn_implementation = name


def _base_function(name: str, module: torch.nn.Module):
    if name == "sdpa":
        return ALL_ATTENTION_FUNCTIONS["sdpa"]
    # eager attention is a function of each model's own file (transformers passes it as the default)
    return sys.modules[type(module).__module__].eager_attention_forward


def _wrapper(base: str):
    def attention(module, query, key, value, attention_mask, **kwargs):
        segments = _take(key)
        fn = _base_function(base, module)
        if not segments:
            return fn(module, query, key, value, attention_mask, **kwargs)
        if query.shape[2] == 1:
            parts = [Part.of(s) for s in segments]
            return one_query(query, key, value, attention_mask, parts, kwargs.get("scaling"))
        parts = [(dequantize(s.keys), dequantize(s.values)) for s in segments]  # this call's transient
        keys = torch.cat([k for k, _ in parts] + [key], dim=2)
        values = torch.cat([v for _, v in parts] + [value], dim=2)
        mask = _widened(attention_mask, keys.shape[2], query, additive=base == "eager")
        return fn(module, query, keys, values, mask, **kwargs)

    attention.__name__ = f"visualkv_{base}_attention"
    return attention


def working_bytes(segments: list, queries: int, query_group: int, window_bytes: int = 0) -> int:
    """Transient bytes the attention call adding `segments` holds on top of the cache (from shapes, as the code
    above allocates them; `window_bytes`: the full-precision K and V the call also reads).

    Several queries (a prefill block): every segment's dequantized K and V in the model dtype, their concatenation
    with the window, and `quant.dequantize`'s intermediates for the segment dequantized last (float32 codes and
    result, 8 bytes, and the unpacked codes, 1 byte, per element). One query (a decode step, `query_group` query
    heads per KV head): the float32 scores, their concatenation and the probabilities over the packed entries, plus
    the largest segment's transient while it is read: its scaled code planes in the model dtype (INT4: one uint8
    nibble plane besides) and, per entry and query head, the product in the model dtype and float32 (twice: the
    planes' sum) or the probabilities in the model dtype.
    """
    if not segments:
        return 0
    tensors = [p for s in segments for p in (s.keys, s.values)]
    if queries > 1:
        dequantized = sum(_elements(p) * p.dtype.itemsize for p in tensors)
        return 2 * dequantized + window_bytes + 9 * max(_elements(p) for p in tensors)
    scores = sum(_entries(s.keys) for s in segments) * query_group * 4 * 3

    def reading(p: PackedTensor) -> int:
        planes = p.shape[-1] * p.dtype.itemsize + (p.shape[-1] // 2 if p.spec.bits == 4 else 0)
        return _entries(p) * (planes + query_group * (p.dtype.itemsize + 8))

    return scores + max(reading(p) for p in tensors)


def _entries(p: PackedTensor) -> int:
    """Entries times heads (every leading dim) of a packed tensor."""
    return int(torch.Size(p.shape[:-1]).numel())


def _elements(p: PackedTensor) -> int:
    return _entries(p) * p.shape[-1]


def _widened(mask: torch.Tensor | None, width: int, query: torch.Tensor, additive: bool) -> torch.Tensor:
    """The mask for q queries over `width` entries, the last q of them the queries' own: a given mask over the
    last entries is widened on the left with visible columns (the packed entries are older than every query);
    none means causal among the queries (the kernels' own causal flag would align it to the first entry)."""
    if mask is None:
        q, device = query.shape[2], query.device
        allowed = torch.ones((q, width), dtype=torch.bool, device=device)
        allowed[:, width - q :] = torch.ones((q, q), dtype=torch.bool, device=device).tril()
        mask = allowed[None, None]
        if additive:
            mask = torch.zeros(mask.shape, dtype=query.dtype, device=device).masked_fill(
                ~mask, torch.finfo(query.dtype).min
            )
        return mask
    if mask.shape[-1] == width:
        return mask
    pad = width - mask.shape[-1]
    visible = torch.ones if mask.dtype == torch.bool else torch.zeros
    return torch.cat([visible((*mask.shape[:-1], pad), dtype=mask.dtype, device=mask.device), mask], dim=-1)


def one_query(query, key, value, mask, parts: list[Part], scaling: float | None):
    """Attention of one query token over [parts | key], one softmax, no copy of the cache.

    query (b, H, 1, d); key / value (b, Hkv, n, d); parts: the packed segments (`Part.of`: read on their codes,
    never dequantized) of (b, Hkv, m, d); mask None or (1 or b, 1, 1, >= n) over the last n entries. Returns
    ((b, 1, H, d), None) like transformers' functions.
    """
    b, heads, _, d = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    grouped = query.reshape(b, kv_heads, group, d)  # query head h reads KV head h // group (repeat_kv's order)
    scale = scaling if scaling is not None else d**-0.5
    parts = [*parts, Part(key, value)]
    scores = [part.scores(grouped) * scale for part in parts]  # (b, Hkv, g, m) float32 each
    if mask is not None:
        window = mask[..., -key.shape[2] :].reshape(mask.shape[0], 1, 1, -1)
        if window.dtype == torch.bool:
            scores[-1] = scores[-1].masked_fill(~window, float("-inf"))
        else:
            scores[-1] = scores[-1] + window.float()
    probs = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
    out, start = None, 0
    for part, part_scores in zip(parts, scores, strict=True):  # each part's values by its share, summed in float32
        share = part.weighted_values(probs[..., start : start + part_scores.shape[-1]])
        out = share if out is None else out + share
        start += part_scores.shape[-1]
    return out.to(value.dtype).reshape(b, heads, 1, d).transpose(1, 2).contiguous(), None


class Part:
    """One run of entries a decode step attends: full-precision K/V (b, Hkv, m, d), or the packed K/V of a segment
    read on its codes (`coded`)."""

    def __init__(self, keys, values, coded: bool = False) -> None:
        self.keys, self.values, self.coded = keys, values, coded

    @staticmethod
    def of(segment) -> Part:
        """A packed segment read on its codes; dequantized where its codes do not split into planes (INT4 with an
        odd group size)."""
        if code_planes_possible(segment.keys) and code_planes_possible(segment.values):
            return Part(segment.keys, segment.values, coded=True)
        return Part.dequantized(segment)

    @staticmethod
    def dequantized(segment) -> Part:
        """A packed segment dequantized for this call (how decode steps read packed tiers before; benchmarks)."""
        return Part(dequantize(segment.keys), dequantize(segment.values))

    def scores(self, grouped: torch.Tensor) -> torch.Tensor:
        """(b, Hkv, g, m) float32 dot products of the grouped queries (b, Hkv, g, d) with these keys."""
        if not self.coded:
            return torch.matmul(grouped, self.keys.transpose(-1, -2)).float()
        return _coded_scores(grouped, self.keys)

    def weighted_values(self, probs: torch.Tensor) -> torch.Tensor:
        """(b, Hkv, g, d) float32: probabilities (b, Hkv, g, m) float32 times these values."""
        if not self.coded:
            return torch.matmul(probs.to(self.values.dtype), self.values).float()
        return _coded_values(probs, self.values)


def _coded_scores(grouped: torch.Tensor, keys: PackedTensor) -> torch.Tensor:
    """q . k for packed keys, from their codes: with k = (code - mid) * scale_G + z_G in each channel group G
    (z_G the zero point moved to the middle code, `quant.centred_zero`),

        q . k = q . ((code - mid) * scale) + sum_G z_G * sum(q_G),

    the first term a matmul over the scaled code planes (`quant.scaled_code_planes`: one conversion and one
    in-place multiply, no float32 copy, no zero added), the second a small one over the G zero points per entry.
    grouped (b, Hkv, g, d) -> (b, Hkv, g, m) float32.
    """
    b, h, g, d = grouped.shape
    scores = None
    for plane in scaled_code_planes(keys):
        part = torch.matmul(grouped[..., plane.channels], plane.values.transpose(-1, -2)).float()
        scores = part if scores is None else scores + part  # INT4's two planes summed in float32
    q_sums = grouped.float().view(b, h, g, d // keys.spec.group_size, -1).sum(-1)  # (b, Hkv, g, G)
    return scores + torch.matmul(q_sums, centred_zero(keys).transpose(-1, -2))


def _coded_values(probs: torch.Tensor, values: PackedTensor) -> torch.Tensor:
    """p @ v for packed values, from their codes: p @ ((code - mid) * scale) per scaled code plane, plus each
    group's (centred) zero points weighted by the probabilities (p @ z, spread over the group's channels).
    probs (b, Hkv, g, m) float32 -> (b, Hkv, g, d) float32.
    """
    b, h, g, _ = probs.shape
    d = values.shape[-1]
    weights = probs.to(values.dtype)
    out = torch.empty((b, h, g, d), dtype=torch.float32, device=probs.device)
    for plane in scaled_code_planes(values):
        out[..., plane.channels] = torch.matmul(weights, plane.values).float()
    zero_part = torch.matmul(probs, centred_zero(values))  # (b, Hkv, g, G)
    return out + zero_part.repeat_interleave(values.spec.group_size, dim=-1)


for _base, _name in WRAPPED.items():
    AttentionInterface.register(_name, _wrapper(_base))
    AttentionMaskInterface.register(_name, ALL_MASK_ATTENTION_FUNCTIONS[_base])
