"""Parked sessions: between turns a chat holds no device tensor.

A compressed cache is small, so it can wait on the host between turns and move to the device in milliseconds
when the next turn starts. That lets one GPU serve many idle chats, and it is what a shared GPU that is lent per
call (Hugging Face ZeroGPU) requires: there a turn runs in a worker process, and everything a follow-up needs
crosses the process boundary by pickling.

What moves is the session's `ChatState` (`visualkv.runtime.session`), one object, through its own pickling
protocol: the state is pickled with every tensor taken out by reference (`persistent_id`) and loaded back with
each tensor replaced, so each distinct tensor moves once and shared references stay shared. `park(session)` moves
its tensors (the cache's buffers, every tier, packed INT8 / INT4 included, the prepared input, the prefill's context
and logits, the method's state) to the host, pinned where CUDA is available (views of the cache's buffers are
dropped, rebuilt on first use); `unpark(session)` moves each back to the device it came from (a sharded model's cache
stays sharded; host tensors stay on the host). Within the process the model, functions, host arrays and media are
kept by reference, neither copied nor moved. `export_state` / `adopt_state` hand a parked state to another process
as one picklable `ParkedState` (the state's bytes beside its host tensors), without what belongs to this process
(the model, the engine's callbacks). `resolve_park` decides whether a session parks: "always", "never" or "auto" (on
ZeroGPU and in shared mode).
"""

from __future__ import annotations

import io
import os
import pickle
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


_FUNCTIONS = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, partial)


def _process_bound(obj: Any) -> bool:
    """A function of the running process that a parked state never carries to another (the engine's text pass, a
    Stop check): a lambda or local function, or one bound to an object. Functions named by their module (what
    pickling itself uses to rebuild objects) are not."""
    if isinstance(obj, partial):
        return True
    if isinstance(obj, types.FunctionType):
        return "<" in obj.__qualname__
    owner = getattr(obj, "__self__", None)
    return owner is not None and not isinstance(owner, (types.ModuleType, type))


#: values kept by reference within the process (no tensor inside; media frames are host arrays or a lazy reader)
_BY_REFERENCE = (np.ndarray, Media, LazyFrames)


class _Packer(pickle.Pickler):
    """Pickles a state with its tensors taken out (`tensors`, each distinct one once, in order) and the model left
    out; `local`: for this process (functions, host arrays and media kept in `refs`), else for another (functions
    dropped, host arrays and media pickled)."""

    def __init__(self, file: io.BytesIO, local: bool) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.local = local
        self.tensors: list[torch.Tensor] = []
        self.refs: list[Any] = []
        self._index: dict[int, int] = {}  # id of a tensor -> its place in `tensors`

    def persistent_id(self, obj: Any) -> tuple | None:
        if isinstance(obj, torch.Tensor):
            if id(obj) not in self._index:
                self._index[id(obj)] = len(self.tensors)
                self.tensors.append(obj)
            return ("tensor", self._index[id(obj)])
        if isinstance(obj, torch.nn.Module) or _is_adapter(obj):  # the model never moves: it stays where it is
            return self._ref(obj) if self.local else ("adapter",)
        if self.local:  # functions, host arrays and media stay as they are
            return self._ref(obj) if isinstance(obj, (*_FUNCTIONS, *_BY_REFERENCE)) else None
        return ("none",) if isinstance(obj, _FUNCTIONS) and _process_bound(obj) else None

    def _ref(self, obj: Any) -> tuple:
        self.refs.append(obj)
        return ("ref", len(self.refs) - 1)


class _Unpacker(pickle.Unpickler):
    """Loads what `_Packer` wrote, with `tensors` in the tensors' places and `adapter` as the model."""

    def __init__(self, data: bytes, tensors: list[torch.Tensor], refs: list[Any], adapter: Any = None) -> None:
        super().__init__(io.BytesIO(data))
        self.tensors, self.refs, self.adapter = tensors, refs, adapter

    def persistent_load(self, pid: tuple) -> Any:
        kind = pid[0]
        if kind == "tensor":
            return self.tensors[pid[1]]
        if kind == "ref":
            return self.refs[pid[1]]
        return self.adapter if kind == "adapter" else None


