"""The app's GPU steps the way Hugging Face ZeroGPU runs them (ui/gpu.py, visualkv.runtime.calls).

A stand-in `spaces` package decorates the calls: each call's duration is asked for first, its arguments are
pickled, it runs in a worker forked for it ('fork' context, as ZeroGPU forks), every item it yields is pickled
back, and the parent never holds the device. In the worker the model runs on CUDA where the machine has it, else
on the pretend GPU of tests/fake_cuda.py, so a device tensor that crosses the boundary (either way) is seen. Two
chats are interleaved, each with several turns, and their answers must equal those of the same chats run in
this process without ZeroGPU.

A forked worker cannot use CUDA once the parent has initialised it, and on a GPU machine an earlier test of the
same pytest process may have: a test that forks is decorated with `fresh_if_cuda_initialised`, which then runs it
again in a fresh interpreter (that run must pass); a call that would fork from a parent holding CUDA fails.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import pickle
import subprocess
import sys
import threading
import time
import types
from contextlib import contextmanager, nullcontext
from typing import ClassVar

import numpy as np
import pytest
import torch

from tests.conftest import FAMILIES
from tests.fake_cuda import fake_cuda, to_fake_cuda
from visualkv.bench.forked import WorkerFailed, run_forked
from visualkv.bench.synthetic import write_video_file
from visualkv.errors import PrefillStopped
from visualkv.media import FrameSampling, load_media
from visualkv.models.registry import load_model
from visualkv.report.telemetry import TIME_LIMIT_STOP
from visualkv.runtime import streaming
from visualkv.runtime.calls import (
    MIN_CALL_SECONDS,
    ZERO_GPU_MAX_SECONDS,
    CompareCall,
    DeviceSpeed,
    EvidenceCall,
    StopFlag,
    TurnCall,
    call_seconds,
    call_time_limit,
    run_evidence,
    turn_plan,
)
from visualkv.runtime.park import device_tensors, export_state
from visualkv.runtime.session import ChatSession, SessionConfig

#: set in the fresh interpreter a test reruns in (it must not rerun again)
FRESH_ENV = "VISUALKV_ZEROGPU_FRESH_INTERPRETER"
#: the longest a rerun may take
RERUN_SECONDS = 900
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cuda_initialised() -> bool:
    """Has this process initialised CUDA? Then a worker forked from it cannot use CUDA (ZeroGPU's app process
    never initialises it)."""
    return torch.cuda.is_initialized()


def fresh_if_cuda_initialised(test):
    """`test` as it is, or, where this process has initialised CUDA (an earlier test did), rerun in a fresh
    interpreter, whose run must pass: there CUDA starts in the forked workers only, as on ZeroGPU."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        if not cuda_initialised():
            return test(*args, **kwargs)
        assert not os.environ.get(FRESH_ENV), "CUDA was initialised in the fresh interpreter before its test ran"
        node = f"{os.path.abspath(__file__)}::{test.__name__}"
        env = {key: value for key, value in os.environ.items() if key != "SPACES_ZERO_GPU"}  # the fixture sets it
        rerun = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", node],
            check=False,
            cwd=ROOT,
            env={**env, FRESH_ENV: "1"},
            capture_output=True,
            text=True,
            timeout=RERUN_SECONDS,  # a worker that hangs is what the emulation looks for: fail, do not wait
        )
        said = f"{node} in a fresh interpreter:\n{rerun.stdout[-4000:]}{rerun.stderr[-2000:]}"
        summary = rerun.stdout.strip().splitlines()[-1] if rerun.stdout.strip() else ""
        assert rerun.returncode == 0 and summary.startswith("1 passed") and "skipped" not in summary, said

    return run


class Worker:
    """What the decorated calls asked for and sent (each runs in a process forked for it: `run_forked`)."""

    calls: ClassVar[list[tuple[str, int]]] = []  # (function, seconds asked for) of every call
    payloads: ClassVar[list[int]] = []  # bytes of every call's pickled arguments


