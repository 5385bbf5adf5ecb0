"""The settings form: every field checked and turned into the library's configs, and its reaction to a new method.

Number fields carry no bounds in Gradio (it would reject a bad value with an error badge over the outputs);
the checks here say what is wrong in one line naming the field and its range (ui/bounds.py: tighter when shared).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gradio as gr

from visualkv.errors import ConfigError
from visualkv.media import FrameSampling
from visualkv.runtime.session import SessionConfig
from visualkv.runtime.streaming import method_options

from . import text
from .bounds import LOCAL, FormBounds

MAX_FILE_BYTES = 200 * 1024**2  # default upload limit (a Space); `python app.py --max-upload 4GB` raises it


def _number(value, name: str, wanted: str) -> float:
    """`value` as a float, or a one-line ConfigError naming the field: empty, not a number (a string, a bool, a
    list sent to the API) or not finite."""
    if value is None or value == "":
        raise ConfigError(f"{name} is empty or not a number (too large, e.g. 1e999?): type {wanted}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be {wanted}, got {str(value)[:40]!r}")
    return float(value)


def whole(value, name: str, low: int, high: int | None = None, hint: str = "") -> int:
    """A number field's value as an int in [low, high], or a one-line ConfigError naming the field."""
    limit = f"between {low:,} and {high:,}" if high is not None else f"≥ {low:,}"
    number = _number(value, name, f"a whole number {limit}{hint}")
    if not math.isfinite(number) or number != int(number) or number < low or (high is not None and number > high):
        raise ConfigError(f"{name} must be a whole number {limit}{hint}, got {number:g}")
    return int(number)


def real(value, name: str, low: float, high: float, low_open: bool = False) -> float:
    """A number field's value as a float in [low, high] (or (low, high]), or a one-line ConfigError."""
    limit = f"{'above' if low_open else 'at least'} {low:g} and at most {high:g}"
    number = _number(value, name, f"a number {limit}")
    if not math.isfinite(number) or number < low or number > high or (low_open and number == low):
        raise ConfigError(f"{name} must be {limit}, got {number:g}")
    return number


def field_checks(bounds: FormBounds) -> dict[str, Callable[[Any], Any]]:
    """Each bounded number field's check, by its name in `FormValues` (and `SettingsPanel`): the value, or a
    one-line ConfigError naming the field and its range in `bounds`."""
    at = bounds.where
    return {
        "budget": lambda v: whole(
            v, "budget M", 0, bounds.budget, hint=f" (visual entries kept per layer and KV head; 0 = keep %){at}"
        ),
        "keep": lambda v: real(v, "keep %", 0.0, 100.0, low_open=True),
        "block_size": lambda v: whole(v, "block size", 0, bounds.block_size, hint=f" (0 = auto){at}"),
        "max_new": lambda v: whole(v, "max new tokens", 1, bounds.max_new, hint=at),
        "temperature": lambda v: real(v, "temperature", 0.0, bounds.temperature),
        "vision_ahead": lambda v: whole(
            v, "blocks per vision-tower call", 1, bounds.vision_ahead, hint=f" (1 = a call per block){at}"
        ),
        "fps": lambda v: real(v, "frames per second sampled", 0.0, bounds.fps, low_open=True),
        "max_frames": lambda v: whole(v, "frames sampled at most", 1, bounds.max_frames, hint=at),
    }


