"""A block after cached entries attends without expanding K/V (visualkv.attention.block).

The engine's exactness against transformers' own forward (tests/test_invariants.py) covers the results end to
end; here: the kernels agree with transformers' function on their own, the lower-right orientation, the
fallback when a kernel disagrees, and that no prefill or follow-up turn expands K/V any more (`repeat_kv`).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.integrations import sdpa_attention
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from visualkv.attention import block as block_attention
from visualkv.attention.block import AfterCache, attend
from visualkv.runtime.session import ChatSession, SessionConfig

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 16


def _module(heads: int = HEADS, kv_heads: int = KV_HEADS) -> SimpleNamespace:
    return SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True, training=False)


def _inputs(q: int, n: int, dtype=torch.float32, device="cpu", heads=HEADS, kv_heads=KV_HEADS):
    gen = torch.Generator(device=device).manual_seed(1)

    def rand(h: int, length: int) -> torch.Tensor:
        return torch.randn(1, h, length, HEAD_DIM, generator=gen, device=device, dtype=dtype)

    return rand(heads, q), rand(kv_heads, n), rand(kv_heads, n)


def _stock(query, key, value, mask: AfterCache):
    """transformers' own function with the dense mask: it repeats K/V to every query head."""
    return sdpa_attention_forward(
        _module(query.shape[1], key.shape[1]), query, key, value, mask.dense(key.shape[2], key.device)
    )[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_kernel_matches_transformers_sdpa(dtype):
    query, key, value = _inputs(7, 30, dtype)
    mask = AfterCache(7)
    got, _ = attend(_module(), query, key, value, mask, sdpa_attention_forward, scaling=HEAD_DIM**-0.5)
    torch.testing.assert_close(
        got, _stock(query, key, value, mask), rtol=0, atol=1e-5 if dtype == torch.float32 else 1e-2
    )


def test_dense_mask_is_lower_right_causal():
    allowed = AfterCache(3).dense(5, torch.device("cpu"))[0, 0]
    expected = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(allowed, expected)
    additive = AfterCache(3).additive(5, torch.device("cpu"), torch.float32)[0, 0]
    assert torch.equal(additive == 0, expected)


def test_flash_path_is_lower_right_causal_on_any_device():
    """The CUDA path (PyTorch's lower-right CausalBias) run where it materialises its mask: the same outputs,
    which fails if the bias were aligned to the upper left (the block's first token would see one cached entry)."""
    query, key, value = _inputs(6, 20)
    mask = AfterCache(6)
    got = block_attention._direct("flash", query, key, value, mask, HEAD_DIM**-0.5, 0.0)
    torch.testing.assert_close(got, _stock(query, key, value, mask), rtol=0, atol=1e-5)


def test_agreement_check_refuses_a_disagreeing_kernel(monkeypatch):
    geometry = (torch.device("cpu"), torch.float32, HEADS, KV_HEADS, HEAD_DIM)
    assert block_attention._agrees(geometry, sdpa_attention_forward, _module(), {"scaling": HEAD_DIM**-0.5})

    def wrong(module, query, key, value, mask, **kwargs):  # a kernel with the upper-left alignment
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None

    assert not block_attention._agrees(geometry, wrong, _module(), {"scaling": HEAD_DIM**-0.5})


def test_a_failing_flash_check_falls_back_to_transformers(monkeypatch):
    """On CUDA a kernel that disagrees (or raises) is never used: `attend` then runs transformers' function."""
    query, key, value = _inputs(4, 12)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(block_attention, "_flash_eligible", lambda *a: True)
    monkeypatch.setattr(block_attention, "_agrees", lambda *a: False)
    monkeypatch.setattr(block_attention, "_CUDA_KERNEL", {})
    calls = []

    def stock(module, q, k, v, mask, **kwargs):
        calls.append(mask)
        return sdpa_attention_forward(module, q, k, v, mask, **kwargs)

    with block_attention.recording() as kernels:
        attend(_module(), query, key, value, AfterCache(4), stock)
    assert kernels == {"stock"}
    assert len(calls) == 1 and calls[0].dtype == torch.bool and calls[0].shape[-1] == 12
    assert set(block_attention._CUDA_KERNEL.values()) == {"stock"}


@pytest.fixture
def count_repeat_kv(monkeypatch):
    calls = []
    original = sdpa_attention.repeat_kv

    def counting(hidden, n_rep):
        calls.append(hidden.shape)
        return original(hidden, n_rep)

    monkeypatch.setattr(sdpa_attention, "repeat_kv", counting)
    return calls


@pytest.mark.parametrize("method", ["full", "blockwise-keydiff", "salicache"])
def test_no_prefill_or_follow_up_expands_kv(count_repeat_kv, adapter, small_image, method):
    """Every block after the first (and the follow-up question) has a cache: with a tensor mask transformers
    would have repeated its K/V to every query head, in every layer. Sali-Cache's blocks also read packed
    INT8 / INT4 segments."""
    assert adapter.text_config.num_attention_heads != adapter.num_kv_heads  # the tiny models use GQA
    options = {"tiers": "0.4,0.3,0.2", "flow_threshold": 0.0} if method == "salicache" else {}
    config = SessionConfig(
        method=method, budget=32, block_size=16, max_new_tokens=2, prefill="blockwise", method_options=options
    )
    session = ChatSession(adapter, config)
    first = session.ask("What is shown?", small_image)
    followup = session.ask("And the colours?")
    assert count_repeat_kv == []
    assert first.prefill_attention == followup.prefill_attention == "gqa"  # what ran, in the turn's report


def test_a_single_block_reports_no_block_attention(small_image):
    """A bulk prefill's one block has no cache before it (the kernel's causal flag, no marker): nothing to report."""
    from tests.conftest import get_adapter

    session = ChatSession(
        get_adapter("tiny-qwen2.5-vl"), SessionConfig(method="full", prefill="bulk", max_new_tokens=2)
    )
    assert session.ask("What is shown?", small_image).prefill_attention == ""
    assert session.report()["turns"][0]["prefill_attention"] == ""


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none")
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(28, 4, 128), (32, 32, 64), (16, 2, 128)])
def test_flash_kernel_agrees_and_is_chosen_on_cuda(heads, kv_heads, head_dim):
    """Qwen2.5-VL-7B's, SmolVLM2-2.2B's and Qwen2.5-VL-3B's attention geometries in bf16: the lower-right flash
    path is chosen (the agreement check passed) and agrees with transformers' function on a 512-token block
    after 4,096 entries; its peak is below the K/V `repeat_kv` alone would copy."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, n = 512, 4096 + 512

    def rand(h: int, length: int) -> torch.Tensor:
        return torch.randn(1, h, length, head_dim, generator=gen, device="cuda", dtype=torch.bfloat16)

    query, key, value = rand(heads, q), rand(kv_heads, n), rand(kv_heads, n)
    module, mask = _module(heads, kv_heads), AfterCache(q)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    got, _ = attend(module, query, key, value, mask, sdpa_attention_forward, scaling=head_dim**-0.5)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    geometry = (query.device, torch.bfloat16, heads, kv_heads, head_dim)
    assert block_attention._CUDA_KERNEL[geometry] == "flash"
    want = _stock(query, key, value, mask)
    assert (got.float() - want.float()).abs().max() <= block_attention.AGREEMENT_TOLERANCE * want.float().abs().max()
    if heads != kv_heads:
        assert peak < 2 * heads * n * head_dim * 2  # what repeating K/V to every query head alone would hold


def test_working_bytes_count_no_expansion_where_the_kernel_makes_none(adapter):
    """The memory guard's attention term follows the kernel: a block after cached entries holds its mask and
    SDPA's additive copy of it on a CPU, nothing over the keys with CUDA's flash, K/V repeated where it falls back."""
    from visualkv.runtime.plan import attention_working_bytes

    q, n, dtype = 64, 1024, torch.float32
    mask = q * n * (1 + dtype.itemsize)
    assert attention_working_bytes(adapter, q, n, False, dtype) == mask
    assert attention_working_bytes(adapter, q, n, True, dtype) == 0
    assert block_attention.kernel_for(torch.device("cuda"), torch.bfloat16, 128) == "flash"
    assert block_attention.kernel_for(torch.device("cuda"), torch.float32, 128) == "stock"
    assert block_attention.kernel_for(torch.device("cpu"), torch.bfloat16, 128) == "gqa"


def test_eager_attention_takes_the_markers_additive_mask(small_image):
    """Under eager attention the marker becomes the model file's additive mask: block-wise prefill and a follow-up
    give sdpa's logits (sdpa here attends with `enable_gqa`, eager with K/V repeated)."""
    from tests.conftest import get_adapter
    from visualkv.models.registry import _adapter
    from visualkv.models.synthetic.tiny import build_tiny

    eager = _adapter(*build_tiny("tiny-qwen2.5-vl", seed=0, attn_implementation="eager"), "tiny-qwen2.5-vl")
    logits = []
    for adapter in (get_adapter("tiny-qwen2.5-vl"), eager):
        config = SessionConfig(
            method="blockwise-keydiff", budget=48, block_size=16, prefill="blockwise", max_new_tokens=3, decode="eager"
        )
        session = ChatSession(adapter, config)
        seen: list[torch.Tensor] = []
        session._sample = lambda lg, gen, seen=seen, sample=session._sample: seen.append(lg.clone()) or sample(lg, gen)
        session.ask("What is shown?", small_image)
        session.ask("And the colours?")
        logits.append(torch.stack(seen))
    assert eager.text_config._attn_implementation == "eager"  # the model's own again after the turns
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-4)
