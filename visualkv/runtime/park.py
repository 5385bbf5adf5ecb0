"""Parked sessions: between turns a chat holds no device tensor.

A compressed cache is small, so it can wait on the host between turns and move to the device in milliseconds
when the next turn starts. That lets one GPU serve many idle chats, and it is what a shared GPU that is lent per
call (Hugging Face ZeroGPU) requires: there a turn runs in a worker process, and everything a follow-up needs
crosses the process boundary by pickling.

`park(session)` moves every tensor of the session's state (the cache's buffers, every tier, packed INT8 / INT4
included, the prepared input, the prefill's context and logits, the method's state) to the host, pinned where
CUDA is available (views of the cache's buffers are dropped, rebuilt on first use); `unpark(session)` moves
each back to the device it came from (a sharded model's cache stays sharded; host tables stay on the host). `export_state` / `adopt_state` hand a parked session's
state to another process as one picklable `ParkedState`, without what belongs to this process (the model, the
engine's callbacks). `resolve_park` decides whether a session parks: "always", "never" or "auto" (on ZeroGPU and in shared mode).
"""

from __future__ import annotations

import copy
import os
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch

from visualkv.errors import MediaError
from visualkv.media import LazyFrames, Media
from visualkv.runtime.access import is_public

PARK_MODES = ("auto", "always", "never")
#: set by Hugging Face in a ZeroGPU Space's container
ZERO_GPU_ENV = "SPACES_ZERO_GPU"

#: what a follow-up turn needs of a ChatSession: the attributes a parked state carries
STATE_FIELDS = (
    "cache",
    "media",
    "prepared",
    "prefill_result",
    "memory_estimate",
    "turns",
    "blocks",
    "method",
    "_next_position",
    "_seq_len",
    "_history_ids",
    "_pending",
    "_rebuild_cache",
    "_graph_failure",
    "park_stats",
    "answer_start",  # where the last answer starts, for its evidence pass
    "evidence",  # the last turn's evidence (numpy), when computed
)


def on_zero_gpu(environ: dict[str, str] | None = None) -> bool:
    """True inside a ZeroGPU Space (`SPACES_ZERO_GPU` set to a true value)."""
    value = (os.environ if environ is None else environ).get(ZERO_GPU_ENV, "")
    return value.strip().lower() in ("1", "true", "yes")


def resolve_park(mode: str, environ: dict[str, str] | None = None) -> bool:
    """Does a session with `park_cache=mode` park between turns? "auto": on ZeroGPU and in shared mode."""
    if mode == "always":
        return True
    if mode == "never":
        return False
    return on_zero_gpu(environ) or is_public(environ=environ)


@dataclass
class ParkStats:
    """The report's view of parking: bytes on the host between turns and the time to move them."""

    mode: str = "never"
    parked: bool = False  # the session's state is on the host now
    parked_bytes: int = 0  # tensor bytes the state holds on the host after the last park
    moved_bytes: int = 0  # of them, the bytes the last park moved from a device
    park_seconds: float = 0.0  # time of the last move to the host
    unpark_seconds: float = 0.0  # time of the last move back to the device
    #: while parked: each host tensor that came from a device, with that device (where `unpark` puts it back)
    homes: list[tuple[torch.Tensor, str]] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "parked": self.parked,
            "parked_bytes": self.parked_bytes,
            "moved_bytes": self.moved_bytes,
            "park_seconds": self.park_seconds,
            "unpark_seconds": self.unpark_seconds,
        }


class _AdapterMark:
    """Stands for the model in a parked state (the model never leaves its process)."""

    def __reduce__(self):
        return (_adapter_mark, ())


ADAPTER = _AdapterMark()


def _adapter_mark() -> _AdapterMark:
    return ADAPTER


#: values a parked state never carries (functions of the running process: the engine's text pass, a Stop check)
_PROCESS_BOUND = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, partial)
#: leaves the walk does not enter (no tensor inside; media frames are host arrays or a lazy reader that pickles)
_LEAVES = (
    str, bytes, int, float, bool, complex, type(None), np.ndarray, np.generic, Media, LazyFrames, torch.dtype,
    torch.device, torch.Size,
)  # fmt: skip


