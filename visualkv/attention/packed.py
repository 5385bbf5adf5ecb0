"""VisualKV's decoder attention: transformers' sdpa / eager functions, plus what the cache needs.

Registered as `visualkv_sdpa` / `visualkv_eager` (`WRAPPED`), named on the decoder's configs only inside
`visualkv.attention.patched`. A call delegates to the model's own function unchanged unless the layer call's step
(`visualkv.attention.step`, the one channel from the engine) brings the layer's packed segments (INT8 / INT4
tiers, dequantized for this call only, so no full-precision copy of a tier is ever kept), an `AfterCache` mask (a
block after cached entries, attended without expanding K/V) or `grouped_decode` (a fixed-shape decode step over its
window, `one_query`). Outside a step (no engine call in this thread) it is the model's own function.
"""

from __future__ import annotations

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from visualkv.attention import block as block_attention
from visualkv.attention import step as layer_step
from visualkv.attention.block import AfterCache
from visualkv.kv.quant import dequantize_all
from visualkv.models import compat

#: the wrapped name of each implementation that takes an explicit mask (flash attention is left alone)
WRAPPED = {"sdpa": "visualkv_sdpa", "eager": "visualkv_eager"}


def base_function(name: str, module: torch.nn.Module):
    """The model's own attention function `name` ("sdpa" or "eager") for `module`."""
    if name == "sdpa":
        return ALL_ATTENTION_FUNCTIONS["sdpa"]
    # eager attention is a function of each model's own file (transformers passes it as the default)
    return compat.model_file_function(module, compat.EAGER_ATTENTION)


def _wrapper(base: str):
    """The attention function registered for `base` ("sdpa" or "eager"); see the module docstring."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        fn = base_function(base, module)
        step = layer_step.current()
        if step is None:
            return fn(module, query, key, value, attention_mask, **kwargs)
        segments = step.segments  # QuantSegments of the layer, held before this block: () for none
        if step.after_cache is not None:
            attention_mask = step.after_cache
        if query.shape[2] == 1 and (segments or step.grouped_decode):
            # one query: every segment in one part beside the window, nothing of the cache is copied
            parts = [dequantized(segments)] if segments else []  # this call's transient
            return one_query(query, key, value, attention_mask, parts, kwargs.get("scaling"))
        if segments:  # a prefill block after packed ones: [segments | block], this call's transient
            key, value = dequantized(segments, key, value)
            if attention_mask is None:  # the block is causal, every packed entry older than it
                attention_mask = AfterCache(query.shape[2])
            elif not isinstance(attention_mask, AfterCache):
                attention_mask = _widened(attention_mask, key.shape[2])
        if isinstance(attention_mask, AfterCache):  # a block after cached entries (`visualkv.attention.block`)
            if base == "sdpa":
                return block_attention.attend(module, query, key, value, attention_mask, fn, **kwargs)
            attention_mask = attention_mask.additive(key.shape[2], key.device, query.dtype)
        return fn(module, query, key, value, attention_mask, **kwargs)

    attention.__name__ = f"visualkv_{base}_attention"
    return attention


def dequantized(
    segments: list, keys: torch.Tensor | None = None, values: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) of every segment dequantized, in segment order, each into one buffer (`quant.dequantize_all`: no
    concatenation), followed by `keys` / `values` when given (a prefill block's own entries)."""
    return (
        dequantize_all([s.keys for s in segments], keys),
        dequantize_all([s.values for s in segments], values),
    )


def working_bytes(segments: list, queries: int, query_group: int, window: torch.Size) -> int:
    """Transient bytes the attention call adding `segments` holds on top of the cache (from shapes, as the code
    here allocates them); `window`: the shape (b, Hkv, n, d) of the full-precision keys the call also reads.

    Either way every segment's K and V are dequantized for the call into one buffer each (`dequantized`), plus 2
    bytes of unpacked nibbles per element of the largest INT4 tensor. Several queries (a prefill block): the same
    buffers also hold a copy of the window's K and V. One query (a decode step, `query_group` query heads per KV
    head): plus the float32 scores, their concatenation and the probabilities over every entry, the window's
    included.
    """
    if not segments:
        return 0
    tensors = [p for s in segments for p in (s.keys, s.values)]
    dequantized = sum(_elements(p) * p.dtype.itemsize for p in tensors)
    last = max(_elements(p) * (2 if p.spec.bits == 4 else 0) for p in tensors)
    if queries > 1:
        return dequantized + 2 * window.numel() * tensors[0].dtype.itemsize + last
    entries = sum(_entries(s.keys) for s in segments) + window[:-1].numel()
    return dequantized + last + 3 * 4 * query_group * entries


