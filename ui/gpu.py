"""Hugging Face ZeroGPU: each GPU step of the app (a chat turn, a comparison) as one `spaces.GPU` call.

The calls and their picklable inputs live in the library (`visualkv.runtime.calls`); here they are decorated with
`spaces.GPU` (a no-op decorator where the `spaces` package is missing), and `stream_turn` / `stream_compare` stand in
for the runtime's functions of the same names: on ZeroGPU (`SPACES_ZERO_GPU` set and `spaces` importable) they run
the decorated call and hand its events on; elsewhere they are the runtime's own, in this process. A Stop pressed in
the browser (a threading.Event here) is forwarded to the call's `StopFlag`. Each finished call's measured speeds
are kept per model (`SpeedLog`), and the next call's duration is planned with them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from visualkv.models.registry import load_model
from visualkv.runtime import streaming
from visualkv.runtime.calls import (
    CompareCall,
    DeviceSpeed,
    EvidenceCall,
    SpeedLog,
    StopFlag,
    TurnCall,
    call_seconds,
    call_time_limit,
    compare_plan,
    compare_seconds,
    evidence_seconds,
    run_compare,
    run_evidence,
    run_turn,
    turn_plan,
)
from visualkv.runtime.park import adopt_state, export_state, on_zero_gpu, portable_media
from visualkv.runtime.session import ChatSession, SessionConfig

try:  # Hugging Face Spaces' package: lends a GPU to each decorated call on ZeroGPU hardware
    import spaces
except Exception:  # noqa: BLE001 - not on a Space (ImportError) or the package is unusable here
    spaces = None


def gpu(duration=60):
    """`spaces.GPU(duration=...)` where the package imports, else a decorator that changes nothing."""
    if spaces is None:
        return lambda fn: fn
    return spaces.GPU(duration=duration)


def zero_gpu() -> bool:
    """Do GPU steps go through decorated calls (a ZeroGPU Space)?"""
    return spaces is not None and on_zero_gpu()


#: models by name, for the worker of a call: forked from this process, it finds the model loaded here
_MODELS: dict[str, Any] = {}


#: what a call's duration assumes of the device until a speed is measured
DEVICE_SPEED = DeviceSpeed()
#: the speeds each model showed in its finished calls, by model name
_SPEEDS: dict[str, SpeedLog] = {}


def _speed(name: str) -> DeviceSpeed:
    """The speed the next call of model `name` is planned with (measured where known)."""
    return _SPEEDS.setdefault(name, SpeedLog()).speed(DEVICE_SPEED)


def _model(name: str):
    if name not in _MODELS:  # a worker forked before the model was loaded: it loads its own
        _MODELS[name] = load_model(name, device="cuda")
    return _MODELS[name]


def _turn_seconds(call: TurnCall, model: str) -> int:
    return call.seconds


def _compare_seconds(call: CompareCall, model: str) -> int:
    return call.seconds


@gpu(duration=_turn_seconds)
def turn_call(call: TurnCall, model: str) -> Iterator[tuple[str, Any]]:
    """A chat turn on the lent GPU (generator: its events stream to the page)."""
    yield from run_turn(call, _model(model))


@gpu(duration=_compare_seconds)
def compare_call(call: CompareCall, model: str) -> Iterator[tuple[str, Any]]:
    """A comparison on the lent GPU."""
    yield from run_compare(call, _model(model))


def _evidence_seconds(call: EvidenceCall, model: str) -> int:
    return call.seconds


@gpu(duration=_evidence_seconds)
def evidence_call(call: EvidenceCall, model: str) -> Iterator[tuple[str, Any]]:
    """The last turn's evidence pass on the lent GPU: ("parked", the chat's state after it)."""
    yield from run_evidence(call, _model(model))


def compute_evidence(session: ChatSession, on_block=None, stop: threading.Event | None = None, time_limit=None) -> None:
    """`session.compute_evidence`, through a decorated call on ZeroGPU (`on_block` gets each block's event there
    too, as the call streams them)."""
    if not zero_gpu():
        session.compute_evidence(on_block=on_block, stop=stop)
        return
    name = session.adapter.name
    _MODELS.setdefault(name, session.adapter)
    speed, flag = _speed(name), StopFlag()
    seconds = evidence_seconds(session, speed, call_time_limit(time_limit))
    call = EvidenceCall(export_state(session), flag, seconds, time_limit, speed.setup_seconds)
    with _forwarded(stop, flag):
        for kind, payload in evidence_call(call, name):
            if kind == "parked":
                adopt_state(session, payload)
            elif kind == "block" and on_block is not None:
                on_block(payload)


@contextmanager
def _forwarded(stop: threading.Event | None, flag: StopFlag):
    """While the call runs, a set `stop` sets `flag` (checked by the worker where it checks a Stop)."""
    done = threading.Event()
    if stop is not None and stop.is_set():
        flag.set()  # pressed before the call started: the worker stops at its first check

    def watch() -> None:
        while stop is not None and not done.is_set():
            if stop.wait(0.05):
                flag.set()
                return

    watcher = threading.Thread(target=watch, name="visualkv-stop-forward", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()  # a Stop it forwards now lands before the flag's file is removed
        flag.discard()


def stream_turn(
    session: ChatSession, prompt: str, media=None, stop: threading.Event | None = None, time_limit=None
) -> Iterator[tuple[str, Any]]:
    """`visualkv.runtime.streaming.stream_turn`, through a decorated call on ZeroGPU (the session adopts the
    state the call hands back: between turns it holds no device tensor)."""
    if not zero_gpu():
        yield from streaming.stream_turn(session, prompt, media, stop, time_limit=time_limit)
        return
    name = session.adapter.name
    _MODELS.setdefault(name, session.adapter)
    speed, flag = _speed(name), StopFlag()
    try:  # what the call needs, read here: a problem with it is the turn's one error line
        plan = turn_plan(session, prompt, media)
        seconds = call_seconds(plan, speed, call_time_limit(time_limit))
        state = export_state(session)
        call = TurnCall(state, prompt, portable_media(media), flag, time_limit, seconds, speed.setup_seconds)
    except Exception as exc:  # noqa: BLE001 - as stream_turn reports a failure: one line, the chat unchanged
        yield "error", streaming.failure_message(exc)
        return
    with _forwarded(stop, flag):
        for kind, payload in turn_call(call, name):
            if kind == "parked":
                adopt_state(session, payload)
                continue
            if kind == "done":
                _SPEEDS[name].record(plan, payload)
            yield kind, payload


def stream_compare(adapter, media, prompt, methods, base=None, options=None, stop=None, time_limit=None):
    """`visualkv.runtime.streaming.stream_compare`, through a decorated call on ZeroGPU."""
    if not zero_gpu():
        yield from streaming.stream_compare(adapter, media, prompt, methods, base, options, stop, time_limit)
        return
    name = adapter.name
    _MODELS.setdefault(name, adapter)
    methods, speed, flag = list(methods), _speed(name), StopFlag()
    base = base or SessionConfig()
    plan = compare_plan(adapter, base, prompt, media)
    seconds = compare_seconds(plan, len(methods), speed, call_time_limit(time_limit))
    options = dict(options or {})
    call = CompareCall(
        portable_media(media), prompt, methods, base, options, flag, time_limit, seconds, speed.setup_seconds
    )
    with _forwarded(stop, flag):
        for kind, payload in compare_call(call, name):
            if kind == "result" and isinstance(payload[1], dict) and payload[1].get("turns"):
                _SPEEDS[name].record(plan, payload[1]["turns"][0])
            yield kind, payload
