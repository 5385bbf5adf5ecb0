"""The step channel (`visualkv.attention.step`): what a layer call gets beyond transformers' arguments is scoped to
that call in its own thread. A layer that raises leaves no step behind, and another thread running the same
model while a chat's layer runs sees no step: its answer is the model's own."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.conftest import get_adapter
from visualkv.attention import patched
from visualkv.attention.step import current
from visualkv.bench.synthetic import video_media
from visualkv.runtime.session import ChatSession, SessionConfig

ALIAS = "tiny-qwen2.5-vl"
IDS = torch.tensor([[11, 12, 13, 14, 15, 16]])


def _plain_logits(adapter) -> torch.Tensor:
    """The model's own forward over a few tokens, no cache, inside `patched` (VisualKV's wrapped attention)."""
    with patched(adapter), torch.no_grad():
        return adapter.model(input_ids=IDS, use_cache=False).logits


def _session(adapter) -> ChatSession:
    # Sali-Cache over a video in blocks: later blocks carry packed tiers and a mask after cached entries
    config = SessionConfig(method="salicache", prefill="blockwise", block_size=64, max_new_tokens=2, decode="eager")
    return ChatSession(adapter, config)


def _loaded_step(step) -> bool:
    """A step whose leak would change another call's attention: packed tiers and a block after the cache."""
    return step is not None and bool(step.segments) and step.after_cache is not None


def test_a_layer_that_raises_leaves_no_step_behind():
    adapter = get_adapter(ALIAS)
    reference = _plain_logits(adapter)
    seen = []

    def fail(module, args):
        seen.append(current())
        if _loaded_step(current()):
            raise RuntimeError("a layer failed")

    handle = adapter.layers[1].register_forward_pre_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="a layer failed"):
            _session(adapter).ask("What moves?", video_media(4, 224, 168, fps=1.0, seed=3))
    finally:
        handle.remove()
    assert _loaded_step(seen[-1])  # the failure came inside a step that would change attention
    assert current() is None
    torch.testing.assert_close(_plain_logits(adapter), reference, rtol=0, atol=0)


def test_another_thread_running_the_model_during_a_step_sees_none():
    adapter = get_adapter(ALIAS)
    reference = _plain_logits(adapter)
    other: dict = {}

    def run_other_thread() -> None:
        try:
            other["logits"] = _plain_logits(adapter)
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            other["error"] = exc

    def observe(module, args):
        if threading.current_thread() is not threading.main_thread():
            other.setdefault("steps", []).append(current())
        elif _loaded_step(current()) and "thread" not in other:  # this chat's layer runs a loaded step now
            other["thread"] = threading.Thread(target=run_other_thread)
            other["thread"].start()
            other["thread"].join()

    handle = adapter.layers[0].self_attn.register_forward_pre_hook(observe)
    try:
        _session(adapter).ask("What moves?", video_media(4, 224, 168, fps=1.0, seed=3))
    finally:
        handle.remove()
    assert "thread" in other, "no layer call ran a step with packed tiers and a mask after the cache"
    assert other.get("steps") == [None]
    assert "error" not in other, other.get("error")
    torch.testing.assert_close(other["logits"], reference, rtol=0, atol=0)