def _entries(p) -> int:
    """Entries times heads (every leading dim) of a packed tensor."""
    return torch.Size(p.shape[:-1]).numel()


def _elements(p) -> int:
    return _entries(p) * p.shape[-1]


def _widened(mask: torch.Tensor, width: int) -> torch.Tensor:
    """A tensor mask over the last entries widened on the left to `width` with visible columns (the packed
    entries are older than every query)."""
    if mask.shape[-1] == width:
        return mask
    pad = width - mask.shape[-1]
    visible = torch.ones if mask.dtype == torch.bool else torch.zeros
    return torch.cat([visible((*mask.shape[:-1], pad), dtype=mask.dtype, device=mask.device), mask], dim=-1)


def one_query(query, key, value, mask, parts, scaling: float | None):
    """Attention of one query token over [packed parts | key], one softmax, no copy of the cache.

    query (b, H, 1, d); key / value (b, Hkv, n, d); parts [(k, v)] of (b, Hkv, m, d); mask None or
    (1 or b, 1, 1, >= n) over the last n entries. Returns ((b, 1, H, d), None) like transformers' functions.
    """
    b, heads, _, d = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    grouped = query.reshape(b, kv_heads, group, d)  # query head h reads KV head h // group (repeat_kv's order)
    scale = scaling if scaling is not None else d**-0.5
    pairs = [*parts, (key, value)]
    scores = [_float_scores(grouped, k) * scale for k, _ in pairs]  # (b, Hkv, g, m)
    if mask is not None:
        window = mask[..., -key.shape[2] :].reshape(mask.shape[0], 1, 1, -1)
        if window.dtype == torch.bool:
            scores[-1] = scores[-1].masked_fill(~window, float("-inf"))
        else:
            scores[-1] = scores[-1] + window.float()
    probs = torch.softmax(torch.cat(scores, dim=-1) if parts else scores[0], dim=-1).to(value.dtype)
    out, start = None, 0
    for k, v in pairs:  # each part's values times its share of the probabilities, summed in float32
        share = torch.matmul(probs[..., start : start + k.shape[2]], v).float()
        out = share if out is None else out + share
        start += k.shape[2]
    return out.to(value.dtype).reshape(b, heads, 1, d).transpose(1, 2).contiguous(), None


def one_query_working_bytes(heads: int, entries: int) -> int:
    """Transient bytes of `one_query` over `entries` per KV head with no packed parts: the float32 scores, their
    probabilities and the rounded probabilities, per query head (the output is one token's)."""
    return 3 * 4 * heads * entries


def _float_scores(grouped: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """(b, Hkv, g, d) x (b, Hkv, m, d) -> float32 (b, Hkv, g, m). On CUDA in 16-bit, one batched matmul that writes
    float32 (`out_dtype`), as the SDPA kernels keep their scores: rounding a score of 30 to bfloat16 moves it by up
    to 0.06, its weight by 6 %. Elsewhere (or where the kernel is missing) the matmul's own dtype, then float32."""
    b, kv_heads, g, _ = grouped.shape
    if b == 1 and _float_out_matmul(grouped):  # b = 1 (one chat): flattening the heads is a view, not a copy
        out = torch.bmm(grouped[0], key[0].transpose(-1, -2), out_dtype=torch.float32)
        return out.view(1, kv_heads, g, key.shape[2])
    return torch.matmul(grouped, key.transpose(-1, -2)).float()


_FLOAT_OUT: dict[torch.device, bool] = {}  # per device: whether bmm(..., out_dtype=float32) runs there


def _float_out_matmul(t: torch.Tensor) -> bool:
    """Whether `torch.bmm(..., out_dtype=torch.float32)` runs for `t`'s device and dtype (CUDA, 16-bit; PyTorch >=
    2.8). Probed once per device on a tiny product, at the first call: a decoder's warm-up step, before any graph
    capture (a failed kernel inside a capture would void it)."""
    if not t.is_cuda or t.dtype not in (torch.bfloat16, torch.float16):
        return False
    if t.device not in _FLOAT_OUT:
        try:
            a = torch.ones(1, 2, 8, dtype=t.dtype, device=t.device)
            torch.bmm(a, a.transpose(-1, -2), out_dtype=torch.float32)
            _FLOAT_OUT[t.device] = True
        except (RuntimeError, TypeError, NotImplementedError):
            _FLOAT_OUT[t.device] = False
    return _FLOAT_OUT[t.device]


for _base, _name in WRAPPED.items():
    AttentionInterface.register(_name, _wrapper(_base))
    AttentionMaskInterface.register(_name, ALL_MASK_ATTENTION_FUNCTIONS[_base])