@contextmanager
def _device_in_worker():
    """The worker's GPU: CUDA when present (initialised in the worker only), else the pretend one."""
    import ui.gpu

    torch.set_num_threads(1)

    on_cuda = torch.cuda.is_available()
    with nullcontext() if on_cuda else fake_cuda():
        for adapter in ui.gpu._MODELS.values():
            adapter.model.to("cuda") if on_cuda else to_fake_cuda(adapter.model)
        yield


def _host_only(obj, where: str) -> None:
    found = device_tensors(obj)
    assert not found, f"{where} holds device tensors: {found[:3]}"


def fake_spaces() -> types.ModuleType:
    """A `spaces` package whose GPU decorator runs calls as ZeroGPU does (see the module docstring)."""

    def GPU(duration=60):  # the package's own name
        def decorate(fn):
            def call(*args, **kwargs):
                seconds = duration(*args, **kwargs) if callable(duration) else duration
                assert isinstance(seconds, int) and 0 < seconds <= ZERO_GPU_MAX_SECONDS, seconds
                Worker.calls.append((fn.__name__, seconds))
                _host_only((args, kwargs), "a call's arguments")
                payload = pickle.dumps((args, kwargs))  # raises on anything unpicklable
                Worker.payloads.append(len(payload))
                assert not cuda_initialised(), "the app's process initialised CUDA: a forked worker cannot use it"
                for item in run_forked(fn, payload, setup=_device_in_worker):
                    _host_only(item, "a call's result")
                    yield item

            return call

        return decorate

    module = types.ModuleType("spaces")
    module.GPU = GPU
    return module


#: the emulated device is this CPU, shared with other work: calls are planned at its speed, with a second per
#: block to spare (the turn limit inside a call follows the seconds asked for, so H200 speeds would stop turns)
CPU_SPEED = DeviceSpeed(prefill_tokens_per_second=20.0, decode_tokens_per_second=1.0, seconds_per_block=1.0)


@pytest.fixture
def zerogpu(monkeypatch):
    """ui.gpu as on a ZeroGPU Space (stand-in `spaces`, SPACES_ZERO_GPU set), restored afterwards."""
    import ui.gpu

    monkeypatch.setenv("SPACES_ZERO_GPU", "true")
    monkeypatch.setitem(sys.modules, "spaces", fake_spaces())
    Worker.calls.clear()
    Worker.payloads.clear()
    module = importlib.reload(ui.gpu)
    module.DEVICE_SPEED = CPU_SPEED
    yield module
    monkeypatch.delitem(sys.modules, "spaces")
    monkeypatch.delenv("SPACES_ZERO_GPU")
    importlib.reload(ui.gpu)


QUESTIONS = ("What is in it?", "And in the corner?", "What colour is it?")
_PARENT_MODELS: dict = {}


def _parent_adapter():
    """The parent's model, on the host (on ZeroGPU the app's process has no GPU)."""
    if "m" not in _PARENT_MODELS:
        _PARENT_MODELS["m"] = load_model(FAMILIES[0])
    return _PARENT_MODELS["m"]


def _config(method: str, budget: int | None = None) -> SessionConfig:
    return SessionConfig(method=method, budget=budget, block_size=64, max_new_tokens=4, decode="static")


def _turn(stream, session: ChatSession, prompt: str, media=None, stop=None, time_limit=None):
    events = list(stream(session, prompt, media, stop, time_limit=time_limit))
    _host_only({name: getattr(session, name) for name in ("cache", "prepared", "prefill_result")}, "the app")
    return events


def _answers(session: ChatSession) -> list[list[int]]:
    return [t.token_ids for t in session.turns]


