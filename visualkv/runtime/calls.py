"""GPU work as picklable calls: what a shared GPU lent per call (Hugging Face ZeroGPU) can run.

On ZeroGPU the app's process has no GPU; each decorated call runs in a worker process that gets one, and its
arguments and results cross the process boundary by pickling. So each GPU step of the app is one call here
whose input and output hold no device tensor, no open file and no lock:

- `TurnCall` -> `run_turn`: a chat turn (prefill and decode), from the chat's parked state
  (`visualkv.runtime.park`), yielding `stream_turn`'s events and, before the last one, ("parked", ParkedState):
  the chat's state after the turn, for the app to adopt.
- `CompareCall` -> `run_compare`: a comparison (`stream_compare`'s events).
- `EvidenceCall` -> `run_evidence`: the last turn's evidence pass, yielding ("parked", the chat with its evidence).

Stop crosses the boundary as a `StopFlag` (a file whose existence means stop: the worker checks it where it
checks a threading.Event). `call_seconds` sizes the GPU time a call asks for from the turn's plan.
The model is not part of a call: the worker uses its own (on ZeroGPU, the one loaded at start-up, inherited
when the worker forked). The memory guard reads the free memory inside the call, on the GPU the call got.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from visualkv.media import Media
from visualkv.runtime.park import ParkedState, adopt_state, export_state
from visualkv.runtime.session import ChatSession, SessionConfig
from visualkv.runtime.streaming import Event, stream_compare, stream_turn

#: the longest call ZeroGPU grants (seconds; https://huggingface.co/docs/hub/spaces-zerogpu: "duration")
ZERO_GPU_MAX_SECONDS = 300
#: the shortest call asked for: the worker's start and the moves to and from the device
MIN_CALL_SECONDS = 20


class StopFlag:
    """A Stop that works across processes: `set()` creates a file, `is_set()` looks for it (as threading.Event).

    Pickles as its path. The app creates one per call and removes it afterwards (`discard`).
    """

    def __init__(self, path: str | None = None) -> None:
        if path is None:
            handle, path = tempfile.mkstemp(prefix="visualkv-stop-")
            os.close(handle)
            os.unlink(path)  # the name is reserved for this call; the file appears when Stop is pressed
        self.path = path

    def is_set(self) -> bool:
        return os.path.exists(self.path)

    def set(self) -> None:
        with open(self.path, "a"):
            pass

    def discard(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)

    def __reduce__(self):
        return (StopFlag, (self.path,))


@dataclass
class DeviceSpeed:
    """What `call_seconds` assumes of the device, per billion model parameters (a 7B model runs at a seventh of
    these): prompt tokens prefilled and answer tokens decoded per second, seconds per prefill block. Deliberately
    low for an H200 slice, so a call is not cut short; give measured ones where they are known."""

    prefill_tokens_per_second: float = 7_000.0
    decode_tokens_per_second: float = 100.0
    seconds_per_block: float = 0.02
    setup_seconds: float = MIN_CALL_SECONDS


@dataclass
class TurnPlan:
    """What a turn will do: prompt tokens through the model, prefill blocks, answer tokens at most."""

    prompt_tokens: int
    blocks: int
    answer_tokens: int
    billions: float  # the model's parameters, in billions


def call_seconds(plan: TurnPlan, speed: DeviceSpeed | None = None, time_limit: float | None = None) -> int:
    """GPU seconds to ask for: the plan at `speed`, with a 50 % margin, at most ZeroGPU's limit and the turn
    time limit (the turn stops there anyway) plus the setup."""
    speed = speed or DeviceSpeed()
    scale = max(plan.billions, 0.1)
    work = (
        plan.prompt_tokens * scale / speed.prefill_tokens_per_second
        + plan.answer_tokens * scale / speed.decode_tokens_per_second
        + plan.blocks * speed.seconds_per_block
    )
    seconds = speed.setup_seconds + 1.5 * work
    if time_limit:
        seconds = min(seconds, time_limit + speed.setup_seconds)
    return int(min(math.ceil(seconds), ZERO_GPU_MAX_SECONDS))


def call_time_limit(time_limit: float | None) -> float:
    """The turn time limit inside a call: the instance's, at most what ZeroGPU's longest call leaves after the
    setup, so the turn stops (keeping its answer so far) before the call would be ended from outside."""
    longest = ZERO_GPU_MAX_SECONDS - MIN_CALL_SECONDS
    return longest if time_limit is None else min(time_limit, longest)


def _billions(adapter) -> float:
    """The model's parameters, in billions (what `DeviceSpeed` is scaled by)."""
    return sum(p.numel() for p in adapter.model.parameters()) / 1e9


