"""Packed KV quantization: error bound, exact byte accounting, nibble layout, in-place dequantization."""

from __future__ import annotations

import pytest
import torch

from visualkv.kv.quant import (
    PackedTensor,
    QuantSpec,
    _next_up,
    dequantize,
    packed_bytes_per_token,
    quantize,
)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BITS = (8, 4)


def _tolerance(x: torch.Tensor, p: PackedTensor) -> torch.Tensor:
    """scale/2 of each element's group + the final rounding to x.dtype + float32 slack."""
    group = p.spec.group_size
    half_step = (p.scale.float() / 2).repeat_interleave(group, dim=-1)
    eps = torch.finfo(x.dtype).eps
    return half_step + eps * x.float().abs() + 1e-6 * (1 + x.float().abs())


def _inputs(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shape = (2, 3, 17, 64)
    randn = torch.randn(shape, generator=g)
    constant = torch.full(shape, 0.3)
    constant[..., 32:] = -7.0  # every group constant, two different constants
    outliers = randn.clone() * 0.01
    outliers[..., ::13] = 300.0  # one huge channel per group dominates the range
    outliers[0, 0, 0, 5] = -250.0
    # Narrow range far from zero: scale / zero rounding matters in fp16.
    tiny = randn * 1e-3 + 5.0
    mixed = torch.cat((constant[..., :32], randn[..., 32:]), dim=-1)
    return {
        name: t.to(dtype)
        for name, t in {
            "randn": randn,
            "constant": constant,
            "outliers": outliers,
            "tiny": tiny,
            "mixed": mixed,
        }.items()
    }


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
def test_round_trip_error_within_half_step(dtype: torch.dtype, bits: int) -> None:
    spec = QuantSpec(bits=bits, group_size=32)
    for name, x in _inputs(dtype).items():
        p = quantize(x, spec)
        y = dequantize(p)
        assert y.dtype == dtype and y.shape == x.shape, name
        assert p.scale.dtype == dtype and p.zero.dtype == dtype, name
        err = (x.float() - y.float()).abs()
        assert bool((err <= _tolerance(x, p)).all()), (name, float(err.max()))
        assert torch.isfinite(y).all(), name


@pytest.mark.parametrize("bits", BITS)
def test_constant_groups_are_exact(bits: int) -> None:
    x = _inputs(torch.float16)["constant"]
    p = quantize(x, QuantSpec(bits))
    assert torch.equal(dequantize(p), x)
    assert bool((p.scale == 0).all())


def test_error_shrinks_with_bits() -> None:
    x = torch.randn(4, 8, 128, 128, generator=torch.Generator().manual_seed(1))
    err8 = (dequantize(quantize(x, QuantSpec(8))) - x).abs().mean()
    err4 = (dequantize(quantize(x, QuantSpec(4))) - x).abs().mean()
    assert err8 < err4 / 10


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group", (32, 64, 128, 16))
def test_nbytes_is_the_formula(dtype: torch.dtype, bits: int, group: int) -> None:
    batch, heads, tokens, head_dim = 2, 4, 11, 64
    x = torch.randn(batch, heads, tokens, head_dim).to(dtype)
    p = quantize(x, QuantSpec(bits, group))
    per_token = packed_bytes_per_token(head_dim, QuantSpec(bits, group), dtype)
    eff_group = min(group, head_dim)
    itemsize = x.element_size()
    assert per_token == head_dim * bits // 8 + 2 * (head_dim // eff_group) * itemsize
    assert p.nbytes == per_token * batch * heads * tokens
    assert p.data.dtype == torch.uint8


def test_int4_data_is_half_of_int8() -> None:
    x = torch.randn(1, 2, 33, 128, dtype=torch.float16)
    p8, p4 = quantize(x, QuantSpec(8)), quantize(x, QuantSpec(4))
    assert p4.data.nbytes * 2 == p8.data.nbytes == x.numel()
    assert p4.scale.nbytes == p8.scale.nbytes
    # 128 channels, fp16: INT8 144 B/token, INT4 80 B/token vs 256 B unquantized.
    assert packed_bytes_per_token(128, QuantSpec(8), torch.float16) == 144
    assert packed_bytes_per_token(128, QuantSpec(4), torch.float16) == 80


def test_int4_nibble_layout_by_hand() -> None:
    # One group of 4 channels: min 0, max 15 -> scale 1, codes equal the values.
    x = torch.tensor([[[0.0, 15.0, 3.0, 10.0]]])
    p = quantize(x, QuantSpec(4, group_size=4))
    assert p.data.tolist() == [[[0x0 | (0xF << 4), 0x3 | (0xA << 4)]]]
    assert p.scale.tolist() == [[[1.0]]] and p.zero.tolist() == [[[0.0]]]
    assert torch.equal(dequantize(p), x)
    p8 = quantize(x, QuantSpec(8, group_size=4))
    assert p8.data.tolist() == [[[0, 255, 51, 170]]]  # scale 15/255 = 1/17


def test_group_size_fallback_and_errors() -> None:
    x = torch.randn(1, 1, 3, 16)
    p = quantize(x, QuantSpec(8, group_size=64))  # larger than head_dim: one group
    assert p.spec.group_size == 16 and p.scale.shape == (1, 1, 3, 1)
    with pytest.raises(ValueError):
        quantize(torch.randn(1, 1, 3, 48), QuantSpec(8, group_size=32))
    with pytest.raises(ValueError):  # odd head_dim cannot pack two INT4 values per byte
        quantize(torch.randn(1, 1, 3, 7), QuantSpec(4, group_size=7))
    with pytest.raises(ValueError):
        QuantSpec(bits=3)
    with pytest.raises(ValueError):
        QuantSpec(bits=8, group_size=0)
    with pytest.raises(TypeError):
        quantize(torch.ones(1, 2, 32, dtype=torch.int32), QuantSpec(8))
    with pytest.raises(TypeError):
        quantize(torch.ones(1, 2, 32, dtype=torch.float64), QuantSpec(8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_next_up_matches_nextafter(dtype: torch.dtype) -> None:
    t = torch.tensor([0.0, 1e-8, 0.1, 1.0, 3.3, 6e4], dtype=torch.float32).to(dtype)
    expected = torch.nextafter(t, torch.full_like(t, float("inf")))
    assert torch.equal(_next_up(t), expected)


@pytest.mark.parametrize("bits", BITS)
def test_empty_tokens(bits: int) -> None:
    x = torch.empty(1, 2, 0, 64, dtype=torch.float16)
    p = quantize(x, QuantSpec(bits))
    assert p.nbytes == 0 and p.shape[-2] == 0
    assert dequantize(p).shape == (1, 2, 0, 64)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("bits", BITS)
def test_cuda_matches_cpu(bits: int) -> None:
    x = torch.randn(2, 4, 19, 128, dtype=torch.float16)
    spec = QuantSpec(bits)
    p_cpu, p_gpu = quantize(x, spec), quantize(x.cuda(), spec)
    assert p_gpu.data.is_cuda and p_gpu.scale.is_cuda
    assert torch.equal(p_gpu.data.cpu(), p_cpu.data)
    assert torch.equal(dequantize(p_gpu).cpu(), dequantize(p_cpu))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_dequantize_rounds_once_without_a_float32_copy(bits: int, dtype: torch.dtype) -> None:
    """code * scale + zero computed exactly (float64) and rounded once to the dtype (float32: within one ulp, a
    fused multiply-add may round differently); for half types no operation makes a float32 tensor."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from visualkv.kv.quant import _unpack

    class FloatOutputs(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.float32 = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.numel() > 1:
                self.float32.append(str(func))
            return out

    x = (torch.randn(2, 3, 50, 64, generator=torch.Generator().manual_seed(bits)) * 3 + 1).to(dtype)
    p = quantize(x, QuantSpec(bits))
    watch = FloatOutputs()
    with watch:
        y = dequantize(p)
    codes = _unpack(p).double().view(2, 3, 50, 2, 32)
    exact = (codes * p.scale.double().unsqueeze(-1) + p.zero.double().unsqueeze(-1)).view(x.shape)
    assert y.dtype == dtype and y.shape == x.shape
    if dtype == torch.float32:
        assert torch.allclose(y.double(), exact, rtol=2**-23, atol=0)
    else:
        assert torch.equal(y, exact.to(dtype)) and not watch.float32


@pytest.mark.parametrize("bits", [8, 4])
def test_dequantize_writes_into_a_slice_of_a_larger_buffer(bits: int) -> None:
    """out=: what packed attention uses to dequantize every segment into one buffer (no concatenation after)."""
    p = quantize(torch.randn(1, 2, 9, 32, generator=torch.Generator().manual_seed(3)), QuantSpec(bits))
    buffer = torch.full((1, 2, 14, 32), 7.0)
    written = dequantize(p, out=buffer[:, :, 3:12])
    assert written.data_ptr() == buffer[:, :, 3:12].data_ptr()
    assert torch.equal(buffer[:, :, 3:12], dequantize(p))
    assert (buffer[:, :, :3] == 7).all() and (buffer[:, :, 12:] == 7).all()


def test_dequantize_all_is_the_concatenation_written_in_place() -> None:
    """dequantize_all(parts, tail): the same values as concatenating each part's dequantization and the tail."""
    from visualkv.kv.quant import dequantize_all

    gen = torch.Generator().manual_seed(5)
    parts = [quantize(torch.randn(1, 2, n, 32, generator=gen), QuantSpec(bits)) for n, bits in ((4, 8), (6, 4))]
    tail = torch.randn(1, 2, 3, 32, generator=gen)
    want = torch.cat([dequantize(p) for p in parts] + [tail], dim=2)
    assert torch.equal(dequantize_all(parts, tail), want)
    assert torch.equal(dequantize_all(parts), want[:, :, :10])
    with pytest.raises(ValueError, match="cannot concatenate along dim -1"):
        dequantize_all(parts, dim_tokens=-1)  # head_dim is packed: not a token axis