@fresh_if_cuda_initialised
def test_two_chats_interleaved_on_zero_gpu_answer_as_in_process(zerogpu, small_image, small_video):
    adapter = _parent_adapter()
    chats = {"image": (_config("blockwise-snapkv", 40), small_image), "video": (_config("salicache"), small_video)}
    remote = {name: ChatSession(adapter, cfg) for name, (cfg, _) in chats.items()}
    for i, question in enumerate(QUESTIONS):  # the two chats take turns, as two browser tabs would
        for name, (_, media) in chats.items():
            events = _turn(zerogpu.stream_turn, remote[name], question, media if i == 0 else None)
            assert [kind for kind, _ in events][-1] == "done", events[-1]
            assert any(kind == "text" for kind, _ in events) or not remote[name].turns[-1].token_ids
    for name, (cfg, media) in chats.items():
        local = ChatSession(adapter, cfg)
        for i, question in enumerate(QUESTIONS):
            list(streaming.stream_turn(local, question, media if i == 0 else None))
        assert _answers(remote[name]) == _answers(local), name
        assert all(_answers(local)) and len(_answers(local)) == len(QUESTIONS)
        assert remote[name].report()["final_kv_bytes"] == local.report()["final_kv_bytes"] > 0
        assert remote[name].park_stats.parked and remote[name].report()["park"]["moved_bytes"] > 0
    assert [fn for fn, _ in Worker.calls] == ["turn_call"] * 2 * len(QUESTIONS)


@fresh_if_cuda_initialised
def test_evidence_on_zero_gpu_is_a_call_and_equals_the_in_process_pass(zerogpu, small_image):
    adapter = _parent_adapter()
    config = _config("blockwise-keydiff", 40)
    remote, local = ChatSession(adapter, config), ChatSession(adapter, config)
    _turn(zerogpu.stream_turn, remote, QUESTIONS[0], small_image)
    list(streaming.stream_turn(local, QUESTIONS[0], small_image))
    zerogpu.compute_evidence(remote)
    local.compute_evidence()
    _host_only({name: getattr(remote, name) for name in ("cache", "prepared", "prefill_result")}, "the app")
    assert remote.evidence is not None and remote.evidence.recall == local.evidence.recall
    assert (remote.evidence.map_per_layer == local.evidence.map_per_layer).all()
    assert remote.turns[-1].evidence_recall == local.evidence.recall
    assert [fn for fn, _ in Worker.calls] == ["turn_call", "evidence_call"]
    _turn(zerogpu.stream_turn, remote, QUESTIONS[1])  # a follow-up after the pass, from the state it returned
    list(streaming.stream_turn(local, QUESTIONS[1]))
    assert _answers(remote) == _answers(local)


@fresh_if_cuda_initialised
def test_a_comparison_on_zero_gpu_gives_the_in_process_results(zerogpu, small_image):
    adapter = _parent_adapter()
    methods, base = ["full", "blockwise-keydiff"], _config("full", 40)
    remote = dict(p for k, p in zerogpu.stream_compare(adapter, small_image, "What?", methods, base) if k == "result")
    local = dict(streaming.compare_methods(adapter, small_image, "What?", methods, base))
    assert set(remote) == set(methods)
    for name in methods:
        assert remote[name]["turns"][0]["token_ids"] == local[name]["turns"][0]["token_ids"], name
        assert remote[name]["final_kv_bytes"] == local[name]["final_kv_bytes"] > 0
    assert [fn for fn, _ in Worker.calls] == ["compare_call"]


@fresh_if_cuda_initialised
def test_stop_and_the_time_limit_end_a_call(zerogpu, small_video):
    """A Stop pressed in the app reaches the worker; so does the turn time limit. The chat stays as it was."""
    adapter = _parent_adapter()
    session = ChatSession(adapter, _config("blockwise-keydiff", 40))
    stop = threading.Event()
    stop.set()
    events = _turn(zerogpu.stream_turn, session, QUESTIONS[0], small_video, stop=stop)
    assert events[-1][0] == "stopped" and not session.turns
    events = _turn(zerogpu.stream_turn, session, QUESTIONS[0], small_video, time_limit=0)
    assert events[-1] == ("stopped", streaming.TIME_LIMIT_STOPPED) and not session.turns
    events = _turn(zerogpu.stream_turn, session, QUESTIONS[0], small_video)  # and then the chat goes on
    assert events[-1][0] == "done" and len(session.turns) == 1


