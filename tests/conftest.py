"""Shared fixtures: tiny offline models (built once per test session) and small media."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach a hub from the tests
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest

from visualkv.bench.synthetic import image_media, video_media

_ADAPTERS: dict = {}


def get_adapter(alias: str):
    """Tiny model adapters are deterministic, so one instance serves all tests."""
    if alias not in _ADAPTERS:
        from visualkv.models.registry import load_model

        _ADAPTERS[alias] = load_model(alias)
    return _ADAPTERS[alias]


FAMILIES = ["tiny-qwen2.5-vl", "tiny-smolvlm2"]


def cache_entries(session) -> list:
    """Every entry a session's cache holds: full precision and each packed tier (codes, scales, zero points), with
    their token indices, as plain host tensors (to compare two caches entry for entry)."""
    import torch

    out = []
    for layer in session.cache.layers:
        if layer.is_initialized:
            out += [layer.keys, layer.values, layer.token_index]
            for segment in layer.quant.values():
                for packed in (segment.keys, segment.values):
                    out += [packed.data, packed.scale, packed.zero]
                out.append(segment.token_index)
    return [t.cpu().as_subclass(torch.Tensor) for t in out]


@pytest.fixture(params=FAMILIES)
def adapter(request):
    return get_adapter(request.param)


@pytest.fixture(scope="session")
def small_image():
    return image_media(448, 336, seed=1)


@pytest.fixture(scope="session")
def small_video():
    return video_media(8, 224, 168, fps=1.0, seed=2)


def assert_guard_bounds_kv_from_above(media, methods: tuple, question: str = "What is in it?") -> None:
    """For each (method, budget, prefill) of `methods` on tiny Qwen2.5-VL in blocks of 48: the memory guard's
    estimate of KV entries and of buffers is at least what the turn really held at its peak. A method that drops
    rows before the LLM only lowers memory, so the guard, which counts every visual token, must stay above."""
    from visualkv.methods import method_traits
    from visualkv.runtime.memory_guard import estimate_prefill
    from visualkv.runtime.session import ChatSession, SessionConfig

    adapter = get_adapter("tiny-qwen2.5-vl")
    for name, budget, prefill in methods:
        config = SessionConfig(method=name, budget=budget, prefill=prefill, block_size=48, max_new_tokens=2)
        prepared = adapter.prepare(media, question)
        traits = method_traits(name)
        estimate = estimate_prefill(adapter, prepared, traits, budget, 48, prefill, headroom=config.cache_headroom)
        session = ChatSession(adapter, config)
        session.ask(question, media)
        assert estimate.kv_bytes >= session.cache.peak_kv_bytes > 0, name
        assert estimate.kv_allocated_bytes >= session.cache.peak_allocated_bytes > 0, name


def assert_held_keys_are_the_full_caches(cache, full_cache, below: int | None = None) -> None:
    """Layer 0: each key `cache` holds (of a token index below `below`, when given) equals the key the full cache
    holds for the same token: the token and its original position, nothing else."""
    import torch

    layer, ref = cache.layers[0], full_cache.layers[0]
    idx = layer.token_index[0].long()
    for head in range(idx.shape[0]):
        held = idx[head] < below if below is not None else slice(None)
        assert torch.allclose(layer.keys[0, head][held], ref.keys[0, head, idx[head][held]], atol=1e-5)


def fake_prefill_context(t: int, h: int, w: int, prefix: int = 3, suffix: int = 2):
    """A prepared input of `prefix` text tokens, t frames of h x w visual tokens, `suffix` text tokens (no model)."""
    import types

    import numpy as np

    from visualkv.layout import FrameInfo, VisualLayout, VisualUnit

    n = t * h * w
    frame, row, col = np.unravel_index(np.arange(n), (t, h, w))
    seq = prefix + np.arange(n)
    units = [VisualUnit("frame", f, prefix + f * h * w, prefix + (f + 1) * h * w) for f in range(t)]
    layout = VisualLayout(seq, frame, row, col, np.zeros((n, 4)), [FrameInfo("frame", (h, w)) for _ in range(t)], units)
    return types.SimpleNamespace(prepared=types.SimpleNamespace(layout=layout, seq_len=prefix + n + suffix)), prefix, n
