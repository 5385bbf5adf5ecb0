"""Attention of a block of new tokens after cached entries, without expanding K/V to every query head.

A block after a cache always takes a lower-right causal mask. Given a tensor mask, transformers' SDPA function
repeats K/V to every query head and CUDA takes no flash kernel, so the engine hands attention an `AfterCache`
marker (in the layer call's step, `visualkv.attention.step`) and `attend` picks per call: "flash" (CUDA 16-bit:
PyTorch's lower-right `CausalBias` with `enable_gqa`, no mask, no copy), "gqa" (other devices: a dense bool mask
with `enable_gqa`), or "stock" (CUDA without flash: transformers' own function). The CUDA choice is checked once per device, dtype and geometry against the stock function
(`_agrees`); a kernel that fails or disagrees is never used for that key again.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

#: relative tolerance of the CUDA agreement check, as a fraction of the reference output's largest magnitude
#: (two exact kernels in bfloat16 differ by a few output roundings: 2^-8 each)
AGREEMENT_TOLERANCE = 2e-2


@dataclass(eq=False)  # holds tensors: compared by identity
class AfterCache:
    """The mask of `q` new tokens after every older entry the keys hold: all older entries visible, the block
    causal. Relative to the keys' width, so it also holds when packed segments are prepended to the keys."""

    q: int
    _dense: dict = field(default_factory=dict, repr=False)  # (width, device) -> bool mask, built once per block

    def dense(self, width: int, device: torch.device) -> torch.Tensor:
        """The (1, 1, q, width) bool mask (True: attend) on `device`."""
        key = (width, device)
        if key not in self._dense:
            allowed = torch.ones((self.q, width), dtype=torch.bool, device=device)
            allowed[:, width - self.q :] = torch.ones((self.q, self.q), dtype=torch.bool, device=device).tril()
            self._dense[key] = allowed[None, None]
        return self._dense[key]

    def additive(self, width: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """The same mask, additive in `dtype` (0: attend, the dtype's minimum: not), for eager attention."""
        key = (width, device, dtype)
        if key not in self._dense:
            allowed = self.dense(width, device)
            self._dense[key] = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(
                ~allowed, torch.finfo(dtype).min
            )
        return self._dense[key]


def kernel_for(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """The kernel `attend` is expected to take ("flash", "gqa" or "stock"), from the device, dtype and head size
    alone (the memory guard's estimate; `attend` itself also asks PyTorch and checks agreement on CUDA)."""
    if device.type != "cuda":
        return "gqa"
    if dtype in (torch.float16, torch.bfloat16) and head_dim <= 256:
        return "flash"
    return "stock"


def attend(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: AfterCache,
    stock: Callable,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract for a block after cached entries: query (b, H, q, d), key /
    value (b, Hkv, n, d); returns ((b, q, H, d), None). `stock` is transformers' own function (the fallback)."""
    kernel = _kernel(query, key, value, stock, module, kwargs)
    kernels = getattr(_used, "kernels", None)
    if kernels is not None:
        kernels.add(kernel)
    if kernel == "stock":
        return stock(module, query, key, value, mask.dense(key.shape[2], key.device), **kwargs)
    return _direct(kernel, query, key, value, mask, kwargs.get("scaling"), kwargs.get("dropout", 0.0)), None


def _direct(kernel: str, query, key, value, mask: AfterCache, scaling, dropout: float) -> torch.Tensor:
    width = key.shape[2]
    bias = causal_lower_right(mask.q, width) if kernel == "flash" else mask.dense(width, key.device)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=bias, dropout_p=dropout, scale=scaling, enable_gqa=query.shape[1] != key.shape[1]
    )
    return out.transpose(1, 2).contiguous()


_used = threading.local()  # .kernels: the kernels `attend` ran in this thread since `recording` began


@contextlib.contextmanager
def recording() -> Iterator[set[str]]:
    """Within: the kernels `attend` runs in this thread are added to the yielded set (a turn's report says which
    ran: "flash", "gqa" or "stock"; a host-side set, nothing read from the device)."""
    previous = getattr(_used, "kernels", None)
    _used.kernels = kernels = set()
    try:
        yield kernels
    finally:
        _used.kernels = previous


_CUDA_KERNEL: dict[tuple, str] = {}  # (device, dtype, heads, kv heads, head dim) -> the kernel that agreed


def _kernel(query, key, value, stock: Callable, module, kwargs) -> str:
    if not query.is_cuda:
        return "gqa"
    geometry = (query.device, query.dtype, query.shape[1], key.shape[1], query.shape[-1])
    if geometry not in _CUDA_KERNEL:
        _CUDA_KERNEL[geometry] = (
            "flash" if _flash_eligible(query, key, value) and _agrees(geometry, stock, module, kwargs) else "stock"
        )
    return _CUDA_KERNEL[geometry]


def _flash_eligible(query, key, value) -> bool:
    """PyTorch's own test (host checks only) for its flash kernel on these inputs, with GQA and no mask."""
    try:
        from torch.backends.cuda import SDPAParams, can_use_flash_attention

        return bool(can_use_flash_attention(SDPAParams(query, key, value, None, 0.0, False, True), False))
    except (ImportError, RuntimeError, TypeError):
        return False


def _agrees(geometry: tuple, stock: Callable, module, kwargs) -> bool:
    """Run the flash path and transformers' function on a small random block after cached entries of this
    geometry and compare (once per geometry; it reads the device to compare, the only host sync here)."""
    device, dtype, heads, kv_heads, head_dim = geometry
    generator = torch.Generator(device=device).manual_seed(0)
    q, n = 5, 19

    def rand(h: int, length: int) -> torch.Tensor:
        return torch.randn(1, h, length, head_dim, device=device, dtype=dtype, generator=generator)

    query, key, value = rand(heads, q), rand(kv_heads, n), rand(kv_heads, n)
    mask = AfterCache(q)
    try:
        got = _direct("flash", query, key, value, mask, kwargs.get("scaling"), 0.0)
        want = stock(module, query, key, value, mask.dense(n, device), **{**kwargs, "dropout": 0.0})[0]
    except (RuntimeError, TypeError, NotImplementedError, ValueError):
        return False
    error = (got.float() - want.float()).abs().max()
    return bool(error <= AGREEMENT_TOLERANCE * want.float().abs().max())
