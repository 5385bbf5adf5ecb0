"""Every setting that decides how much is computed has a bound, refused in one line before any compute."""

from __future__ import annotations

import re
import threading
from typing import ClassVar

import numpy as np
import pytest

from tests.conftest import get_adapter
from visualkv.errors import ConfigError, PrefillStopped, check_range
from visualkv.media.saliency import MotionConfig, frame_decisions, motion_pass_bytes
from visualkv.methods import METHODS, make_method
from visualkv.methods.blockwise import SnapKVConfig
from visualkv.methods.full import FullCache
from visualkv.methods.lightkv import LightKVConfig
from visualkv.report.telemetry import TIME_LIMIT_STOP, TurnRecord
from visualkv.runtime.memory_guard import MemoryGuard
from visualkv.runtime.session import ChatSession, SessionConfig
from visualkv.runtime.streaming import TIME_LIMIT_STOPPED, method_options, stream_turn


def test_check_range_names_the_setting_the_value_and_the_range():
    with pytest.raises(ConfigError) as caught:
        check_range("salicache downscale_width", 3000, 16, 640, whole=True)
    assert str(caught.value) == "salicache downscale_width must be a whole number from 16 to 640, got 3000"
    for bad in (float("nan"), "7", None, True, 2.5):
        with pytest.raises(ConfigError):
            check_range("x", bad, 0, 10, whole=True)
    check_range("x", 10, 0, 10, whole=True)  # the bounds themselves are allowed
    check_range("x", 0.0, 0, 10)


@pytest.mark.parametrize(
    "field, bad, good",
    [
        ("budget", 2**31, 10**7),
        ("budget", 0, 1),
        ("block_size", 10**7, 4096),
        ("max_new_tokens", 10**6, 32_768),
        ("temperature", 1e9, 10.0),
        ("seed", -1, 0),
        ("seed", 2**40, 2**32 - 1),
        ("vision_ahead", 10**4, 64),
    ],
)
def test_session_config_bounds(field, bad, good):
    base = {"method": "blockwise-keydiff", "budget": 64}
    SessionConfig(**(base | {field: good})).validate()
    cfg = SessionConfig(**(base | {field: bad}))
    with pytest.raises(ConfigError, match=f"must be a (whole )?number from .* got {bad!r}"):
        cfg.validate()


@pytest.mark.parametrize("method", ["blockwise-snapkv", "post-snapkv"])
def test_snapkv_pooling_and_window_bounds(method):
    with pytest.raises(ConfigError, match=r"kernel_size .* from 1 to 63, got 1000000"):
        make_method(method, config=SnapKVConfig(kernel_size=1_000_000))
    with pytest.raises(ConfigError, match=r"window .* from 1 to 4,096, got 0"):
        make_method(method, config=SnapKVConfig(window=0))
    # through the app's settings form too: one line, not a failure inside the scoring
    with pytest.raises(ConfigError, match="kernel_size"):
        method_options(method, {"kernel_size": 1_000_000})
    assert make_method(method, config=SnapKVConfig(window=4096, kernel_size=63)).config.kernel_size == 63


@pytest.mark.parametrize(
    "key, bad",
    [
        ("downscale_width", 3000),
        ("downscale_width", 8),
        ("flow_threshold", -0.1),
        ("flow_threshold", 1e6),
        ("cut_threshold", 256.0),
        ("group_size", 4096),
        ("edge_weight", 1.5),
    ],
)
def test_salicache_bounds(key, bad):
    with pytest.raises(ConfigError, match=rf"salicache {key} must be .* from .* got {bad!r}"):
        make_method("salicache", **{key: bad})
    with pytest.raises(ConfigError, match=rf"salicache {key}"):  # a stage of a composition alike
        make_method("blockwise-keydiff+salicache", salicache={key: bad})


def test_salicache_bounds_allow_their_ends():
    method = make_method("salicache", downscale_width=640, flow_threshold=1000.0, cut_threshold=255.0)
    assert method.motion.downscale_width == 640
    with pytest.raises(ValueError, match="downscale_width"):  # the motion filter used alone is bounded too
        MotionConfig(downscale_width=3000)


