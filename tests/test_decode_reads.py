"""Decoding with sampled tokens read back every N tokens (visualkv.runtime.decode_loop).

Whatever `decode_read_every` is, a turn must give the answer the per-token loop (N = 1) gives and leave the cache
bit for bit as it does, so follow-up turns answer the same: also when EOS comes in the middle of a read's tokens,
where the tokens fed after it are taken back out of the cache. The host reads of sampled tokens are counted with a
`TorchFunctionMode` (every device-reading tensor operation while the decode loop runs).
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import get_adapter
from tests.test_cli import _assert_one_line_error, _run
from tests.test_sync_free import SyncGuard
from visualkv.bench.synthetic import image_media, video_media
from visualkv.errors import ConfigError
from visualkv.runtime import decode_loop
from visualkv.runtime.session import ChatSession, SessionConfig
from visualkv.runtime.static_decode import StaticDecoder

FAMILY = "tiny-qwen2.5-vl"
EOS_AT = 5  # the forced EOS's step: inside a read of 3 (reads at steps 0, 3, 6) and of 8 (reads at 0, 8)

CASES = [  # method, budget, decode mode, temperature
    ("full", None, "eager", 0.0),
    ("full", None, "static", 0.0),
    ("full", None, "eager", 0.8),  # top-p sampling on the device
    ("blockwise-keydiff", 24, "eager", 0.0),
    ("blockwise-keydiff", 24, "static", 0.0),
    ("salicache", None, "eager", 0.0),
    ("lightkv", None, "eager", 0.0),
    ("blockwise-keydiff+salicache", 24, "static", 0.0),
]


@pytest.fixture
def eos(monkeypatch):
    """Sets the adapter's EOS ids for the test (the model's own come back after it)."""
    adapter = get_adapter(FAMILY)

    def set_eos(ids: set[int]) -> None:
        monkeypatch.setattr(type(adapter), "eos_token_ids", property(lambda self: set(ids)))

    return set_eos


@pytest.fixture
def rewinds(monkeypatch):
    """Records the tokens each answer took back out of the cache."""
    seen: list[int] = []
    rewind = decode_loop.Feeder.rewind

    def recording(self, n: int) -> None:
        seen.append(n)
        rewind(self, n)

    monkeypatch.setattr(decode_loop.Feeder, "rewind", recording)
    return seen


def _media(method: str):
    return video_media(4, 224, 168, fps=1.0, seed=3) if "salicache" in method else image_media(224, 168, seed=1)


def _conversation(method, budget, decode, temperature, read_every, max_new_tokens=12):
    """Two turns; returns (token ids per turn, answers, why each ended, the cache and host state after them)."""
    config = SessionConfig(
        method=method,
        budget=budget,
        block_size=48,
        max_new_tokens=max_new_tokens,
        decode=decode,
        temperature=temperature,
        top_p=0.9,
        decode_read_every=read_every,
    )
    session = ChatSession(get_adapter(FAMILY), config)
    session.ask("What is in it?", _media(method))
    session.ask("And what else?")
    turns = session.turns
    return [t.token_ids for t in turns], [t.answer for t in turns], [t.stopped for t in turns], _state(session)


def _state(session: ChatSession) -> list:
    """Everything a later turn reads: each layer's entries (keys, values, token indices, packed tiers), the host
    counts, the history and the pending token."""
    state: list = [
        session.state.seq_len,
        session.state.next_position,
        session.state.pending,
        session.cache.entries_per_layer(),
    ]
    state.append([int(token) for ids in session.state.history_ids for token in ids])
    for layer in session.cache.layers:
        state += [layer.keys, layer.values, layer.token_index]
        for segment in layer.quant.values():
            state += [segment.keys.data, segment.keys.scale, segment.values.data, segment.values.scale]
            state.append(segment.token_index)
    return state


def _same_state(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize(("method", "budget", "decode", "temperature"), CASES)
def test_answers_and_cache_do_not_depend_on_the_read_interval(eos, rewinds, method, budget, decode, temperature):
    eos(set())  # no EOS: every answer runs to the length cap
    ref_ids, ref_answers, ref_stopped, ref_state = _conversation(method, budget, decode, temperature, 1)
    assert ref_stopped == ["max_new_tokens"] * 2
    # EOS forced at step EOS_AT of the first answer: its id first sampled there
    first = ref_ids[0]
    assert first[EOS_AT] not in first[:EOS_AT], "pick another EOS step: this id was sampled before it"
    eos({first[EOS_AT]})
    cut_ids, cut_answers, cut_stopped, cut_state = _conversation(method, budget, decode, temperature, 1)
    assert cut_ids[0] == first[:EOS_AT] and cut_stopped[0] == "eos"
    assert not _same_state(cut_state, ref_state)  # the cut answer leaves another conversation behind
    assert sum(rewinds) == 0  # one token per read: nothing fed past an EOS
    for read_every, fed_past_eos in ((3, 1), (8, 3)):  # EOS found at step 6 / 8, after 1 / 3 more tokens were fed
        eos(set())
        ids, answers, stopped, state = _conversation(method, budget, decode, temperature, read_every)
        assert (ids, answers, stopped) == (ref_ids, ref_answers, ref_stopped)
        assert _same_state(state, ref_state)
        eos({first[EOS_AT]})
        rewinds.clear()
        ids, answers, stopped, state = _conversation(method, budget, decode, temperature, read_every)
        assert (ids, answers, stopped) == (cut_ids, cut_answers, cut_stopped)
        assert _same_state(state, cut_state), f"read every {read_every}: the cache differs after the turns"
        assert rewinds[0] == fed_past_eos  # the first answer's EOS came mid-read


def test_a_reader_that_stops_mid_read_leaves_the_per_token_cache(eos):
    """The consumer stops iterating at the 4th piece, inside a read of 8: the cache holds the tokens the per-token
    loop had fed by then, and the next turn answers as it does."""
    eos(set())
    states = []
    for read_every in (1, 8):
        config = SessionConfig(max_new_tokens=12, decode_read_every=read_every)
        session = ChatSession(get_adapter(FAMILY), config)
        stream = session.stream("What is in it?", image_media(224, 168, seed=1))
        for _ in range(4):
            next(stream)
        stream.close()
        session.ask("And what else?")
        states.append(([t.token_ids for t in session.turns], _state(session)))
    assert states[0][0] == states[1][0]
    assert _same_state(states[0][1], states[1][1])


def test_a_static_step_after_a_rewind_is_the_step_never_rewound():
    """Rewinding the fixed-shape decoder moves its step counter back too: the next step writes where the rewound
    one did, at the same position, as if the rewound token had never been fed."""
    runs = []
    for tokens, rewind_after in (([11, 12, 13], 2), ([11, 13], None)):
        session = ChatSession(get_adapter(FAMILY), SessionConfig(max_new_tokens=1))
        session.ask("What is in it?", image_media(224, 168, seed=1))  # the prefill; one token, no decode step
        decoder = StaticDecoder(
            session.adapter, session.cache, 4, session.state.next_position, session.state.seq_len, False
        )
        for i, token in enumerate(tokens):
            logits = decoder.step(torch.tensor([token]))
            if i + 1 == rewind_after:
                decoder.rewind(1)
        decoder.finish()
        runs.append((logits, _state(session)))
    assert torch.equal(runs[0][0], runs[1][0])
    assert _same_state(runs[0][1], runs[1][1])


@pytest.fixture
def reads(monkeypatch):
    """Counts device-reading tensor operations while a decode loop runs (from its first sample to its end)."""
    guard = SyncGuard()
    run = decode_loop.DecodeLoop.run

    def armed(self, *args, **kwargs):
        guard.armed = True
        try:
            yield from run(self, *args, **kwargs)
        finally:
            guard.armed = False

    monkeypatch.setattr(decode_loop.DecodeLoop, "run", armed)
    with guard:
        yield guard.hits


@pytest.mark.parametrize(
    ("decode", "read_every", "reads_per_turn"),
    [
        # 33 tokens a turn: one read at the first token, then one per N tokens (steps N, 2N, ...; the last, 32)
        ("eager", 1, 33),
        ("eager", 3, 12),  # steps 0, 3, ..., 30 and 32
        ("eager", 8, 5),  # steps 0, 8, 16, 24, 32
        ("static", 8, 5),
        ("eager", None, 33),  # the CPU's default: a read per token
    ],
)
def test_host_reads_per_generated_token(eos, reads, decode, read_every, reads_per_turn):
    eos(set())
    config = SessionConfig(max_new_tokens=33, decode=decode, decode_read_every=read_every)
    session = ChatSession(get_adapter(FAMILY), config)
    session.ask("What is in it?", image_media(224, 168, seed=1))
    session.ask("And what else?")
    assert [len(t.token_ids) for t in session.turns] == [33, 33]
    assert reads == ["tolist"] * (2 * reads_per_turn)


def test_default_interval_is_per_token_on_cpu_and_eight_on_an_accelerator():
    assert decode_loop.read_interval(None, "cpu") == 1
    assert decode_loop.read_interval(None, "cuda") == 8
    assert decode_loop.read_interval(3, "cuda") == 3


@pytest.mark.parametrize("value", [0, -1, 2.5, "8", True, float("nan")])
def test_bad_read_interval_is_one_line(value):
    with pytest.raises(ConfigError) as caught:
        SessionConfig(decode_read_every=value).validate()
    message = str(caught.value)
    assert "decode_read_every" in message and "\n" not in message


@pytest.mark.parametrize("value", ["0", "-2", "2.5", "x"])
def test_bad_read_interval_option_exits_2_with_one_line(capsys, value):
    code, _, err = _run(capsys, "run", "--prompt", "hi", "--quiet", "--decode-read-every", value)
    _assert_one_line_error(code, err, "--decode-read-every", value)