@fresh_if_cuda_initialised
def test_the_duration_asked_for_follows_the_turns_plan(zerogpu, small_video):
    """A first turn counts the media's prefill, a follow-up its question; a long turn is capped at ZeroGPU's limit
    and at the turn time limit."""
    session = ChatSession(_parent_adapter(), _config("full"))
    first = turn_plan(session, QUESTIONS[0], small_video)
    assert first.prompt_tokens > small_video.num_frames and first.blocks >= 1
    _turn(zerogpu.stream_turn, session, QUESTIONS[0], small_video)
    followup = turn_plan(session, QUESTIONS[1], None)
    assert 0 < followup.prompt_tokens < first.prompt_tokens // 4 and followup.blocks == 1
    assert [seconds for _, seconds in Worker.calls] == [call_seconds(first, CPU_SPEED)]
    seven_b = dataclasses.replace(first, billions=7.0)
    long_video = dataclasses.replace(seven_b, prompt_tokens=50_000, blocks=64)
    assert call_seconds(long_video) > call_seconds(seven_b) >= call_seconds(dataclasses.replace(followup, billions=7))
    assert call_seconds(dataclasses.replace(long_video, answer_tokens=1024)) > call_seconds(long_video)
    hour = dataclasses.replace(seven_b, prompt_tokens=540_000, blocks=700)
    assert call_seconds(hour) == ZERO_GPU_MAX_SECONDS
    assert call_seconds(hour, time_limit=60) < ZERO_GPU_MAX_SECONDS


@fresh_if_cuda_initialised
def test_a_lazily_decoded_video_crosses_as_a_reader(zerogpu, tmp_path):
    """An uploaded video decodes on access from an open file: a call gets it as what reopens that file (its
    arguments a fraction of the sampled frames' bytes), the app's process decodes no frame for it and the chat's
    state keeps none; a follow-up (the chat's media in the parked state) works too; the answers are the
    in-process ones."""
    path = write_video_file(str(tmp_path / "pan.mp4"), 24, 160, 90, fps=4.0)
    media = load_media(path, sampling=FrameSampling(fps=1.0))
    assert media.is_lazy and media.num_frames == 6
    decoded_bytes = media.num_frames * int(np.prod(media.frames[0].shape))  # the shape of a decoded frame
    adapter, config = _parent_adapter(), _config("blockwise-keydiff", 40)
    remote, local = ChatSession(adapter, config), ChatSession(adapter, config)
    decoded = media.frames.decoded
    for i, question in enumerate(QUESTIONS[:2]):
        events = _turn(zerogpu.stream_turn, remote, question, media if i == 0 else None)
        assert events[-1][0] == "done", events[-1]
    # the app's process decodes what its turn plan prepares (the first temporal patch), not the video
    assert media.frames.decoded - decoded <= 2 < media.num_frames
    assert Worker.payloads[0] < decoded_bytes / 10
    assert remote.media.is_lazy and remote.media.resident_frame_bytes == 0
    for i, question in enumerate(QUESTIONS[:2]):
        list(streaming.stream_turn(local, question, media if i == 0 else None))
    assert _answers(remote) == _answers(local) and all(_answers(local))


@fresh_if_cuda_initialised
def test_a_call_runs_in_a_forked_worker_and_pickles_both_ways():
    """The stand-in `spaces` itself: a call's body runs in another process, its argument and items pickled."""
    spaces = fake_spaces()

    @spaces.GPU(duration=1)
    def where(value):
        yield os.getpid(), value

    assert [(pid != os.getpid(), value) for pid, value in where([1, 2])] == [(True, [1, 2])]