class _Mover:
    """One walk over a session's state, replacing every tensor by `move(tensor)` (None: tensors left as they are).

    In place, or on a structural copy (`copy`: new lists, dicts and objects around the same tensors, so the walked
    state is not changed). `strip`: the model becomes `ADAPTER` and functions of this process None (a state for
    another process); `adapter`: what `ADAPTER` becomes again. The model itself is never walked. Each tensor is
    moved once and each object walked once, so shared references stay shared.
    """

    def __init__(
        self,
        move: Callable[[torch.Tensor], torch.Tensor] | None = None,
        strip: bool = False,
        adapter: Any | None = None,
        copy: bool = False,
    ) -> None:
        self.move, self.strip, self.adapter, self.copy = move, strip, adapter, copy
        self.moved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (the tensor, its copy): kept alive
        self.done: dict[int, Any] = {}  # id of an object walked -> what replaces it
        self.nbytes = 0  # bytes of the distinct tensors met

    def value(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj)
        if isinstance(obj, _LEAVES):
            return obj
        if obj is ADAPTER:
            return self.adapter if self.adapter is not None else obj
        if isinstance(obj, torch.nn.Module) or _is_adapter(obj):  # the model is never walked: it stays where it is
            return ADAPTER if self.strip else obj
        if self.strip and isinstance(obj, _PROCESS_BOUND):
            return None
        if isinstance(obj, tuple):
            return type(obj)(*map(self.value, obj)) if hasattr(obj, "_fields") else tuple(map(self.value, obj))
        if id(obj) in self.done:
            return self.done[id(obj)]
        if isinstance(obj, list):
            out = list(obj) if self.copy else obj
            self.done[id(obj)] = out
            out[:] = [self.value(v) for v in out]
        elif isinstance(obj, dict):
            out = dict(obj) if self.copy else obj
            self.done[id(obj)] = out
            self.fill(out)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            out = copy.copy(obj) if self.copy else obj  # a copy's attributes are a new dict: filled in place
            self.done[id(obj)] = out
            self.fill(vars(out))
        else:
            out = self.done[id(obj)] = obj
        return out

    def fill(self, d: dict) -> None:
        for key, v in list(d.items()):
            d[key] = self.value(v)

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        if id(t) not in self.moved:
            self.moved[id(t)] = (t, self.move(t) if self.move is not None else t)
            self.nbytes += t.nbytes
        return self.moved[id(t)][1]


def portable_media(media: Media | None) -> Media | None:
    """`media` as a call in another process gets it: itself (a lazily decoded video pickles as what reopens its
    file, see `LazyFrames`, not as frames). MediaError when that file is gone."""
    if media is not None and media.is_lazy and not media.frames.file.exists():
        raise MediaError(f"'{media.frames.file.name}': the video's file is gone from the server; upload it again")
    return media


def _is_adapter(obj: Any) -> bool:
    from visualkv.models.base import ModelAdapter

    return isinstance(obj, ModelAdapter)


def _has_device(key: tuple) -> bool:
    return any(isinstance(k, torch.device) for k in key)


def _drop_views(session) -> None:
    """Views of the cache's buffers would move as copies of their own: drop them (rebuilt on first use)."""
    cache = session.cache
    if cache is None:
        return
    for layer in cache.layers:
        layer._segments = None  # `packed_segments()` rebuilds it from the moved buffers
    cache.static = None


def _state(session) -> dict[str, Any]:
    return {name: getattr(session, name) for name in STATE_FIELDS}


def _synchronize(devices: set[str]) -> None:
    """Wait for the copies (a non-blocking copy is not done when `to` returns): the moment the state is
    complete where it went, for the time reported. Runs between turns, never in a turn's hot path."""
    for device in map(torch.device, devices):
        if device.type == "cuda" and torch.cuda.is_available():
            torch.cuda.synchronize(device)


