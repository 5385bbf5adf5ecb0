"""GPU work as picklable calls: what a shared GPU lent per call (Hugging Face ZeroGPU) can run.

On ZeroGPU the app's process has no GPU; each decorated call runs in a worker process that gets one, and its
arguments and results cross the process boundary by pickling. So each GPU step of the app is one call here
whose input and output hold no device tensor, no open file and no lock:

- `TurnCall` -> `run_turn`: a chat turn (prefill and decode), from the chat's parked state
  (`visualkv.runtime.park`), yielding `stream_turn`'s events and, before the last one, ("parked", ParkedState):
  the chat's state after the turn, for the app to adopt.
- `CompareCall` -> `run_compare`: a comparison (`stream_compare`'s events).
- `EvidenceCall` -> `run_evidence`: the last turn's evidence pass, yielding ("block", BlockEvent) per block of
  its prefill, then ("parked", the chat with its evidence).

Stop crosses the boundary as a `StopFlag` (a file whose existence means stop: the worker checks it where it
checks a threading.Event). `call_seconds` sizes the GPU time a call asks for from the turn's plan, at the
device's measured speed once a `SpeedLog` holds one; inside the call the turn's time limit is at most those
seconds less the setup (`call_time_limit`), so the turn stops itself, keeping its answer so far, before
ZeroGPU would end the call from outside.
The model is not part of a call: the worker uses its own (on ZeroGPU, the one loaded at start-up, inherited
when the worker forked). The memory guard reads the free memory inside the call, on the GPU the call got.
"""

from __future__ import annotations

import dataclasses
import math
import os
import queue
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from visualkv.errors import PrefillStopped
from visualkv.media import Media
from visualkv.report.telemetry import TIME_LIMIT_STOP
from visualkv.runtime.park import ParkedState, adopt_state, export_state
from visualkv.runtime.session import ChatSession, SessionConfig
from visualkv.runtime.streaming import Event, stream_compare, stream_turn

#: the longest call ZeroGPU grants (seconds; https://huggingface.co/docs/hub/spaces-zerogpu: "duration")
ZERO_GPU_MAX_SECONDS = 300
#: the shortest call asked for: the worker's start and the moves to and from the device
MIN_CALL_SECONDS = 20
#: the factor on the planned work a call asks for (a slower turn than planned still fits)
MARGIN = 1.5
#: measurements a `SpeedLog` keeps per rate (it plans with the slowest of them)
RECENT_SPEEDS = 8
#: the model size `DeviceSpeed` scales by at least (a tiny model's time is the device's, not its parameters')
MIN_BILLIONS = 0.1
#: why an evidence pass the time limit inside its call ended has no result
TIME_LIMIT_EVIDENCE = "the time limit stopped the evidence pass; the chat is as it was"
#: prompt tokens a prefill needs before its time counts as a speed (below, fixed costs dominate)
MIN_MEASURED_PROMPT = 4096
#: answer tokens an answer needs before its time counts as a speed
MIN_MEASURED_ANSWER = 32


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
    """What a turn will do: prompt tokens through the model, prefill blocks, answer tokens at most, and the
    uncompressed prefill of an evidence pass after the answer (`SessionConfig.evidence`; 0 without one)."""

    prompt_tokens: int
    blocks: int
    answer_tokens: int
    billions: float  # the model's parameters, in billions
    evidence_tokens: int = 0
    evidence_blocks: int = 0


def work_seconds(plan: TurnPlan, speed: DeviceSpeed) -> float:
    """Seconds of device work in `plan` at `speed` (no setup, no margin)."""
    scale = max(plan.billions, MIN_BILLIONS)
    return (
        (plan.prompt_tokens + plan.evidence_tokens) * scale / speed.prefill_tokens_per_second
        + plan.answer_tokens * scale / speed.decode_tokens_per_second
        + (plan.blocks + plan.evidence_blocks) * speed.seconds_per_block
    )