@pytest.mark.parametrize(
    "options, match",
    [
        ({"layers": (1, 5000)}, "last layer .* got 5000"),
        ({"windows": 1000}, r"windows .* from 1 to 64, got 1000"),
        ({"ratios": tuple([0.5] * 65)}, "number of values .* got 65"),
        ({"layers": ()}, "number of values .* got 0"),
    ],
)
def test_lightkv_bounds(options, match):
    with pytest.raises(ConfigError, match=match):
        LightKVConfig(**options)


# -- Stop and the time limit reach every step of a turn -----------------------------------------------------


class StopAfter:
    """A `should_stop` that says yes from its `n`-th call on, counting its calls."""

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, 0

    def __call__(self) -> bool:
        self.calls += 1
        return self.calls >= self.n


def test_motion_pass_asks_before_every_frame():
    read = []

    def frames():
        for k in range(20):
            read.append(k)
            yield np.full((36, 64, 3), 10 * k, dtype=np.uint8)

    should_stop = StopAfter(4)
    with pytest.raises(PrefillStopped):
        frame_decisions(frames(), MotionConfig(), should_stop)
    assert read == [0, 1, 2, 3]  # four frames filtered, the fifth never decoded


def _prefill(method, media, should_stop, events: list) -> None:
    """A bulk prefill (one block) of `media` under `method` (a name or a Method), asking `should_stop`."""
    adapter = get_adapter("tiny-qwen2.5-vl")
    name = method if isinstance(method, str) else "full"
    session = ChatSession(adapter, SessionConfig(method=name, budget=32 if name != "full" else None))
    prepared = adapter.prepare(media, "What happens?")
    session.engine.prefill(
        prepared, session._new_cache(), method if not isinstance(method, str) else session.method,
        session.config.budget, None, "bulk", on_block=events.append, should_stop=should_stop,
    )  # fmt: skip


class LayerSpy(FullCache):
    """The full cache, noting each decoder layer a block has passed."""

    def __init__(self) -> None:
        self.layers: list[int] = []

    def after_layer(self, ctx, state) -> None:
        self.layers.append(state.layer_idx)


def test_bulk_prefill_stops_between_layers(small_video):
    """A bulk prefill is one block: Stop is asked before each of its decoder layers, not only before the block."""
    spy, events = LayerSpy(), []
    with pytest.raises(PrefillStopped):
        _prefill(spy, small_video, lambda: bool(spy.layers), events)  # Stop pressed during layer 0
    assert spy.layers == [0] and events == []


def test_bulk_prefill_stops_inside_the_vision_tower(small_video):
    """The one vision call of a bulk prefill (video preparation, then the tower) asks Stop as it goes."""
    spy, events, should_stop = LayerSpy(), [], StopAfter(2)
    with pytest.raises(PrefillStopped):
        _prefill(spy, small_video, should_stop, events)  # asked before the block, then inside its vision call
    assert should_stop.calls == 2 and spy.layers == [] and events == []


def test_salicache_passes_over_the_media_stop(small_video):
    """Sali-Cache's motion pass (and its saliency pass) end at Stop before any block is encoded."""
    should_stop, events = StopAfter(2), []
    with pytest.raises(PrefillStopped):
        _prefill("salicache", small_video, should_stop, events)
    assert should_stop.calls == 2 and events == []  # two frames filtered, then stopped