def test_where_cuda_was_initialised_a_test_reruns_in_a_fresh_interpreter(monkeypatch):
    """The rerun itself, here where CUDA never starts: 'initialised' in this process, a test runs again in a
    fresh interpreter (which does not rerun again) and fails when that run fails."""
    this = sys.modules[__name__]
    monkeypatch.setattr(this, "cuda_initialised", lambda: True)
    runs, real_run = [], subprocess.run
    monkeypatch.setattr(subprocess, "run", lambda *a, **kw: runs.append((a, kw)) or real_run(*a, **kw))
    test_a_call_runs_in_a_forked_worker_and_pickles_both_ways()
    (command,), options = runs[0]
    assert len(runs) == 1 and options["env"][FRESH_ENV] == "1"
    assert command[-1].endswith("test_zerogpu.py::test_a_call_runs_in_a_forked_worker_and_pickles_both_ways")
    assert "SPACES_ZERO_GPU" not in options["env"] and options["timeout"] > 0
    for said, code in (("1 failed", 1), ("1 skipped", 0)):  # a skipped rerun is no pass either
        ended = subprocess.CompletedProcess(command, code, said, "")
        monkeypatch.setattr(subprocess, "run", lambda *a, ended=ended, **kw: ended)
        with pytest.raises(AssertionError, match="in a fresh interpreter"):
            test_a_call_runs_in_a_forked_worker_and_pickles_both_ways()
    monkeypatch.setenv(FRESH_ENV, "1")  # in the fresh interpreter: no second rerun
    with pytest.raises(AssertionError, match="initialised in the fresh interpreter"):
        test_a_call_runs_in_a_forked_worker_and_pickles_both_ways()
    spaces = fake_spaces()  # and a call never forks from a parent holding CUDA
    with pytest.raises(AssertionError, match="initialised CUDA"):
        list(spaces.GPU(duration=1)(lambda: iter(()))())


def test_a_turn_inside_a_call_stops_before_zero_gpu_would_end_the_call():
    assert call_time_limit(None) < ZERO_GPU_MAX_SECONDS and call_time_limit(10.0) == 10.0
    assert call_time_limit(10_000.0) == call_time_limit(None)


def _within_seconds_asked(call):
    """`call` (a decorated call) failing as ZeroGPU would end it: an item arriving after the seconds it asked for."""

    def timed(request, model):
        start = time.monotonic()
        for item in call(request, model):
            late = time.monotonic() - start - request.seconds
            assert late <= 0, f"ZeroGPU would have ended this call {late:.1f} s before {item[0]!r} came"
            yield item

    return timed


#: answer tokens at most where only the time limit should end an answer
ENDLESS = 20_000
#: a device the plan thinks fast: a call asks for a few seconds (a second a block) and a long answer runs past them
_FAST_PLAN = DeviceSpeed(1e9, 1e9, seconds_per_block=1.0, setup_seconds=2.0)


def _endless_answers(monkeypatch, adapter) -> None:
    """Answers that run to their token limit (no EOS), in this process and in the workers it forks: only the time
    limit ends them, on however fast a machine."""
    monkeypatch.setattr(type(adapter), "eos_token_ids", property(lambda self: set()))


@fresh_if_cuda_initialised
def test_a_call_asking_too_few_seconds_stops_its_turn_inside_them(zerogpu, monkeypatch, small_image):
    """The turn's time limit inside a call is the seconds asked less the setup: a long answer is cut by the time
    limit (its tokens so far kept), before ZeroGPU would end the call from outside."""
    monkeypatch.setattr(zerogpu, "DEVICE_SPEED", _FAST_PLAN)
    monkeypatch.setattr(zerogpu, "turn_call", _within_seconds_asked(zerogpu.turn_call))
    _endless_answers(monkeypatch, _parent_adapter())
    session = ChatSession(_parent_adapter(), dataclasses.replace(_config("full"), max_new_tokens=ENDLESS))
    events = _turn(zerogpu.stream_turn, session, QUESTIONS[0], small_image)
    ((_, seconds),) = Worker.calls
    assert seconds <= 10  # 2 s of setup + 1.5 x (a block a second): the plan's, at a speed no machine has
    assert events[-1][0] == "done" and events[-1][1].stopped == TIME_LIMIT_STOP, events[-1]
    assert 0 < len(session.turns[0].token_ids) < ENDLESS