def call_seconds(plan: TurnPlan, speed: DeviceSpeed | None = None, time_limit: float | None = None) -> int:
    """GPU seconds to ask for: the setup and the plan at `speed` with a `MARGIN`, at most ZeroGPU's limit and the
    turn time limit (the turn stops there anyway) plus the setup."""
    speed = speed or DeviceSpeed()
    return _bounded(MARGIN * work_seconds(plan, speed), speed, time_limit)


def _bounded(work: float, speed: DeviceSpeed, time_limit: float | None) -> int:
    """`work` seconds plus the setup, at most the time limit plus the setup and ZeroGPU's limit."""
    seconds = speed.setup_seconds + work
    if time_limit is not None:  # 0 stops the turn at once: asking for more than the setup would waste quota
        seconds = min(seconds, time_limit + speed.setup_seconds)
    return int(min(math.ceil(seconds), ZERO_GPU_MAX_SECONDS))


def call_time_limit(
    time_limit: float | None, seconds: float = ZERO_GPU_MAX_SECONDS, setup_seconds: float = MIN_CALL_SECONDS
) -> float:
    """The turn time limit inside a call that asked for `seconds`: the instance's, at most what those seconds
    leave after the setup, so the turn stops (keeping its answer so far) before the call would be ended from
    outside."""
    longest = max(min(seconds, ZERO_GPU_MAX_SECONDS) - setup_seconds, 0.0)
    return longest if time_limit is None else min(time_limit, longest)


@dataclass
class SpeedLog:
    """The speeds one model showed on the device in its last calls, per billion parameters (as `DeviceSpeed`):
    prompt tokens prefilled and answer tokens decoded per second. Kept by the app's process, one per model.

    `speed` plans with the slowest recent measurement of each rate (one fast turn does not shrink the next
    request), and with `base`'s constants until a rate is measured. Immutable tuples: a reader never sees one
    half-updated."""

    prefill: tuple[float, ...] = ()
    decode: tuple[float, ...] = ()

    def record(self, plan: TurnPlan, turn: Any) -> None:
        """Add what a finished turn measured (a `TurnRecord` or its dict; `plan` is the plan it ran). Only what
        measures a rate counts: a prefill of at least `MIN_MEASURED_PROMPT` tokens (a follow-up's or a small
        image's few tokens measure fixed costs), and an answer of at least `MIN_MEASURED_ANSWER` tokens that was
        not stopped, its decoder's setup (a CUDA graph's capture) taken out of its time."""
        turn = turn if isinstance(turn, dict) else dataclasses.asdict(turn)
        scale = max(plan.billions, MIN_BILLIONS)
        prefill_seconds = turn.get("prefill_seconds") or 0.0
        if plan.prompt_tokens >= MIN_MEASURED_PROMPT and prefill_seconds > 0:
            self.prefill = (*self.prefill, plan.prompt_tokens * scale / prefill_seconds)[-RECENT_SPEEDS:]
        rate = _decode_rate(turn)
        if rate is not None:
            self.decode = (*self.decode, rate * scale)[-RECENT_SPEEDS:]

    def speed(self, base: DeviceSpeed | None = None) -> DeviceSpeed:
        base = base or DeviceSpeed()
        return dataclasses.replace(
            base,
            prefill_tokens_per_second=min(self.prefill) if self.prefill else base.prefill_tokens_per_second,
            decode_tokens_per_second=min(self.decode) if self.decode else base.decode_tokens_per_second,
        )


def _decode_rate(turn: dict[str, Any]) -> float | None:
    """Answer tokens per second of a finished turn's decoding, without its decoder's setup; None where the
    answer is too short or was stopped (then its time is mostly fixed costs)."""
    steps = len(turn.get("token_ids") or ()) - 1  # the first token is the prefill's
    rate = turn.get("decode_tokens_per_second") or 0.0
    if steps + 1 < MIN_MEASURED_ANSWER or rate <= 0 or turn.get("stopped") in ("stopped", TIME_LIMIT_STOP):
        return None
    seconds = steps / rate - (turn.get("decode_setup_seconds") or 0.0)
    return steps / seconds if seconds > 0 else None


