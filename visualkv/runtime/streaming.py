"""Run chat turns in a worker thread and hand their telemetry to a reader as one ordered stream of events.

A UI wants prefill blocks and answer text in one stream, with the model compute off its own thread so that a
stop request is seen while the model runs. `stream_turn` yields ("block", BlockEvent), ("text", str) (the pieces
decoded since the reader last asked, joined), then exactly one of ("done", TurnRecord), ("error", one-line
message) or ("stopped", message): `stop` (or the turn's time limit, `TIME_LIMIT_STOPPED`) ends the prefill
within a decoder layer or a few frames of a pass over the media, leaving the session as before the turn, or
the answer at the next read of its tokens (`SessionConfig.decode_read_every`). Errors never escape as exceptions. Turns of one session are serialised by a
per-session lock.

Also here: `stream_compare` / `compare_methods` (one question through several methods, each in a fresh
session), `compared_by_default` (the methods a comparison ticks for a kind of media), `turn_report`, `live_report` (a partial report during prefill), and `method_settings` /
`method_options` (a method's tunable settings, flattened and back).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
import typing
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from visualkv.errors import ConfigError, PrefillStopped, VisualKVError
from visualkv.media import Media
from visualkv.methods import METHODS, make_method, method_traits
from visualkv.methods.compose import SEPARATOR
from visualkv.methods.options import declared
from visualkv.report.telemetry import TIME_LIMIT_STOP
from visualkv.runtime.memory_guard import out_of_memory_caught
from visualkv.runtime.session import ChatSession, SessionConfig, model_info

log = logging.getLogger(__name__)

Event = tuple[str, Any]

#: the "stopped" payload of a prefill that a time limit ended
TIME_LIMIT_STOPPED = "the time limit stopped this turn while it read the media; nothing of it was kept"

_LOCKS: weakref.WeakKeyDictionary[ChatSession, threading.Lock] = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def _session_lock(session: ChatSession) -> threading.Lock:
    with _LOCKS_GUARD:
        lock = _LOCKS.get(session)
        if lock is None:
            lock = _LOCKS[session] = threading.Lock()
        return lock


def failure_message(exc: BaseException) -> str:
    """One line for the user: the message of a VisualKVError, else type + first line."""
    if isinstance(exc, VisualKVError):
        return str(exc)
    lines = str(exc).strip().splitlines()
    first = lines[0][:300] if lines else ""
    return (
        f"unexpected failure ({type(exc).__name__}: {first})" if first else f"unexpected failure ({type(exc).__name__})"
    )


def stream_turn(
    session: ChatSession,
    prompt: str,
    media: Media | None = None,
    stop: threading.Event | None = None,
    time_limit: float | None = None,
) -> Iterator[Event]:
    """Run one turn of `session` in a worker thread; yield its events in order (see module doc).

    Closing the generator early sets `stop` (if given), so the worker ends at its next read of tokens.
    time_limit: seconds after which `stop` is set, as if the user pressed Stop (the turn ends where a
    stop is honoured). An out-of-memory during the turn is one "error" line; the session is rolled back
    and its cache freed (`visualkv.runtime.memory_guard.out_of_memory_caught`).
    """
    events: queue.Queue[Event] = queue.Queue()
    lock = _session_lock(session)
    if time_limit is not None and stop is None:
        stop = threading.Event()
    timed_out = threading.Event()  # set before `stop` when the time limit (not the user) stops the turn

    def expire() -> None:
        timed_out.set()
        stop.set()

    timer = threading.Timer(max(time_limit, 0.0), expire) if time_limit is not None else None

    def work() -> None:
        with lock:
            try:
                if timer is not None:
                    timer.daemon = True
                    timer.start()
                with out_of_memory_caught(session):
                    for piece in session.stream(
                        prompt, media, on_block=lambda ev: events.put(("block", ev)), stop=stop
                    ):
                        events.put(("text", piece))
                record = session.turns[-1]
                if timed_out.is_set() and record.stopped == "stopped":
                    record.stopped = TIME_LIMIT_STOP
                events.put(("done", record))
            except PrefillStopped as exc:
                events.put(("stopped", TIME_LIMIT_STOPPED if timed_out.is_set() else str(exc)))
            except Exception as exc:
                if not isinstance(exc, VisualKVError):
                    log.exception("turn failed")
                events.put(("error", failure_message(exc)))
            finally:
                if timer is not None:
                    timer.cancel()

    worker = threading.Thread(target=work, name="visualkv-turn", daemon=True)
    worker.start()
    finished = False
    held: Event | None = None  # an event read while joining text, yielded next
    try:
        while True:
            kind, payload = held or events.get()
            held = None
            if kind == "text":
                payload, held = _joined_text(events, payload)
            if kind in ("done", "error", "stopped"):
                finished = True
            yield kind, payload
            if finished:
                return
    finally:
        if not finished and stop is not None:
            stop.set()


def _joined_text(events: queue.Queue[Event], text: str) -> tuple[str, Event | None]:
    """`text` joined with the text pieces already queued behind it, and the first other event read (or None).

    A reader slower than decoding (a browser fed one update per piece) then gets what was decoded meanwhile in
    one piece: it is never more than one update behind, so a request that holds the model's one compute slot
    ends when decoding ends, not when the last of hundreds of pieces has been sent."""
    pieces = [text]
    while True:
        try:
            kind, payload = events.get_nowait()
        except queue.Empty:
            return "".join(pieces), None
        if kind != "text":
            return "".join(pieces), (kind, payload)
        pieces.append(payload)


# -- reports ----------------------------------------------------------------------------------


def turn_report(session: ChatSession) -> dict[str, Any]:
    """The session's report of the last turn (kept as one entry point for the UI)."""
    return session.report()