@fresh_if_cuda_initialised
def test_a_comparison_asking_too_few_seconds_stops_inside_them(zerogpu, monkeypatch, small_image):
    """The same bound for a whole comparison: `full`'s endless answer is cut, and no time is left for the next
    method."""
    monkeypatch.setattr(zerogpu, "DEVICE_SPEED", dataclasses.replace(_FAST_PLAN, seconds_per_block=0.5))
    monkeypatch.setattr(zerogpu, "compare_call", _within_seconds_asked(zerogpu.compare_call))
    _endless_answers(monkeypatch, _parent_adapter())
    base = dataclasses.replace(_config("full", 40), max_new_tokens=ENDLESS)
    methods = ["full", "blockwise-keydiff"]
    events = list(zerogpu.stream_compare(_parent_adapter(), small_image, QUESTIONS[0], methods, base))
    results = [payload for kind, payload in events if kind == "result"]
    assert results[0][0] == "full" and results[0][1]["turns"][0]["stopped"] == TIME_LIMIT_STOP
    assert events[-1][0] == "stopped" and events[-1][1][1] is True, events[-1]  # no time left for the next method


def test_the_turn_limit_inside_a_call_is_the_seconds_asked_less_the_setup():
    assert call_time_limit(None, 60, 20) == 40 and call_time_limit(100.0, 60, 20) == 40
    assert call_time_limit(10.0, 60, 20) == 10 and call_time_limit(None, 15, 20) == 0
    assert call_time_limit(None, 1000, 20) == ZERO_GPU_MAX_SECONDS - 20
    call = TurnCall(None, "q", None, StopFlag(), time_limit=None, seconds=50, setup_seconds=5)
    assert call.turn_limit == 45
    assert EvidenceCall(None, StopFlag(), seconds=30, time_limit=12.0).turn_limit == 10  # setup 20 by default
    assert CompareCall(None, "q", ["full"], SessionConfig(), seconds=90, time_limit=200).turn_limit == 70


def test_an_evidence_call_stops_at_its_time_limit(small_image):
    """The evidence pass inside a call gets the same bound: a call with no second past its setup stops it."""
    adapter = _parent_adapter()
    session = ChatSession(adapter, _config("blockwise-keydiff", 40))
    list(streaming.stream_turn(session, QUESTIONS[0], small_image))
    call = EvidenceCall(export_state(session), StopFlag(), seconds=MIN_CALL_SECONDS, setup_seconds=MIN_CALL_SECONDS)
    with pytest.raises(PrefillStopped, match="time limit"):
        list(run_evidence(call, adapter))


@fresh_if_cuda_initialised
def test_evidence_blocks_stream_out_of_the_call(zerogpu, small_image):
    """on_block gets, through the call, the same block events as the pass in this process."""
    adapter = _parent_adapter()
    config = _config("blockwise-keydiff", 40)
    remote, local = ChatSession(adapter, config), ChatSession(adapter, config)
    _turn(zerogpu.stream_turn, remote, QUESTIONS[0], small_image)
    list(streaming.stream_turn(local, QUESTIONS[0], small_image))
    seen, expected = [], []
    zerogpu.compute_evidence(remote, on_block=seen.append)
    local.compute_evidence(on_block=expected.append)
    assert len(seen) == len(expected) == expected[0].n_blocks > 1
    assert [_timeless(e) for e in seen] == [_timeless(e) for e in expected]
    assert remote.evidence.recall == local.evidence.recall