def _billions(adapter) -> float:
    """The model's parameters, in billions (what `DeviceSpeed` is scaled by)."""
    return sum(p.numel() for p in adapter.model.parameters()) / 1e9


def _prefill_blocks(n_visual: int, block_size: int) -> int:
    """Blocks of a prefill of `n_visual` visual tokens (and the text around them)."""
    return math.ceil(n_visual / block_size) + 2


def turn_plan(session: ChatSession, prompt: str, media: Media | None) -> TurnPlan:
    """The plan of `session`'s next turn (a first turn prepares the input on the host to count its tokens);
    with `SessionConfig.evidence` it counts the evidence pass the turn runs after its answer."""
    adapter, config = session.adapter, session.config
    billions = _billions(adapter)
    followup = adapter.followup_ids(prompt).shape[0] + 1 if session.turns else 0
    prepared = session.prepared if session.turns else adapter.prepare(media, prompt)
    rebuild = not session.turns or (config.followup == "reprefill" and session.method.query_aware)
    tokens = followup + (prepared.seq_len if rebuild and prepared is not None else 0)
    n_visual = prepared.layout.n_visual if prepared is not None else 0
    blocks = _prefill_blocks(n_visual, config.block_size or adapter.default_block_size) if rebuild else 1
    plan = TurnPlan(tokens, blocks, config.max_new_tokens, billions)
    if config.evidence and n_visual:  # the whole conversation again, uncompressed, after the answer
        before = session.sequence_length if session.turns else prepared.seq_len
        plan.evidence_tokens = before + followup + config.max_new_tokens
        plan.evidence_blocks = _prefill_blocks(n_visual, adapter.default_block_size)
    return plan


class _InCallLimit:
    """A call's `turn_limit`: its `time_limit` bounded by the `seconds` it asked for less their `setup_seconds`
    (`call_time_limit`); the call dataclasses below hold those three fields."""

    time_limit: float | None
    seconds: int
    setup_seconds: float

    @property
    def turn_limit(self) -> float:
        return call_time_limit(self.time_limit, self.seconds, self.setup_seconds)


@dataclass
class TurnCall(_InCallLimit):
    """One chat turn as a call: everything crosses the process boundary by pickling."""

    parked: ParkedState  # the chat's state (`export_state`; a new chat's is empty)
    prompt: str
    media: Media | None
    stop: StopFlag
    time_limit: float | None = None  # the instance's turn time limit (None: none)
    seconds: int = ZERO_GPU_MAX_SECONDS  # GPU time asked for (`call_seconds`)
    setup_seconds: float = MIN_CALL_SECONDS  # of `seconds`, what the worker's start and the moves take


def run_turn(call: TurnCall, adapter) -> Iterator[Event]:
    """The turn's events (`stream_turn`), and ("parked", state) before the last: the chat after the turn."""
    session = ChatSession(adapter, call.parked.config)
    adopt_state(session, call.parked)
    for kind, payload in stream_turn(session, call.prompt, call.media, call.stop, time_limit=call.turn_limit):
        if kind in ("done", "error", "stopped"):
            yield "parked", export_state(session)
        yield kind, payload


@dataclass
class EvidenceCall(_InCallLimit):
    """The last turn's evidence pass as a call (`ChatSession.compute_evidence`)."""

    parked: ParkedState
    stop: StopFlag = field(default_factory=StopFlag)
    seconds: int = ZERO_GPU_MAX_SECONDS
    time_limit: float | None = None
    setup_seconds: float = MIN_CALL_SECONDS