def live_report(session: ChatSession, blocks: Iterable[Any]) -> dict[str, Any]:
    """What is known during a prefill: model dimensions, budget and the blocks so far.

    `blocks`: BlockEvents or their dicts. Feeds `viz.block_memory_figure` while the
    prefill runs (no `full_kv_bytes` yet: the input length is known only at the end).
    """
    return {
        "model": session.adapter.name,
        "model_info": model_info(session.adapter),
        "method": session.config.method,
        "budget": session.config.budget,
        "blocks": [b if isinstance(b, dict) else b.to_dict() for b in blocks],
    }


def stream_compare(
    adapter,
    media: Media | None,
    prompt: str,
    methods: Iterable[str],
    base: SessionConfig | None = None,
    options: dict[str, dict[str, Any]] | None = None,
    stop: threading.Event | None = None,
    time_limit: float | None = None,
) -> Iterator[Event]:
    """Answer `prompt` about `media` once per method, each in a fresh session, in this process; yield events.

        kind == "method"  -> payload: (name, index, total), before that method's turn starts
        kind == "block"   -> payload: (name, BlockEvent), after each of its prefill blocks
        kind == "result"  -> payload: (name, report or one-line error message); an answer that `stop` cut
                             short is a report whose turn says `stopped` ("stopped" or TIME_LIMIT_STOP)
        kind == "stopped" -> payload: (one-line message, whether the time limit did it), last: `stop` or the time
                             limit ended the comparison; a method it stopped while reading the media has no
                             result, later ones do not run
        kind == "done"    -> payload: None (last): every method ran

    `full` runs first (it is the reference for agreement) when it is among `methods`. `base` supplies budget,
    block size, decoding settings; a method that needs no budget gets none. `options` maps a method to its
    constructor keyword arguments. `time_limit` bounds the whole comparison in seconds: each method's turn
    gets what is left of it (`stream_turn`), so one request holds the model no longer than one turn may.
    """
    base = base or SessionConfig()
    names = list(dict.fromkeys(methods))
    if not names:
        raise ConfigError("choose at least one method to compare")
    traits = {name: method_traits(name) for name in names}  # ConfigError for an unknown or refused name
    names.sort(key=lambda n: n != "full")
    stop = stop if stop is not None else threading.Event()
    deadline = None if time_limit is None else time.monotonic() + time_limit
    finished = 0  # methods with a result
    for index, name in enumerate(names):
        left = None if deadline is None else deadline - time.monotonic()
        if stop.is_set() or (left is not None and left <= 0):
            yield "stopped", _compare_stopped(left is not None and left <= 0, finished, len(names))
            return
        cfg = dataclasses.replace(
            base,
            method=name,
            budget=base.budget if traits[name].needs_budget else None,
            keep=base.keep if traits[name].needs_budget else None,
            method_options=dict((options or {}).get(name, {})),
        )
        try:
            session = ChatSession(adapter, cfg)
        except Exception as exc:
            if not isinstance(exc, VisualKVError):
                log.exception("compare: %s failed", name)
            yield "result", (name, failure_message(exc))
            finished += 1
            continue
        yield "method", (name, index, len(names))
        for kind, payload in stream_turn(session, prompt, media, stop, time_limit=left):
            if kind == "block":
                yield "block", (name, payload)
            elif kind == "stopped":  # stopped while reading the media: nothing of this method to show
                yield "stopped", _compare_stopped(payload == TIME_LIMIT_STOPPED, finished, len(names))
                return
            elif kind in ("done", "error"):
                yield "result", (name, turn_report(session) if kind == "done" else payload)
                finished += 1
    yield "done", None