def _packed(obj: Any, local: bool) -> tuple[bytes, _Packer]:
    buffer = io.BytesIO()
    packer = _Packer(buffer, local)
    packer.dump(obj)
    return buffer.getvalue(), packer


def _moved(obj: Any, move: Callable[[torch.Tensor], torch.Tensor]) -> tuple[Any, list[torch.Tensor]]:
    """(a copy of `obj` whose every tensor is `move(tensor)`, the tensors of `obj`); within this process."""
    data, packer = _packed(obj, local=True)
    return _Unpacker(data, [move(t) for t in packer.tensors], packer.refs).load(), packer.tensors


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


def _drop_views(cache) -> None:
    """Views of the cache's buffers would move as copies of their own: drop them (rebuilt on first use)."""
    if cache is None:
        return
    for layer in cache.layers:
        layer._segments = None  # `packed_segments()` rebuilds it from the moved buffers
    cache.static = None


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
    if session.state.park_stats.parked:
        return session.state.park_stats
    t0 = time.perf_counter()
    _drop_views(session.state.cache)
    homes: list[tuple[torch.Tensor, str]] = []
    session.state, tensors = _moved(session.state, partial(_to_host, homes=homes, pin=torch.cuda.is_available()))
    _synchronize({device for _, device in homes})
    stats = session.state.park_stats
    stats.homes = homes
    stats.parked, stats.parked_bytes = True, sum(t.nbytes for t in tensors)
    stats.moved_bytes = sum(t.nbytes for t, _ in homes)
    stats.park_seconds = time.perf_counter() - t0
    return stats


def unpark(session) -> ParkStats:
    """Move a parked `session`'s state back to the devices it came from; a no-op when it is not parked."""
    if not session.state.park_stats.parked:
        return session.state.park_stats
    t0 = time.perf_counter()
    home = {id(t): device for t, device in session.state.park_stats.homes}

    def back(t: torch.Tensor) -> torch.Tensor:
        return t.to(home[id(t)], non_blocking=True) if id(t) in home else t

    session.state, _ = _moved(session.state, back)
    _synchronize(set(home.values()))
    stats = session.state.park_stats
    stats.homes, stats.parked = [], False
    stats.unpark_seconds = time.perf_counter() - t0
    return stats


@dataclass
class ParkedState:
    """A parked session's state, ready to cross a process boundary (`pickle`); no tensor on a device.

    state: the `ChatState` pickled without its tensors, the model or this process's functions; tensors: its host
    tensors, in the order `state` refers to them (pickled as tensors, by torch)."""

    config: Any  # the SessionConfig
    state: bytes = b""
    tensors: list[torch.Tensor] = field(default_factory=list)


def export_state(session) -> ParkedState:
    """The session's state for another process: parked first (so host-only), then pickled without what belongs
    to this process (the model, callbacks); the session itself keeps all of it."""
    park(session)
    portable_media(session.state.media)  # a follow-up's call reopens the chat's video: its file must still be there
    data, packer = _packed(session.state, local=False)
    return ParkedState(session.config, data, packer.tensors)


def adopt_state(session, parked: ParkedState) -> None:
    """Install `parked` (from `export_state`, maybe through pickle) into `session`; it stays parked until its
    next turn (`unpark`)."""
    session.config = parked.config
    session.state = _Unpacker(parked.state, parked.tensors, [], session.adapter).load()


def device_tensors(obj: Any) -> list[str]:
    """The tensors `obj` holds off the host (a check for tests and the ZeroGPU bridge), the model aside: each as
    its type, shape and device. Found by pickling `obj` as a park does (within this process)."""
    _, packer = _packed(obj, local=True)
    return [
        f"{type(t).__name__}{tuple(t.shape)} on {t.device}"
        for t in packer.tensors
        if t.device.type != "cpu" or type(t) is not torch.Tensor
    ]