class _Deadline:
    """A Stop that is also set `seconds` after it was made, or when its generator is closed (`set`)."""

    def __init__(self, stop: StopFlag, seconds: float) -> None:
        self.stop, self.end, self.closed = stop, time.monotonic() + seconds, threading.Event()

    def passed(self) -> bool:
        return time.monotonic() >= self.end

    def is_set(self) -> bool:
        return self.closed.is_set() or self.stop.is_set() or self.passed()

    def set(self) -> None:
        self.closed.set()


def run_evidence(call: EvidenceCall, adapter) -> Iterator[Event]:
    """("block", BlockEvent) after each block of the pass's prefill, then ("parked", state): the chat's state after
    its evidence pass (a failure raises, as `compute_evidence` does). The pass runs in a thread of the worker so
    its blocks stream out as they finish; Stop and the time limit inside the call end it at the next block."""
    session = ChatSession(adapter, call.parked.config)
    adopt_state(session, call.parked)
    stop = _Deadline(call.stop, call.turn_limit)
    events: queue.Queue[Event] = queue.Queue()

    def work() -> None:
        try:
            session.compute_evidence(on_block=lambda event: events.put(("block", event)), stop=stop)
            events.put(("parked", export_state(session)))
        except PrefillStopped as exc:
            events.put(("raised", PrefillStopped(TIME_LIMIT_EVIDENCE) if stop.passed() else exc))
        except BaseException as exc:  # noqa: BLE001 - raised again in the call, as compute_evidence raises it
            events.put(("raised", exc))

    worker = threading.Thread(target=work, name="visualkv-evidence", daemon=True)
    worker.start()
    try:
        while True:
            kind, payload = events.get()
            if kind == "raised":
                raise payload
            yield kind, payload
            if kind == "parked":
                return
    finally:
        stop.set()  # a caller that stops reading ends the pass at its next block
        worker.join()


def evidence_seconds(session: ChatSession, speed: DeviceSpeed | None = None, time_limit: float | None = None) -> int:
    """GPU seconds for an evidence pass: about one uncompressed prefill of the conversation so far, no answer."""
    prepared = session.prepared
    visual = prepared.layout.n_visual if prepared is not None else 0
    blocks = _prefill_blocks(visual, session.adapter.default_block_size)
    plan = TurnPlan(session.sequence_length, blocks, 0, _billions(session.adapter))
    return call_seconds(plan, speed, time_limit)


@dataclass
class CompareCall(_InCallLimit):
    """A comparison as a call (`stream_compare`'s arguments, the model aside)."""

    media: Media | None
    prompt: str
    methods: list[str]
    base: SessionConfig
    options: dict[str, dict[str, Any]] = field(default_factory=dict)
    stop: StopFlag = field(default_factory=StopFlag)
    time_limit: float | None = None  # for the whole comparison
    seconds: int = ZERO_GPU_MAX_SECONDS
    setup_seconds: float = MIN_CALL_SECONDS


def run_compare(call: CompareCall, adapter) -> Iterator[Event]:
    """The comparison's events (`stream_compare`); every session it makes ends with the call."""
    yield from stream_compare(
        adapter, call.media, call.prompt, call.methods, call.base, call.options, call.stop, call.turn_limit
    )


def compare_plan(adapter, base: SessionConfig, prompt: str, media: Media | None) -> TurnPlan:
    """The plan of one method's turn in a comparison (planned as `full`'s; with its evidence pass when
    `base.evidence` asks for the evidence column)."""
    config = dataclasses.replace(base, method="full", budget=None, method_options={})
    return turn_plan(ChatSession(adapter, config), prompt, media)


def compare_seconds(
    plan: TurnPlan, methods: int, speed: DeviceSpeed | None = None, time_limit: float | None = None
) -> int:
    """GPU seconds for a comparison of `methods` methods: one setup and a turn per method of `plan`
    (`compare_plan`), bounded like a turn."""
    speed = speed or DeviceSpeed()
    return _bounded(methods * MARGIN * work_seconds(plan, speed), speed, time_limit)
