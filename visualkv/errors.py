"""Exceptions VisualKV raises on purpose.

Every message is one line that says what went wrong and what to do about it, so the CLI and the UI
can show it as is, without a traceback.
"""

from __future__ import annotations


class VisualKVError(Exception):
    """Base class of every error VisualKV raises deliberately (one-line, actionable message)."""


class MediaError(VisualKVError):
    """An image or video could not be loaded, validated or sampled."""


class ModelLoadError(VisualKVError):
    """A model id or path could not be resolved or loaded."""


class ConfigError(VisualKVError):
    """An option value is out of range or inconsistent."""


class PrefillStopped(VisualKVError):
    """A stop request ended a prefill at a block boundary; the partial cache is discarded."""

    def __init__(self, message: str = "stopped while reading the media; nothing was kept") -> None:
        super().__init__(message)