def _timeless(event) -> dict:
    """A block event without what differs between two runs of the same pass (time, memory of the process)."""
    return {k: v for k, v in event.to_dict().items() if k not in ("seconds", "rss_bytes", "cuda_allocated_bytes")}


@fresh_if_cuda_initialised
def test_stop_ends_an_evidence_call(zerogpu, small_image):
    session = ChatSession(_parent_adapter(), _config("blockwise-keydiff", 40))
    _turn(zerogpu.stream_turn, session, QUESTIONS[0], small_image)
    stop = threading.Event()
    stop.set()
    with pytest.raises(WorkerFailed, match="PrefillStopped"):  # the stand-in raises the worker's failure
        zerogpu.compute_evidence(session, on_block=lambda event: None, stop=stop)
    assert session.evidence is None and session.turns[-1].evidence_recall is None


@fresh_if_cuda_initialised
def test_the_next_call_asks_for_the_speed_the_last_ones_measured(zerogpu, small_image, monkeypatch):
    """After a call the app plans with the device's measured speed: a CPU is far slower than an H200's constants,
    so the same turn asks for more once measured."""
    from visualkv.runtime import calls

    # this small image and short answer are below what measures a rate (tests/test_call_seconds.py): the wiring
    monkeypatch.setattr(calls, "MIN_MEASURED_PROMPT", 1)
    monkeypatch.setattr(calls, "MIN_MEASURED_ANSWER", 2)
    adapter = _parent_adapter()
    config = dataclasses.replace(_config("full"), max_new_tokens=8)
    session = ChatSession(adapter, config)
    plan = turn_plan(session, QUESTIONS[0], small_image)
    _turn(zerogpu.stream_turn, session, QUESTIONS[0], small_image)
    record = session.turns[0]
    steps = len(record.token_ids) - 1
    assert steps >= 1 and record.stopped != "stopped"
    decode_seconds = steps / record.decode_tokens_per_second - record.decode_setup_seconds  # setup taken out
    measured = zerogpu._SPEEDS[adapter.name]
    scale = max(plan.billions, 0.1)
    assert measured.prefill == (plan.prompt_tokens * scale / record.prefill_seconds,)
    assert measured.decode == pytest.approx((steps / decode_seconds * scale,))
    again = ChatSession(adapter, config)
    _turn(zerogpu.stream_turn, again, QUESTIONS[0], small_image)
    asked = Worker.calls[-1][1]
    # the app plans the same turn with the measured speeds (call_seconds itself: tests/test_call_seconds.py) ...
    assert asked == call_seconds(plan, measured.speed(CPU_SPEED)) != call_seconds(plan, CPU_SPEED)
    # ... and asks for at least the setup and what the same turn took, its whole answer at the measured rate
    took = record.prefill_seconds + plan.answer_tokens * decode_seconds / steps
    assert asked >= CPU_SPEED.setup_seconds + took, (asked, took)
    assert Worker.calls[0][1] == call_seconds(plan, CPU_SPEED)  # the first call, before any measurement


@fresh_if_cuda_initialised
def test_a_turn_with_evidence_runs_its_pass_in_the_turns_call_and_asks_for_it(zerogpu, small_image):
    """SessionConfig.evidence runs the evidence pass inside the turn: the turn's call asks for its seconds too."""
    config = dataclasses.replace(_config("blockwise-keydiff", 40), evidence=True)
    session = ChatSession(_parent_adapter(), config)
    plan = turn_plan(session, QUESTIONS[0], small_image)
    events = _turn(zerogpu.stream_turn, session, QUESTIONS[0], small_image)
    assert events[-1][0] == "done" and session.turns[-1].evidence_recall is not None
    assert [fn for fn, _ in Worker.calls] == ["turn_call"]
    no_pass = dataclasses.replace(plan, evidence_tokens=0, evidence_blocks=0)
    assert Worker.calls[0][1] == call_seconds(plan, CPU_SPEED) > call_seconds(no_pass, CPU_SPEED)
