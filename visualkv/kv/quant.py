"""Packed INT8 / INT4 quantization of KV tensors (pure torch, no model).

Used by Sali-Cache for its INT8 and INT4 tiers: entries are really stored packed (one byte per INT8
value, two INT4 values per byte) with one asymmetric scale and zero point per group of channels, and
dequantized just in time for attention.

Layout, for ``x`` shaped ``(..., tokens, head_dim)`` (e.g. ``(batch, kv_heads, tokens, head_dim)``):

- ``data``:  uint8 ``(..., tokens, head_dim * bits // 8)``; for INT4 the low nibble holds the even
  channel and the high nibble the odd channel (``byte = q[2i] | q[2i+1] << 4``).
- ``scale``, ``zero``: ``x.dtype``, ``(..., tokens, head_dim // group_size)``; ``zero`` is the group
  minimum, ``scale`` the step. Dequantized value = ``q * scale + zero``.

Cost per token (and per leading index, e.g. per KV head): ``head_dim * bits / 8`` bytes of data plus
``2 * head_dim / group_size * itemsize`` bytes of scale and zero. For head_dim 128, group 32, fp16:
INT8 = 128 + 16 = 144 bytes (0.56x of fp16's 256), INT4 = 64 + 16 = 80 bytes (0.31x).

Error bound: for every element, ``|x - dequantize(quantize(x))| <= scale / 2`` where ``scale`` is the
stored (dtype-rounded) scale of its group, plus float32 arithmetic error (a few ulp) and the final
rounding of the result to ``x.dtype`` (half an ulp of the value). The zero point is the group minimum,
which is exactly representable in ``x.dtype``, and the stored scale is rounded *up*, so the group's
range always fits in ``2**bits - 1`` steps and nothing is clipped.

Limits: inputs must be finite (NaN / inf are not supported); quantization and packing are plain torch
ops (no fused kernel), so dequantizing INT4 costs a temporary copy of the unpacked codes (a byte per value)
besides its result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_SUPPORTED_BITS = (4, 8)
# Integer dtype of the same width, to step a float to its neighbour through its bit pattern.
_BITS_VIEW = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


def _next_up(t: torch.Tensor) -> torch.Tensor:
    """The next representable value above each element of ``t`` (finite, >= 0), in t's dtype.

    For non-negative IEEE floats the bit pattern grows with the value, so +1 on it is the next float
    up (0 -> smallest subnormal). Same as ``torch.nextafter(t, inf)``, which is not implemented for
    half types on every backend.
    """
    return (t.view(_BITS_VIEW[t.dtype]) + 1).view(t.dtype)


@dataclass(frozen=True)
class QuantSpec:
    """How to quantize: ``bits`` (8 or 4) and ``group_size`` channels per (scale, zero) pair."""

    bits: int
    group_size: int = 32

    def __post_init__(self) -> None:
        if self.bits not in _SUPPORTED_BITS:
            raise ValueError(f"bits must be one of {_SUPPORTED_BITS}, got {self.bits}")
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")

    def resolved(self, head_dim: int) -> QuantSpec:
        """The spec actually used for ``head_dim``: a group larger than head_dim shrinks to it.

        Raises ValueError when head_dim is not a multiple of group_size, or when INT4 meets an odd
        head_dim (two values per byte).
        """
        if head_dim < 1:
            raise ValueError(f"head_dim must be >= 1, got {head_dim}")
        group = min(self.group_size, head_dim)
        if head_dim % group:
            raise ValueError(f"head_dim {head_dim} is not divisible by group_size {self.group_size}")
        if self.bits == 4 and head_dim % 2:
            raise ValueError(f"INT4 packing needs an even head_dim, got {head_dim}")
        return self if group == self.group_size else QuantSpec(self.bits, group)


@dataclass
class PackedTensor:
    """A quantized ``(..., tokens, head_dim)`` tensor; see the module docstring for the layout.

    ``spec`` is the resolved spec (group_size <= head_dim). ``shape`` and ``dtype`` describe the
    original tensor, which ``dequantize`` restores.
    """

    data: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    shape: tuple[int, ...]
    dtype: torch.dtype
    spec: QuantSpec

    @property
    def nbytes(self) -> int:
        """Bytes really held: data + scale + zero (exactly the formula times the token count)."""
        return self.data.nbytes + self.scale.nbytes + self.zero.nbytes

    @property
    def device(self) -> torch.device:
        return self.data.device


def packed_bytes_per_token(head_dim: int, spec: QuantSpec, dtype: torch.dtype) -> int:
    """Bytes one token costs per leading index (e.g. per KV head):
    ``head_dim * bits / 8 + 2 * (head_dim / group_size) * itemsize``."""
    spec = spec.resolved(head_dim)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return head_dim * spec.bits // 8 + 2 * (head_dim // spec.group_size) * itemsize


def quantize(x: torch.Tensor, spec: QuantSpec) -> PackedTensor:
    """Quantize ``x`` (``(..., tokens, head_dim)``, floating point) group-wise along the last dim.

    Asymmetric min/max per (token, group): ``zero = min``, ``scale = (max - min) / (2**bits - 1)``
    rounded up to ``x.dtype``, ``q = clamp(round((x - zero) / scale), 0, 2**bits - 1)``. A constant
    group gets ``scale = 0`` and dequantizes exactly. Computed in float32; runs on x's device.
    """
    if x.dtype not in _BITS_VIEW:
        raise TypeError(f"quantize expects float16, bfloat16 or float32, got {x.dtype}")
    if x.dim() < 2:
        raise ValueError(f"quantize expects (..., tokens, head_dim), got shape {tuple(x.shape)}")
    head_dim = x.shape[-1]
    spec = spec.resolved(head_dim)
    levels = (1 << spec.bits) - 1
    n_groups = head_dim // spec.group_size

    xf = x.float().reshape(*x.shape[:-1], n_groups, spec.group_size)
    lo = xf.amin(dim=-1)  # exactly representable in x.dtype: it is one of x's values
    hi = xf.amax(dim=-1)
    zero = lo.to(x.dtype)
    scale_f = (hi - lo) / levels
    scale = scale_f.to(x.dtype)
    # Round the stored scale up so that levels * scale still covers the group's range.
    # (No .any() guard: it would force a device sync.)
    scale = torch.where(scale.float() < scale_f, _next_up(scale), scale)

    step = scale.float().unsqueeze(-1)
    # A constant group has step 0: divide by 1 instead, every code is 0 and zero is exact.
    safe_step = torch.where(step > 0, step, torch.ones_like(step))
    q = torch.round((xf - zero.float().unsqueeze(-1)) / safe_step).clamp_(0, levels)
    q = q.to(torch.uint8).reshape(x.shape)
    if spec.bits == 4:
        q = q[..., 0::2] | (q[..., 1::2] << 4)
    return PackedTensor(
        data=q.contiguous(),
        scale=scale,
        zero=zero,
        shape=tuple(x.shape),
        dtype=x.dtype,
        spec=spec,
    )


def _unpack(p: PackedTensor) -> torch.Tensor:
    """The integer codes as uint8, shaped like the original tensor."""
    if p.spec.bits == 8:
        return p.data
    low = p.data & 0x0F
    high = p.data >> 4
    return torch.stack((low, high), dim=-1).reshape(*p.data.shape[:-1], p.data.shape[-1] * 2)


def dequantize(p: PackedTensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Back to ``p.dtype`` and ``p.shape`` on ``p``'s device: ``code * scale + zero``, rounded once; written into
    ``out`` when given (shaped ``p.shape``, ``p.dtype``, its last dim contiguous: e.g. a slice of a larger buffer).

    One ``addcmul`` reads the uint8 codes as they are (type promotion: integers up to 255 are exact in every float
    dtype) and computes every group's product and sum in float32 (PyTorch's op math for half types), rounding
    once: the result is the float32 computation rounded to ``p.dtype``, with no float32 copy of the tensor. One
    kernel for INT8, four for INT4 (the nibbles unpacked first), against six and nine for a float32 chain.
    """
    head_dim = p.shape[-1]
    n_groups = head_dim // p.spec.group_size
    codes = _unpack(p).view(*p.shape[:-1], n_groups, p.spec.group_size)
    target = None if out is None else out.view(codes.shape)
    return torch.addcmul(p.zero.unsqueeze(-1), codes, p.scale.unsqueeze(-1), out=target).view(p.shape)


