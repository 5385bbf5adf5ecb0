"""One attention call per layer in the Qwen vision towers (visualkv.attention.vision), inside `patched`.

Same output as transformers' per-chunk loop on the untouched model (images with interior and edge windows, several
images of different sizes, videos of several temporal patches, SDPA and eager attention, float32 and bfloat16),
with one attention call per vision layer: the padded block-diagonal layout on CPU, the varlen kernel's arguments
where FlashAttention-2 would run.
"""

from __future__ import annotations

import contextlib
import itertools

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
        if alias == "tiny-qwen2.5-vl" or kind == "video":  # several chunks per layer, one call
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


def _tower_inputs(adapter, sizes: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pixel patches and grid of several images in one tower call (chunks of several lengths in every layer)."""
    encoded = [
        adapter.processor.image_processor(images=[image_media(w, h, seed=i).frames[0]], return_tensors="pt")
        for i, (w, h) in enumerate(sizes)
    ]
    return torch.cat([e["pixel_values"] for e in encoded]), torch.cat([e["image_grid_thw"] for e in encoded])


def _tower_output(tower, pixels, grid, stock: bool) -> torch.Tensor:
    with torch.no_grad(), contextlib.nullcontext() if stock else patched(tower):
        out = tower(pixels.to(tower.dtype), grid_thw=grid)
    return torch.cat([out.pooler_output, *(getattr(out, "deepstack_features", None) or [])], dim=-1)


def _depth(tower) -> int:
    return len(tower.blocks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("alias", ["tiny-qwen2.5-vl", "tiny-qwen3-vl"])
def test_one_call_per_layer_matches_the_stock_tower(alias, dtype, sdpa_calls):
    """Images of three sizes in one tower call: every layer's chunks (windows, or whole images of different
    lengths) in ONE attention call over the padded block-diagonal layout, against transformers' own tower on the
    untouched model. float32: the same sums per chunk (atol 1e-6); bfloat16: within one bf16 step at the
    outputs' scale (~0.1: atol 1e-3; equal on this CPU, where a padded mask's zeros add nothing)."""
    import copy

    tower = copy.deepcopy(get_adapter(alias).visual).to(dtype)
    pixels, grid = _tower_inputs(get_adapter(alias), [(1000, 700), (448, 336), (224, 560)])
    sdpa_calls.clear()
    padded = _tower_output(tower, pixels, grid, stock=False)
    padded_calls = len(sdpa_calls)
    sdpa_calls.clear()
    stock = _tower_output(tower, pixels, grid, stock=True)
    assert padded_calls == _depth(tower) < len(sdpa_calls)
    atol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(padded.float(), stock.float(), rtol=0, atol=atol)


def test_padding_keys_are_masked(sdpa_calls):
    """The padded layout holds pad slots (chunks of several lengths) and each call is given a key mask."""
    from visualkv.attention import vision as vision_attention

    adapter = get_adapter("tiny-qwen2.5-vl")
    pixels, grid = _tower_inputs(adapter, [(1000, 700)])
    cu = torch.tensor([0, 3, 10, 12], dtype=torch.int32)
    layout = vision_attention._build_layout(cu)
    assert layout.longest == 7 and layout.key_valid[0].tolist() == [
        [True] * 3 + [False] * 4,
        [True] * 7,
        [True] * 2 + [False] * 5,
    ]
    assert layout.gather[0].tolist() == [0, 1, 2, 0, 0, 0, 0, *range(3, 10), 10, 11, *[10] * 5]
    tokens = torch.arange(12.0)
    assert tokens[layout.gather[0]][layout.scatter].tolist() == tokens.tolist()  # every token back in its place
    _tower_output(adapter.visual, pixels, grid, stock=False)
    assert len(sdpa_calls) == _depth(adapter.visual)


def test_flash_varlen_kernel_is_given_the_packed_chunks(monkeypatch):
    """Where FlashAttention-2 applies (CUDA bf16 / fp16 with `flash_attn` installed; stood in for here), each layer
    makes one varlen call on the packed sequence with the tower's `cu_seqlens` and the longest chunk: a reference
    varlen function (per-chunk SDPA) then gives transformers' output."""
    from visualkv.attention import vision as vision_attention

    calls = []

    def reference_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, **kwargs):
        assert cu_seqlens_q.dtype == torch.int32 and torch.equal(cu_seqlens_q, cu_seqlens_k)
        assert kwargs == {"dropout_p": 0.0, "causal": False}
        bounds = cu_seqlens_q.tolist()
        assert max_seqlen_q == max_seqlen_k == max(b - a for a, b in itertools.pairwise(bounds))
        calls.append(len(bounds) - 1)
        out = [
            F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)), scale=softmax_scale)
            for a, b in itertools.pairwise(bounds)
        ]
        return torch.cat([o.transpose(0, 1) for o in out])

    monkeypatch.setattr(vision_attention, "_varlen_kernel", lambda q: reference_varlen)
    adapter = get_adapter("tiny-qwen2.5-vl")
    pixels, grid = _tower_inputs(adapter, [(1000, 700), (448, 336)])
    varlen = _tower_output(adapter.visual, pixels, grid, stock=False)
    stock = _tower_output(adapter.visual, pixels, grid, stock=True)
    assert len(calls) == _depth(adapter.visual) and max(calls) > 2  # windows: many chunks in one call
    torch.testing.assert_close(varlen, stock, rtol=0, atol=1e-6)


def test_varlen_kernel_only_for_cuda_half_precision():
    from visualkv.attention import vision as vision_attention

    assert vision_attention._varlen_kernel(torch.zeros(2, 2, 4, dtype=torch.bfloat16)) is None  # CPU: SDPA
    assert vision_attention._varlen_kernel(torch.zeros(2, 2, 4)) is None


def test_a_patch_closed_from_another_thread_ends_the_entering_threads_one_call_path():
    """A generator suspended inside `patched` and closed from another thread (as a thread pool or the garbage
    collector may) ends the entering thread's one-call path and leaves the closing thread's alone."""
    import threading

    from visualkv.attention import vision as vision_attention

    adapter = get_adapter("tiny-qwen2.5-vl")

    def inside():
        with patched(adapter):
            yield

    held = inside()
    next(held)
    assert vision_attention._entries().depth == 1
    seen: list = []
    closer = threading.Thread(target=lambda: (held.close(), seen.append(vision_attention._entries().depth)))
    closer.start()
    closer.join()
    assert seen == [0] and vision_attention._entries().depth == 0
    assert adapter.visual.config._attn_implementation == "sdpa"
