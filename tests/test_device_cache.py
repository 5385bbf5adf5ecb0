"""Issue 11: the device-built cache (in-place appends and eviction, exact bytes), Sali-Cache's dequantized
view (no dequantization per decode step) and incremental detokenization."""

from __future__ import annotations

import torch

from tests.conftest import get_adapter
from visualkv import cache as cache_module
from visualkv.bench.synthetic import video_media
from visualkv.cache import TIER_FULL, TIER_INT8, CompressibleCache, split_tiers
from visualkv.detokenize import IncrementalDetokenizer
from visualkv.session import ChatSession, SessionConfig


def _kv(q: int, seed: int, heads: int = 2, dim: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, heads, q, dim, generator=g), torch.randn(1, heads, q, dim, generator=g)


def test_appends_write_in_place_and_read_views():
    cache = CompressibleCache(1)
    cache.set_capacity_hint(64)
    k0, v0 = _kv(10, 0)
    cache.pending_token_index = torch.arange(10)
    out_k, _ = cache.update(k0, v0, 0)
    layer = cache.layers[0]
    ptr = layer.keys.data_ptr()
    for step in range(5):  # decode-like steps: one entry each
        k, v = _kv(1, step + 1)
        cache.pending_token_index = torch.tensor([10 + step])
        out_k, out_v = cache.update(k, v, 0)
        assert out_k.data_ptr() == ptr  # a view of the same buffer: nothing was reallocated or concatenated
        assert torch.equal(out_k[:, :, -1:], k) and torch.equal(out_v[:, :, -1:], v)
    assert torch.equal(layer.keys[:, :, :10], k0)
    assert layer.token_index[0, 0].tolist() == list(range(15))
    # bytes: entries held vs the buffer really allocated (capacity 64)
    entry = 2 * 2 * 8 * 4  # K + V, 2 heads, head_dim 8, float32
    assert layer.kv_bytes() == 15 * entry == layer.keys.nbytes + layer.values.nbytes
    assert layer.allocated_bytes() == 64 * entry
    assert cache.peak_device_bytes >= cache.allocated_bytes() >= cache.kv_bytes()


def test_growth_is_geometric_and_counted():
    cache = CompressibleCache(1)
    layer = cache.layers[0]
    sizes = []
    for step in range(40):
        k, v = _kv(16, step)
        cache.pending_token_index = torch.arange(16) + 16 * step
        cache.update(k, v, 0)
        sizes.append(layer._rows.capacity)
    assert len(set(sizes)) < 15  # not one reallocation per append
    assert layer.n_full == 640 and sizes[-1] >= 640
    assert cache.peak_device_bytes > cache.allocated_bytes()  # a growth held old + new buffers at once


def test_eviction_compacts_in_place():
    cache = CompressibleCache(1)
    cache.set_capacity_hint(32)
    k, v = _kv(12, 3)
    cache.pending_token_index = torch.arange(12)
    cache.update(k, v, 0)
    layer = cache.layers[0]
    ptr = layer.keys.data_ptr()
    keep = torch.tensor([[[11, 0, 5, 7], [1, 2, 3, 10]]])  # per head, unsorted
    layer.keep_full(keep)
    want = keep.sort(dim=-1).values
    assert layer.keys.data_ptr() == ptr and layer.n_full == 4
    for h in range(2):
        assert torch.equal(layer.keys[0, h], k[0, h, want[0, h]])
        assert torch.equal(layer.values[0, h], v[0, h, want[0, h]])
        assert layer.token_index[0, h].tolist() == want[0, h].tolist()


def test_split_tiers_is_host_side():
    assert split_tiers(None) is None and split_tiers(torch.zeros(5, dtype=torch.long)) is None
    split = split_tiers(torch.tensor([0, 1, 0, 1]))
    assert split[TIER_FULL].tolist() == [0, 2] and split[TIER_INT8].tolist() == [1, 3]


def test_salicache_decode_dequantizes_once(monkeypatch):
    """Packed tiers are dequantized once into a view, not at every decode step (per layer)."""
    adapter = get_adapter("tiny-qwen2.5-vl")
    calls = []
    real = cache_module.dequantize
    monkeypatch.setattr(cache_module, "dequantize", lambda p: calls.append(1) or real(p))
    session = ChatSession(adapter, SessionConfig(method="salicache", max_new_tokens=6))
    session.ask("What moves?", video_media(4, 224, 168, fps=1.0, seed=3))
    cache = session.cache
    segments = sum(len(layer.quant) for layer in cache.layers)
    assert segments > 0
    assert len(calls) == 2 * segments  # K and V of every segment, once, however many tokens were decoded
    assert cache.dequant_bytes() > 0 and cache.allocated_bytes() >= cache.kv_bytes() + cache.dequant_bytes()
    # the view holds exactly the dequantized packed entries
    layer = cache.layers[0]
    front = layer._rows.view(0)[:, :, : layer._front]
    want = torch.cat([real(seg.keys) for seg in layer.quant.values()], dim=-2)
    assert torch.equal(front, want)


def test_incremental_detokenizer_matches_full_decode():
    tok = get_adapter("tiny-qwen2.5-vl").tokenizer
    text = "Zwei Äpfel, 三个苹果 and 🍎🍏 — naïve café ... done."
    ids = tok(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(i) for i in ids]
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True) == detok.text
    assert all("\ufffd" not in p for p in pieces)
    assert sum(1 for p in pieces if p) > len(ids) // 3  # streamed as it goes, not all at the end


def test_decoding_never_grows_a_buffer():
    """The first allocation leaves room for the answer: a bulk prefill + decode allocates once per layer."""
    adapter = get_adapter("tiny-qwen2.5-vl")
    session = ChatSession(adapter, SessionConfig(method="full", max_new_tokens=7))
    session.ask("Hi there?")
    for layer in session.cache.layers:
        assert layer._rows.capacity == session.prepared.seq_len + 8  # prompt + max_new_tokens + 1, never grown
        assert layer.n_full == session.prepared.seq_len + len(session.turns[-1].token_ids) - 1
