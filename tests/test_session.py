"""ChatSession: streaming, stopping, failed turns that lose nothing, follow-up policies."""

from __future__ import annotations

import threading

import pytest

from tests.conftest import get_adapter
from visualkv.errors import ConfigError, PrefillStopped
from visualkv.runtime.session import ChatSession, SessionConfig


@pytest.fixture
def qwen():
    return get_adapter("tiny-qwen2.5-vl")


def test_stream_pieces_make_the_answer(qwen, small_image):
    s = ChatSession(qwen, SessionConfig(max_new_tokens=8))
    pieces = list(s.stream("What is this?", small_image))
    assert "".join(pieces) == s.turns[-1].answer
    assert s.turns[-1].ttft_seconds > 0


def test_stop_event_ends_the_turn_and_chat_goes_on(qwen, small_image):
    s = ChatSession(qwen, SessionConfig(max_new_tokens=50))
    stop = threading.Event()
    for _ in s.stream("What is this?", small_image, stop=stop):
        stop.set()  # during decoding: the answer so far is kept
    assert s.turns[-1].stopped == "stopped" and len(s.turns[-1].token_ids) == 1
    s.ask("And now?")  # the stopped token is fed before the follow-up
    assert len(s.turns) == 2


def _blockwise(**kw) -> SessionConfig:
    return SessionConfig(
        method="blockwise-snapkv", budget=16, block_size=16, prefill="blockwise", max_new_tokens=3, **kw
    )


def test_stop_during_prefill_ends_it_at_a_block_boundary_and_keeps_nothing(qwen, small_image):
    s = ChatSession(qwen, _blockwise())
    stop = threading.Event()
    seen = []

    def on_block(event):
        seen.append(event)
        if len(seen) == 2:
            stop.set()

    with pytest.raises(PrefillStopped):
        list(s.stream("What is this?", small_image, on_block=on_block, stop=stop))
    assert len(seen) == 2 < seen[0].n_blocks  # no block ran after the stop
    assert s.turns == [] and s.cache is None and s.media is None and s.blocks == []
    s.ask("What is this?", small_image)  # the session is usable as if the stopped turn never happened
    assert len(s.turns) == 1 and len(s.blocks) == seen[0].n_blocks


def test_stop_during_a_followup_reprefill_keeps_the_previous_cache(qwen, small_image):
    s = ChatSession(qwen, _blockwise(followup="reprefill"))
    s.ask("What is this?", small_image)
    before = (s.cache, s.method, list(s.blocks), s.state.seq_len, s.report()["retained"])
    stop = threading.Event()
    with pytest.raises(PrefillStopped):
        list(s.stream("And the colour?", on_block=lambda ev: stop.set(), stop=stop))
    assert (s.cache, s.method, s.blocks, s.state.seq_len, s.report()["retained"]) == before
    assert len(s.turns) == 1
    s.ask("And the colour?")
    assert len(s.turns) == 2 and s.cache is not before[0]


def test_failed_turn_loses_nothing(qwen, small_image):
    s = ChatSession(qwen, SessionConfig(max_new_tokens=3))
    s.ask("What is this?", small_image)
    before = (len(s.turns), s.cache.kv_bytes(), s.state.seq_len)
    with pytest.raises(ConfigError):
        s.ask("   ")
    with pytest.raises(ConfigError):
        s.ask("Another file?", small_image)
    assert (len(s.turns), s.cache.kv_bytes(), s.state.seq_len) == before
    s.ask("Still there?")
    assert len(s.turns) == 2


def test_invalid_config_is_refused():
    with pytest.raises(ConfigError):
        SessionConfig(method="blockwise-snapkv").validate()
    with pytest.raises(ConfigError):
        SessionConfig(method="full", budget=0).validate()
    with pytest.raises(ConfigError):
        SessionConfig(method="nope").validate()


def test_sampling_is_seeded(qwen, small_image):
    answers = []
    for _ in range(2):
        s = ChatSession(qwen, SessionConfig(max_new_tokens=6, temperature=1.0, top_p=0.9, seed=7))
        answers.append(s.ask("What is this?", small_image).token_ids)
    assert answers[0] == answers[1]


def test_followup_reprefill_rebuilds_the_kept_set(qwen, small_image):
    """With SnapKV, a follow-up re-prefill keeps what the *new* question attends to."""
    kept = {}
    for policy in ("reuse", "reprefill"):
        s = ChatSession(
            qwen, SessionConfig(method="blockwise-snapkv", budget=24, block_size=48, max_new_tokens=2, followup=policy)
        )
        s.ask("What colour is the square?", small_image)
        s.ask("How many circles are at the bottom left of the picture?")
        kept[policy] = [set(layer.token_index[0, 0].tolist()) for layer in s.cache.layers]
        assert len(s.turns) == 2 and s.report()["final_kv_bytes"] < s.report()["full_kv_bytes"]
    assert any(a != b for a, b in zip(kept["reuse"], kept["reprefill"], strict=True))