def _to_host(t: torch.Tensor, homes: list, pin: bool) -> torch.Tensor:
    """`t` on the host (pinned when `pin`); where it came from is noted in `homes` (host tensors stay as they are)."""
    if t.device.type == "cpu" and type(t) is torch.Tensor:
        return t
    # one host copy, straight into page-locked memory when `pin` (the next turn's copy back then runs
    # asynchronously); `park` synchronises before it reports
    out = torch.empty_like(t, device="cpu", pin_memory=pin)
    if type(out) is not torch.Tensor:  # a subclass that answers for another device (the tests' pretend GPU)
        out = out.as_subclass(torch.Tensor)
    out.copy_(t, non_blocking=True)
    homes.append((out, str(t.device)))
    return out


def park(session) -> ParkStats:
    """Move `session`'s state to the host (pinned where CUDA is available); a no-op when it is parked."""
    stats = session.park_stats
    if stats.parked:
        return stats
    t0 = time.perf_counter()
    _drop_views(session)
    homes: list[tuple[torch.Tensor, str]] = []
    mover = _Mover(partial(_to_host, homes=homes, pin=torch.cuda.is_available()))
    for name, value in _state(session).items():
        if name != "park_stats":
            setattr(session, name, mover.value(value))
    _synchronize({device for _, device in homes})
    stats.homes = homes
    stats.parked, stats.parked_bytes = True, mover.nbytes
    stats.moved_bytes = sum(t.nbytes for t, _ in homes)
    stats.park_seconds = time.perf_counter() - t0
    return stats


def unpark(session) -> ParkStats:
    """Move a parked `session`'s state back to the devices it came from; a no-op when it is not parked."""
    stats = session.park_stats
    if not stats.parked:
        return stats
    t0 = time.perf_counter()
    home = {id(t): device for t, device in stats.homes}

    def back(t: torch.Tensor) -> torch.Tensor:
        return t.to(home[id(t)], non_blocking=True) if id(t) in home else t

    mover = _Mover(back)
    for name, value in _state(session).items():
        if name != "park_stats":
            setattr(session, name, mover.value(value))
    _synchronize(set(home.values()))
    stats.homes, stats.parked = [], False
    stats.unpark_seconds = time.perf_counter() - t0
    return stats


@dataclass
class ParkedState:
    """A parked session's state, ready to cross a process boundary (`pickle`); no tensor on a device."""

    config: Any  # the SessionConfig
    state: dict[str, Any] = field(default_factory=dict)


def export_state(session) -> ParkedState:
    """The session's state for another process: parked first (so host-only), then copied without what belongs
    to this process (the model, callbacks); the session itself keeps all of it."""
    park(session)
    portable_media(session.media)  # a follow-up's call reopens the chat's video: its file must still be there
    mover = _Mover(strip=True, copy=True)
    return ParkedState(session.config, {name: mover.value(value) for name, value in _state(session).items()})


def adopt_state(session, parked: ParkedState) -> None:
    """Install `parked` (from `export_state`, maybe through pickle) into `session`; it stays parked until its
    next turn (`unpark`)."""
    session.config = parked.config
    mover = _Mover(adapter=session.adapter)
    for name, value in parked.state.items():
        setattr(session, name, mover.value(value))


def device_tensors(obj: Any) -> list[str]:
    """Where `obj` holds tensors off the host (a check for tests and the ZeroGPU bridge), the model aside: their
    paths."""
    found: list[str] = []
    _find(obj, "state", found, set(), lambda t: t.device.type != "cpu" or type(t) is not torch.Tensor)
    return found


def _find(obj: Any, path: str, found: list[str], seen: set[int], bad: Callable[[torch.Tensor], bool]) -> None:
    if isinstance(obj, torch.Tensor):
        if bad(obj):
            found.append(f"{path}: {type(obj).__name__} on {obj.device}")
        return
    if isinstance(obj, _LEAVES) or id(obj) in seen or isinstance(obj, torch.nn.Module) or _is_adapter(obj):
        return  # the model is not the session's state (it stays where it was loaded)
    seen.add(id(obj))
    if isinstance(obj, dict):
        for k, v in obj.items():
            _find(v, f"{path}[{k!r}]", found, seen, bad)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _find(v, f"{path}[{i}]", found, seen, bad)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        for k, v in vars(obj).items():
            _find(v, f"{path}.{k}", found, seen, bad)