class _DecodedSession:
    """Stands in for a ChatSession whose answer is decoded while the reader is busy elsewhere."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces, self.turns = pieces, []
        self.go, self.decoded = threading.Event(), threading.Event()

    def snapshot(self) -> dict:
        return {}

    def stream(self, prompt, media=None, on_block=None, stop=None):
        yield self.pieces[0]
        self.go.wait(timeout=30)
        yield from self.pieces[1:]
        self.turns.append(TurnRecord(prompt=prompt, answer="".join(self.pieces)))
        self.decoded.set()


def test_text_decoded_while_the_reader_was_busy_comes_as_one_piece():
    """A slow reader (a browser) never holds the compute slot past decoding: what was decoded meanwhile comes
    in one event, then the turn ends."""
    pieces = [f"w{k} " for k in range(50)]
    session = _DecodedSession(pieces)
    events = stream_turn(session, "q")
    assert next(events) == ("text", "w0 ")
    session.go.set()
    assert session.decoded.wait(timeout=30)
    rest = list(events)
    assert [kind for kind, _ in rest] == ["text", "done"]
    assert rest[0][1] == "".join(pieces[1:]) and rest[1][1].answer == "".join(pieces)


# -- the time limit stops a turn like Stop, whatever the method (counted in steps, not seconds) ---------------------

TIME_LIMIT = 7.5


class ExpiringTimer:
    """Stands in for `threading.Timer` in `visualkv.runtime.streaming`: notes the seconds asked for and expires
    when the test says (`fire`), so the turn is stopped at a chosen step rather than by a clock."""

    made: ClassVar[list[ExpiringTimer]] = []

    def __init__(self, interval: float, function) -> None:
        self.interval, self.function, self.daemon, self.started = interval, function, False, False
        ExpiringTimer.made.append(self)

    def start(self) -> None:
        self.started = True

    def cancel(self) -> None:
        self.started = False

    def fire(self) -> None:
        if self.started:
            self.function()


def _expire_after(modules, nth: int) -> tuple[list, list]:
    """Forward hooks on `modules`: the `nth` forward to finish expires the turn's timer; forwards finishing after
    it are recorded. Returns (the hooks' handles, the forwards after expiry)."""
    seen, after = [], []

    def hook(module, args, output):
        if seen and len(seen) >= nth:
            after.append(module)
            return
        seen.append(module)
        if len(seen) == nth:
            ExpiringTimer.made[-1].fire()

    return [m.register_forward_hook(hook) for m in modules], after


def _timed_turn(method: str, media, monkeypatch, modules, nth: int):
    from visualkv.runtime import streaming

    ExpiringTimer.made = []
    monkeypatch.setattr(streaming.threading, "Timer", ExpiringTimer)
    adapter = get_adapter("tiny-qwen2.5-vl")
    needs_budget = METHODS[method].needs_budget
    config = SessionConfig(method=method, budget=64 if needs_budget else None, max_new_tokens=64)
    session = ChatSession(adapter, config)
    handles, after = _expire_after(modules(adapter), nth)
    try:
        events = list(stream_turn(session, "What happens in the video?", media, time_limit=TIME_LIMIT))
    finally:
        for handle in handles:
            handle.remove()
    assert [t.interval for t in ExpiringTimer.made] == [TIME_LIMIT]
    return session, events, after


@pytest.mark.parametrize("method", list(METHODS))
def test_the_time_limit_ends_a_prefill_at_the_next_layer(method, small_video, monkeypatch):
    """The limit expiring after the prefill's first decoder layer ends the turn there, for every method: no
    further layer runs, the turn says the time limit stopped it and nothing of it is kept."""
    session, events, after = _timed_turn(method, small_video, monkeypatch, lambda a: list(a.layers), 1)
    assert events[-1] == ("stopped", TIME_LIMIT_STOPPED), f"{method}: {events[-1]}"
    assert after == [] and session.turns == [], f"{method}: {len(after)} layer(s) ran after the limit"


def test_the_time_limit_during_decoding_keeps_the_answer_so_far(small_video, monkeypatch):
    """Expiring while decoding (the last layer's third forward: the prefill, then two decode steps) ends the
    answer there: the turn is kept, marked as stopped by the time limit, and no later step runs the layer."""
    session, events, after = _timed_turn("full", small_video, monkeypatch, lambda a: [a.layers[-1]], 3)
    kind, record = events[-1]
    assert kind == "done" and record.stopped == TIME_LIMIT_STOP, events[-1]
    assert after == [] and len(session.turns) == 1 and 1 <= len(record.token_ids) <= 3, record.token_ids


def test_memory_guard_counts_the_motion_pass(small_video):
    """Sali-Cache's motion pass holds two downscaled frames (grey + RGB) and the flow's float32 work."""
    adapter = get_adapter("tiny-qwen2.5-vl")
    prepared = adapter.prepare(small_video, "What happens?")
    width, height = small_video.size  # 224 x 168: at 640 px wide the flow runs on 640 x 480 frames
    assert (width, height) == (224, 168)
    expected = 640 * 480 * (2 * 4 + 4 * 40)
    assert motion_pass_bytes((width, height), MotionConfig(downscale_width=640)) == expected
    for method in ("salicache", "blockwise-keydiff+salicache"):
        options = {"downscale_width": 640} if method == "salicache" else {"salicache": {"downscale_width": 640}}
        config = SessionConfig(method=method, budget=32 if "+" in method else None, method_options=options)
        assert MemoryGuard().check(adapter, prepared, config).peak_bytes >= expected
    assert make_method("salicache").begin_bytes(adapter.prepare(None, "Hi")) == 0  # no video: no motion pass


def test_memory_guard_asks_stop_before_every_planned_block(small_video):
    """The memory guard sizes a prefill block by block (an hour of video is thousands): within a prefill's Stop
    scope it asks before each planned block, and a stop ends the estimate at the next one."""
    from visualkv.errors import stop_scope
    from visualkv.layout import plan_blocks
    from visualkv.methods import method_traits

    adapter = get_adapter("tiny-qwen2.5-vl")
    prepared = adapter.prepare(small_video, "What happens?")
    config = SessionConfig(method="blockwise-keydiff", budget=32, block_size=64)
    traits = method_traits(config.method)
    planned = plan_blocks(
        prepared.seq_len, prepared.layout.units, traits.default_prefill, 64, 32, question_apart=traits.question_apart
    )
    assert len(planned) >= 4
    never = StopAfter(10**9)
    with stop_scope(never):
        MemoryGuard().check(adapter, prepared, config)
    assert never.calls == len(planned)  # asked once per planned block
    third = StopAfter(3)
    with stop_scope(third), pytest.raises(PrefillStopped):
        MemoryGuard().check(adapter, prepared, config)
    assert third.calls == 3  # no block sized after the stop


def test_a_stop_during_preparation_ends_the_turn_before_the_memory_guard(small_video, monkeypatch):
    """Stop pressed while a video is prepared: the turn ends there, the guard never sizes it, nothing is kept."""
    adapter = get_adapter("tiny-qwen2.5-vl")
    session = ChatSession(adapter, SessionConfig(method="blockwise-keydiff", budget=32))
    sized = []
    session.guard.check = lambda *args: sized.append(args)
    stop = threading.Event()
    original = adapter.prepare

    def prepare_then_stop(media, prompt):
        prepared = original(media, prompt)
        stop.set()  # pressed just as the preparation finished
        return prepared

    monkeypatch.setattr(adapter, "prepare", prepare_then_stop)
    with pytest.raises(PrefillStopped):
        list(session.stream("What happens?", small_video, stop=stop))
    assert sized == [] and session.turns == [] and session.cache is None


# -- after Stop (or the time limit, which sets the same event), no further layer runs, whatever the method ---------


def _stop_after(modules, nth: int, stop: threading.Event) -> tuple[list, list]:
    """Forward hooks on `modules`: the `nth` forward to finish sets `stop` (as Stop or the time limit would);
    every forward that finishes after it is recorded. Returns (the hooks' handles, the forwards after Stop)."""
    seen, after = [], []

    def hook(module, args, output):
        if stop.is_set():
            after.append(module)
            return
        seen.append(module)
        if len(seen) == nth:
            stop.set()

    return [m.register_forward_hook(hook) for m in modules], after


@pytest.mark.parametrize("stage", ["vision", "decoder"])
@pytest.mark.parametrize("method", list(METHODS))
def test_after_stop_no_vision_block_or_decoder_layer_runs(method, stage, small_video):
    """Stop set just after the first vision-tower block or decoder layer of a video's prefill: the turn ends
    there, for every method: not one more block or layer computes (the time limit sets the same event, tested
    above)."""
    adapter = get_adapter("tiny-qwen2.5-vl")
    if stage == "vision":
        modules = [m for name, m in adapter.model.named_modules() if re.search(r"visual\.blocks\.\d+$", name)]
    else:
        modules = list(adapter.layers)
    assert len(modules) >= 2
    needs_budget = METHODS[method].needs_budget
    session = ChatSession(adapter, SessionConfig(method=method, budget=64 if needs_budget else None))
    stop = threading.Event()
    handles, after = _stop_after(modules, 1, stop)
    try:
        events = list(stream_turn(session, "What happens in the video?", small_video, stop=stop))
    finally:
        for handle in handles:
            handle.remove()
    assert stop.is_set(), f"{method}: the prefill ran no {stage} step"
    assert events[-1][0] == "stopped", f"{method}: {events[-1]}"
    assert after == [], f"{method}: {len(after)} {stage} step(s) ran after Stop"