#: the methods a comparison ticks by default for each kind of media: frame skipping (Sali-Cache) and frame-to-frame
#: pruning (EVS, the field's baseline for it) are for video, so they are ticked for one only
COMPARED_BY_DEFAULT = {
    "image": ("full", "blockwise-snapkv", "post-snapkv", "lightkv"),
    "video": ("full", "blockwise-snapkv", "post-snapkv", "salicache", "evs", "lightkv"),
}


def compared_by_default(kind: str, method_names: list[str]) -> list[str]:
    """The methods a comparison ticks by default for media of `kind` ("image" or "video"), in `method_names`'
    order (the menu's)."""
    chosen = COMPARED_BY_DEFAULT.get(kind, COMPARED_BY_DEFAULT["image"])
    return [m for m in method_names if m in chosen]


def _compare_stopped(by_time_limit: bool, finished: int, total: int) -> tuple[str, bool]:
    who = "the time limit stopped the comparison" if by_time_limit else "stopped"
    return f"{who} after {finished} of {total} methods", by_time_limit


def compare_methods(
    adapter,
    media: Media | None,
    prompt: str,
    methods: Iterable[str],
    base: SessionConfig | None = None,
    options: dict[str, dict[str, Any]] | None = None,
    stop: threading.Event | None = None,
) -> Iterator[tuple[str, dict[str, Any] | str]]:
    """`stream_compare`'s results alone: (method, report) or (method, "error message") as each finishes."""
    for kind, payload in stream_compare(adapter, media, prompt, methods, base, options, stop):
        if kind == "result":
            yield payload


# -- method settings ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Setting:
    """One tunable setting of a method, flattened for a form.

    key: the option's name (a `Config` field of the method), "stage:name" in a composed method.
    kind: "int", "float", "bool", "str", "choice" or "floats" (a tuple/list of numbers).
    """

    key: str
    kind: str
    default: Any
    choices: tuple[Any, ...] = ()
    item: str = "float"  # "floats": "int" when every number is a whole number
    help: str = ""  # the option's declared help line

    def __post_init__(self) -> None:
        if self.kind == "floats" and self.default and all(isinstance(x, int) for x in self.default):
            object.__setattr__(self, "item", "int")

    @property
    def label(self) -> str:
        return self.key.rsplit(":", 1)[-1].replace("_", " ")