def turn_plan(session: ChatSession, prompt: str, media: Media | None) -> TurnPlan:
    """The plan of `session`'s next turn (a first turn prepares the input on the host to count its tokens)."""
    adapter, config = session.adapter, session.config
    billions = _billions(adapter)
    followup = adapter.followup_ids(prompt).shape[0] + 1 if session.turns else 0
    prepared = session.prepared if session.turns else adapter.prepare(media, prompt)
    rebuild = not session.turns or (config.followup == "reprefill" and session.method.query_aware)
    tokens = followup + (prepared.seq_len if rebuild and prepared is not None else 0)
    n_visual = prepared.layout.n_visual if rebuild and prepared is not None else 0
    blocks = math.ceil(n_visual / (config.block_size or adapter.default_block_size)) + 2 if rebuild else 1
    return TurnPlan(tokens, blocks, config.max_new_tokens, billions)


@dataclass
class TurnCall:
    """One chat turn as a call: everything crosses the process boundary by pickling."""

    parked: ParkedState  # the chat's state (`export_state`; a new chat's is empty)
    prompt: str
    media: Media | None
    stop: StopFlag
    time_limit: float | None = None
    seconds: int = ZERO_GPU_MAX_SECONDS  # GPU time asked for (`call_seconds`)


def run_turn(call: TurnCall, adapter) -> Iterator[Event]:
    """The turn's events (`stream_turn`), and ("parked", state) before the last: the chat after the turn."""
    session = ChatSession(adapter, call.parked.config)
    adopt_state(session, call.parked)
    for kind, payload in stream_turn(session, call.prompt, call.media, call.stop, time_limit=call.time_limit):
        if kind in ("done", "error", "stopped"):
            yield "parked", export_state(session)
        yield kind, payload


@dataclass
class EvidenceCall:
    """The last turn's evidence pass as a call (`ChatSession.compute_evidence`)."""

    parked: ParkedState
    stop: StopFlag = field(default_factory=StopFlag)
    seconds: int = ZERO_GPU_MAX_SECONDS


def run_evidence(call: EvidenceCall, adapter) -> Iterator[Event]:
    """("parked", state): the chat's state after its evidence pass (a failure raises, as `compute_evidence` does).
    A generator, as the other calls, so one kind of decorated call serves all three."""
    session = ChatSession(adapter, call.parked.config)
    adopt_state(session, call.parked)
    session.compute_evidence(stop=call.stop)
    yield "parked", export_state(session)


def evidence_seconds(session: ChatSession, time_limit: float | None = None) -> int:
    """GPU seconds for an evidence pass: about one uncompressed prefill of the conversation so far, no answer."""
    billions = _billions(session.adapter)
    prepared = session.prepared
    visual = prepared.layout.n_visual if prepared is not None else 0
    blocks = math.ceil(visual / session.adapter.default_block_size) + 2
    tokens = session.sequence_length
    return call_seconds(TurnPlan(tokens, blocks, 0, billions), time_limit=time_limit)


@dataclass
class CompareCall:
    """A comparison as a call (`stream_compare`'s arguments, the model aside)."""

    media: Media | None
    prompt: str
    methods: list[str]
    base: SessionConfig
    options: dict[str, dict[str, Any]] = field(default_factory=dict)
    stop: StopFlag = field(default_factory=StopFlag)
    time_limit: float | None = None
    seconds: int = ZERO_GPU_MAX_SECONDS


def run_compare(call: CompareCall, adapter) -> Iterator[Event]:
    """The comparison's events (`stream_compare`); every session it makes ends with the call."""
    yield from stream_compare(
        adapter, call.media, call.prompt, call.methods, call.base, call.options, call.stop, call.time_limit
    )


def compare_seconds(
    adapter, base: SessionConfig, prompt: str, media: Media | None, methods: int, time_limit=None
) -> int:
    """GPU seconds for a comparison: a first turn per method (planned as `full`'s), bounded like a turn."""
    config = dataclasses.replace(base, method="full", budget=None, method_options={})
    plan = turn_plan(ChatSession(adapter, config), prompt, media)
    speed = DeviceSpeed()
    total = methods * call_seconds(plan, DeviceSpeed(setup_seconds=0)) + speed.setup_seconds
    if time_limit:
        total = min(total, time_limit + speed.setup_seconds)
    return int(min(total, ZERO_GPU_MAX_SECONDS))