def dequantize_all(parts: list[PackedTensor], tail: torch.Tensor | None = None, dim_tokens: int = -2) -> torch.Tensor:
    """Every packed tensor of `parts` dequantized, in order along ``dim_tokens``, then `tail` (a tensor of the same
    dtype and other dims) when given: one buffer written in place by `dequantize`, no concatenation after."""
    first = parts[0]
    dim = _token_dim(first, dim_tokens)
    sizes = [p.shape[dim] for p in parts]
    shape = list(first.shape)
    shape[dim] = sum(sizes) + (tail.shape[dim] if tail is not None else 0)
    out = torch.empty(shape, dtype=first.dtype, device=first.device)
    start = 0
    for p, size in zip(parts, sizes, strict=True):
        dequantize(p, out=out.narrow(dim, start, size))
        start += size
    if tail is not None:
        out.narrow(dim, start, tail.shape[dim]).copy_(tail)
    return out


def _token_dim(p: PackedTensor, dim: int) -> int:
    """Normalise ``dim`` to a negative index valid for data, scale and zero alike."""
    ndim = len(p.shape)
    neg = dim - ndim if dim >= 0 else dim
    if not -ndim <= neg <= -2:
        raise ValueError(f"cannot concatenate along dim {dim} of a {ndim}-d packed tensor")
    return neg
