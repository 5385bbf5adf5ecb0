"""Batched chunk attention in the Qwen vision towers (visualkv.attention.vision), inside `patched`.

Same output as transformers' per-chunk loop on the untouched model (images with interior and edge windows, videos
of several temporal patches, SDPA and eager attention), in far fewer attention calls.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import get_adapter
from visualkv.attention import patched
from visualkv.bench.synthetic import image_media, video_media


@pytest.fixture
def sdpa_calls(monkeypatch):
    calls = []
    original = F.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counting)
    return calls


def _encode(adapter, media, stock: bool, calls: list) -> tuple[torch.Tensor, int]:
    prepared = adapter.prepare(media, "What is in it?")
    adapter.reset_stream()
    calls.clear()
    with torch.no_grad(), contextlib.nullcontext() if stock else patched(adapter):
        out, per_layer = adapter.encode_units_with_layer_features(prepared, prepared.layout.units)
    adapter.reset_stream()
    return torch.cat([out, *per_layer]) if per_layer else out, len(calls)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["image", "video"])
@pytest.mark.parametrize("alias", ["tiny-qwen2.5-vl", "tiny-qwen3-vl"])
def test_batched_chunks_match_transformers_loop(alias, kind, attention, sdpa_calls, monkeypatch):
    adapter = get_adapter(alias)
    monkeypatch.setattr(adapter.visual.config, "_attn_implementation", attention)
    # 1000 x 700: interior windows and narrower edge windows (several chunk lengths in one layer)
    media = image_media(1000, 700, seed=1) if kind == "image" else video_media(8, 320, 240, fps=1.0, seed=2)
    batched, batched_calls = _encode(adapter, media, stock=False, calls=sdpa_calls)
    stock, stock_calls = _encode(adapter, media, stock=True, calls=sdpa_calls)
    assert batched.shape == stock.shape
    torch.testing.assert_close(batched, stock, rtol=0, atol=1e-6)  # float32: the same sums per chunk
    if attention == "sdpa":
        assert batched_calls <= stock_calls
        if alias == "tiny-qwen2.5-vl" or kind == "video":  # several chunks per layer: one call per chunk length
            assert batched_calls * 4 <= stock_calls


def test_the_batched_path_lives_inside_patched_only(sdpa_calls):
    """Outside `patched` the tower runs transformers' own loop (no forward of ours left on a module), inside it
    the batched chunks, as often as it is entered."""
    adapter = get_adapter("tiny-qwen2.5-vl")
    media = image_media(1000, 700, seed=1)
    stock = _encode(adapter, media, stock=True, calls=sdpa_calls)[1]
    batched = _encode(adapter, media, stock=False, calls=sdpa_calls)[1]
    assert _encode(adapter, media, stock=True, calls=sdpa_calls)[1] == stock > batched
    assert _encode(adapter, media, stock=False, calls=sdpa_calls)[1] == batched
    assert not any("forward" in vars(m) for m in adapter.visual.modules())


@pytest.mark.parametrize("alias", ["tiny-qwen2.5-vl", "tiny-qwen3-vl"])
def test_chunks_split_over_several_calls_match(alias, sdpa_calls, monkeypatch):
    """More chunks of one length than one call takes (CUDA's grid limit): the batch is split, output unchanged."""
    from visualkv.attention import vision as vision_attention

    adapter = get_adapter(alias)
    media = video_media(8, 320, 240, fps=1.0, seed=2)  # equal chunks tiling the sequence, and windows
    whole, calls_whole = _encode(adapter, media, stock=False, calls=sdpa_calls)
    monkeypatch.setattr(vision_attention, "MAX_CHUNKS_PER_CALL", 2)
    split, calls_split = _encode(adapter, media, stock=False, calls=sdpa_calls)
    chunks_per_call = max(shape[0] for shape in sdpa_calls)  # q is (chunks, heads, length, head_dim)
    stock, _ = _encode(adapter, media, stock=True, calls=sdpa_calls)
    assert calls_split > calls_whole and chunks_per_call <= 2
    torch.testing.assert_close(split, stock, rtol=0, atol=1e-6)
    torch.testing.assert_close(whole, stock, rtol=0, atol=1e-6)
