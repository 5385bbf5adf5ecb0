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