def method_settings(name: str) -> list[Setting]:
    """The settings of method `name` a form can edit: the options its `Config` declares
    (visualkv.methods.options), each with its help line. Options of a kind a form cannot edit are left out (the
    method keeps its default). A composed name ("blockwise-keydiff+salicache") lists each stage's, keys "stage:key"."""
    if SEPARATOR in name:
        return [
            dataclasses.replace(s, key=f"{stage}:{s.key}") for stage in _stages(name) for s in method_settings(stage)
        ]
    cls = METHODS.get(name)
    if cls is None:
        return []
    settings = (_setting(opt.name, opt.type, opt.default, opt.help) for opt in declared(cls.Config))
    return [s for s in settings if s is not None]


def method_options(name: str, values: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments for method `name` (`Method(**options)`) from {setting key: value}.

    Keys that are not settings of the method are ignored; values are coerced to the
    setting's kind (ConfigError on a value that does not fit). A composed name gives {stage: its options}."""
    if SEPARATOR in name:
        per_stage = {
            stage: method_options(
                stage, {k.split(":", 1)[1]: v for k, v in values.items() if k.startswith(stage + ":")}
            )
            for stage in _stages(name)
        }
        return {stage: opts for stage, opts in per_stage.items() if opts}
    settings = {s.key: s for s in method_settings(name)}
    given = {k: _coerce(settings[k], v) for k, v in values.items() if k in settings and v is not None}
    if given:
        make_method(name, **given)  # one line naming a value out of its range, before anything runs
    return given


def _stages(name: str) -> tuple[str, ...]:
    """The stage names of a composed method (none for a name that does not compose)."""
    try:
        return method_traits(name).stages
    except ConfigError:
        return ()


def _setting(key: str, hint: Any, default: Any, help: str = "") -> Setting | None:
    if typing.get_origin(hint) is typing.Literal:
        return Setting(key, "choice", default, tuple(typing.get_args(hint)), help=help)
    if isinstance(default, bool):
        return Setting(key, "bool", default, help=help)
    if isinstance(default, int | np.integer):
        return Setting(key, "int", int(default), help=help)
    if isinstance(default, float | np.floating):
        return Setting(key, "float", float(default), help=help)
    if isinstance(default, str):
        return Setting(key, "str", default, help=help)
    if isinstance(default, tuple | list) and default and all(isinstance(x, int | float) for x in default):
        return Setting(key, "floats", tuple(default), help=help)
    if default is None and hint is not None:  # optional value: empty in the form = None (the method's default)
        args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
        base = args[0]
        if base in (int, float):
            return Setting(key, base.__name__, None, help=help)
        if typing.get_origin(base) in (tuple, list):
            items = [a for a in typing.get_args(base) if a is not Ellipsis]
            if items and all(a in (int, float) for a in items):
                return Setting(key, "floats", None, item=items[0].__name__, help=help)
    return None


def _coerce(setting: Setting, value: Any) -> Any:
    try:
        if setting.kind in ("int", "float", "floats") and setting.default is None and value in ("", None):
            return None
        if setting.kind == "bool":
            return bool(value)
        if setting.kind == "int":
            return int(value)
        if setting.kind == "float":
            return float(value)
        if setting.kind == "floats":
            items = value if isinstance(value, list | tuple) else str(value).replace(";", ",").split(",")
            numbers = tuple((int if setting.item == "int" else float)(float(x)) for x in items if str(x).strip())
            if not numbers and setting.default is None:
                return None
            return type(setting.default)(numbers) if setting.default is not None else numbers

        if setting.kind == "choice" and value not in setting.choices:
            raise ValueError(value)
        return value
    except (TypeError, ValueError):
        raise ConfigError(f"setting {setting.label!r}: cannot use {value!r} (expected {setting.kind})") from None