@dataclass(frozen=True)
class FormValues:
    """The settings column's values as a callback receives them (order: `SettingsPanel.inputs`)."""

    method: Any
    budget: Any  # 0: the budget is the `keep` share of the media's visual tokens
    keep: Any  # percent of the media's visual tokens kept per layer and KV head
    block_size: Any
    max_new: Any
    temperature: Any
    followup: Any
    prefill: Any
    vision_ahead: Any
    fps: Any
    max_frames: Any
    method_values: tuple = ()  # every method-settings input, in the order of `method_keys`

    def settings_of(self, method: str, method_keys: list[tuple[str, str]]) -> dict[str, Any]:
        """The values of `method`'s own settings inputs, by setting key."""
        return {key: v for (name, key), v in zip(method_keys, self.method_values) if name == method}

    def session_config(self, method_keys: list[tuple[str, str]], bounds: FormBounds = LOCAL) -> SessionConfig:
        """The session config, checking every field first against `bounds` (one line naming the field)."""
        method = self.method
        if method not in text.method_choices():
            raise ConfigError(f"unknown method {method!r}; choose one of: {', '.join(text.method_choices())}")
        needs_budget = text.traits(method).needs_budget
        check = field_checks(bounds)
        budget, keep = self.budget_or_keep(bounds) if needs_budget else (None, None)
        cfg = SessionConfig(
            method=method,
            budget=budget,
            keep=keep,
            block_size=check["block_size"](self.block_size) or None,
            prefill=None if self.prefill in (None, "auto") else self.prefill,
            max_new_tokens=check["max_new"](self.max_new),
            temperature=check["temperature"](self.temperature),
            followup=self.followup or "reuse",
            vision_ahead=check["vision_ahead"](self.vision_ahead),
            method_options=method_options(method, self.method_settings(method, method_keys, bounds)),
        )
        cfg.validate()
        return cfg

    def budget_or_keep(self, bounds: FormBounds = LOCAL) -> tuple[int | None, float | None]:
        """(budget, keep share): budget M when it is not 0, else the keep % field as a share. Both fields are
        checked either way (one line naming the field): a bad value on the page is never silently ignored."""
        check = field_checks(bounds)
        budget, keep = check["budget"](self.budget), check["keep"](self.keep) / 100
        return (budget, None) if budget else (None, keep)

    def method_settings(self, method: str, method_keys: list[tuple[str, str]], bounds: FormBounds) -> dict[str, Any]:
        """`method`'s own settings, each under its cap in `bounds` (one line naming it); the library checks the
        rest of each setting's range."""
        values = self.settings_of(method, method_keys)
        for key, value in values.items():
            cap = bounds.method.get(key.rsplit(":", 1)[-1])
            if cap is not None and isinstance(value, (int, float)) and value > cap:
                label = key.rsplit(":", 1)[-1].replace("_", " ")
                raise ConfigError(f"{method} {label} must be at most {cap:,}{bounds.where}, got {value:g}")
        return values

    def sampling(self, bounds: FormBounds = LOCAL) -> FrameSampling:
        """How a video is sampled: the two video fields, checked against `bounds`."""
        check = field_checks(bounds)
        rate, count = check["fps"](self.fps), check["max_frames"](self.max_frames)
        try:
            return FrameSampling(fps=rate, max_frames=count)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"video sampling: {exc}") from None


#: the settings column's first values (ui/layout.py builds its fields from them): what a first visitor's turn,
#: an example card's included, runs with
DEFAULTS = FormValues(
    method="blockwise-snapkv", budget=0, keep=10, block_size=0, max_new=64, temperature=0.0, followup="reuse",
    prefill="auto", vision_ahead=1, fps=1.0, max_frames=32,
)  # fmt: skip


class MethodChoice:
    """The settings column's answer to a new method or follow-up choice."""

    def __init__(self) -> None:
        self.group_names: list[str] = []  # methods with a settings group, in output order

    def method_changed(self, method, followup, state=None):
        """Method or follow-up choice changed: its help, the keep and budget fields, its settings group, and the
        follow-up note of the method the chat really runs (a started chat keeps its own; no note before a
        chat exists)."""
        cls = text.traits(method)
        uses = bool(cls and cls.needs_budget)
        keep = gr.update(interactive=uses, info=text.keep_info(method))
        budget = gr.update(interactive=uses, info=text.budget_info(method))
        groups = [gr.update(visible=name == method) for name in self.group_names]
        started = state is not None and (state.session is not None or bool(state.history))
        chat = state.session.config if started and state.session is not None else None
        note = (
            text.chat_followup_note(chat.method if chat else None, chat.followup if chat else None, method, followup)
            if started
            else ""
        )
        return (text.method_line(method), keep, budget, note, *groups)
