"""Exceptions VisualKV raises on purpose.

Every message is one line that says what went wrong and what to do about it, so the CLI and the UI
can show it as is, without a traceback.
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Callable, Iterator
from contextvars import ContextVar


class VisualKVError(Exception):
    """Base class of every error VisualKV raises deliberately (one-line, actionable message)."""


class MediaError(VisualKVError):
    """An image or video could not be loaded, validated or sampled."""


class ModelLoadError(VisualKVError):
    """A model id or path could not be resolved or loaded."""


class ConfigError(VisualKVError):
    """An option value is out of range or inconsistent."""


class PrefillStopped(VisualKVError):
    """A stop request (Stop or a time limit) ended a prefill; the partial cache is discarded."""

    def __init__(self, message: str = "stopped while reading the media; nothing was kept") -> None:
        super().__init__(message)


#: the running prefill's Stop, for steps that no argument reaches (a video processor's chunks, a vision tower's
#: blocks inside a model adapter); set by `stop_scope` for one thread's prefill, read by `stop_point`
_SHOULD_STOP: ContextVar[Callable[[], bool] | None] = ContextVar("visualkv_should_stop", default=None)


@contextlib.contextmanager
def stop_scope(should_stop: Callable[[], bool] | None) -> Iterator[None]:
    """Within the block (this thread only), `stop_point` asks `should_stop`."""
    token = _SHOULD_STOP.set(should_stop)
    try:
        yield
    finally:
        _SHOULD_STOP.reset(token)


def stop_point() -> None:
    """Raise PrefillStopped when the enclosing `stop_scope`'s Stop says so (a Python call: no host sync)."""
    should_stop = _SHOULD_STOP.get()
    if should_stop is not None and should_stop():
        raise PrefillStopped()


def check_range(name: str, value: object, low: float, high: float, whole: bool = False) -> None:
    """Raise ConfigError, one line naming the setting, its value and the allowed range, unless `value` is a
    number (a whole one if `whole`) in [low, high]. Every setting that decides how much is computed has such a
    bound, checked before any compute."""
    number = value if isinstance(value, numbers.Real) and not isinstance(value, bool) else None
    fits = number is not None and low <= number <= high  # NaN fails every comparison
    if fits and whole:
        fits = float(number).is_integer()
    if not fits:
        kind = "a whole number" if whole else "a number"
        raise ConfigError(f"{name} must be {kind} from {_shown(low)} to {_shown(high)}, got {value!r}")


def _shown(bound: float) -> str:
    return f"{int(bound):,}" if float(bound).is_integer() else f"{bound:g}"
