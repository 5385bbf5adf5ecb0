"""Every value an event receives, checked by the app before Gradio preprocesses it.

The page sends only what its fields allow, but the API (`/gradio_api/call/<name>`, the queue's join, `run/predict`)
takes any JSON: NaN, ±Infinity, a string for a number, a choice not in the list, a number past its field's range.
Gradio's own preprocessing would raise on many of them with a multi-line error and a traceback in the server log
(an easy way to flood it). Here each input of each event is checked first, by its component's kind and, for the
settings form's number fields, as numbers the page could send: the range of a number one can type there is the
turn's own first check (ui/forms.py, the ranges of ui/bounds.py), which the page shows in its error field. The
first bad value is refused with the app's one line naming the field (and its range), as a `gr.Error` that prints
no traceback. What passes is then preprocessed by Gradio as usual (uploaded files are still checked by it).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import gradio as gr

from visualkv.errors import ConfigError
from visualkv.methods import make_method
from visualkv.runtime.question import CHARS_PER_TOKEN, check_characters
from visualkv.runtime.streaming import method_options

from .bounds import LOCAL, FormBounds
from .forms import DEFAULTS, field_checks

Check = Callable[[Any], Any]  # raises ConfigError (one line) on a bad value


class CheckedBlocks(gr.Blocks):
    """gr.Blocks whose events refuse a bad value in one line before Gradio preprocesses it (`ApiValues`)."""

    api_values: ApiValues | None = None

    async def preprocess_data(self, block_fn, inputs, state, explicit_call: bool = False):
        if self.api_values is not None:
            line = self.api_values.refusal(block_fn, inputs, state)
            if line is not None:
                raise gr.Error(line, print_exception=False)
        return await super().preprocess_data(block_fn, inputs, state, explicit_call)


def _name(component) -> str:
    """How a refusal names a field: its label, else what it is."""
    label = getattr(component, "label", None)
    if label:
        return str(label)
    return "the question" if isinstance(component, gr.MultimodalTextbox) else type(component).__name__


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _file_data(value) -> bool:
    """Whether `value` has the shape of Gradio's file data (a path; Gradio then checks where it points)."""
    return isinstance(value, dict) and isinstance(value.get("path"), str)


def _choices(component) -> list:
    return [value for _, value in (getattr(component, "choices", None) or [])]


class ApiValues:
    """The app's checks of raw event values: the form's bounded fields by their own checks, every other input by
    its component's kind."""

    def __init__(self, bounds: FormBounds = LOCAL) -> None:
        self.max_chars = bounds.question_tokens * CHARS_PER_TOKEN  # longer text is refused unread anyway
        self._checks: dict[int, Check] = {}  # component id -> its field's own check
        self._bounds = bounds

    def add_form(self, settings) -> None:
        """The settings form's bounded number fields (`SettingsPanel`'s fields named as in `field_checks`): a
        finite number or nothing passes, as the page can send it; its range is the turn's own first check (the
        page shows that line in its error field, the API gets it as the event's error line), before any
        compute."""
        for name in field_checks(self._bounds):
            component = getattr(settings, name)
            self._checks[component._id] = functools.partial(self._typed_number, component)

    def _typed_number(self, component, value) -> None:
        if value is not None and not _finite(value):
            raise ConfigError(f"{_name(component)} must be a finite number, got {value!r:.40}")

    def add_clamped(self, component) -> None:
        """A number input whose callback clamps it to its range (the overlay opacity): any finite number goes on."""
        self._checks[component._id] = functools.partial(self._typed_number, component)

    def add_methods(self, method_inputs: list[tuple[str, str, Any]]) -> None:
        """Each method setting's input (`SettingsPanel.method_inputs`): its kind, its cap on this instance and
        the method's own range (the method is built with that one value), whichever method is chosen."""
        for method, key, component in method_inputs:
            self._checks[component._id] = functools.partial(self._method_setting, method, key, component)

    def _method_setting(self, method: str, key: str, component, value) -> None:
        kind = _KINDS.get(type(component))
        if kind is not None:
            kind(self, component, value)
        if value is None or value == "" or value == component.value:  # the default is the method's own
            return
        form = dataclasses.replace(DEFAULTS, method=method, method_values=(value,))
        values = form.method_settings(method, [(method, key)], self._bounds)  # the cap (one line)
        try:
            make_method(method, **method_options(method, values))
        except ConfigError as exc:
            raise ConfigError(f"{method} {_name(component)}: {exc}") from None
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{method} {_name(component)}: {str(exc).splitlines()[0][:200]}") from None

    def refusal(self, block_fn, inputs: list, state=None) -> str | None:
        """The one line refusing the first bad value of `inputs` for `block_fn`, or None when all may go on."""
        if not isinstance(inputs, list) or len(inputs) != len(block_fn.inputs):
            return f"this endpoint takes {len(block_fn.inputs)} value(s), in the order of its API page"
        for component, value in zip(block_fn.inputs, inputs):
            if state is not None and not component.stateful and component._id in state:  # its updated choices
                component = state[component._id]
            try:
                self._check(component, value)
            except ConfigError as exc:
                return str(exc)
        return None

    def _check(self, component, value) -> None:
        own = self._checks.get(component._id)
        if own is not None:
            own(value)
            return
        kind = _KINDS.get(type(component))
        if kind is not None:
            kind(self, component, value)

    # -- by kind -----------------------------------------------------------------------------
    def _number(self, component, value) -> None:
        if value is None:
            return
        low, high = getattr(component, "minimum", None), getattr(component, "maximum", None)
        whole = getattr(component, "precision", None) == 0
        fits = _finite(value) and (not whole or value == int(value))
        fits = fits and (low is None or value >= low) and (high is None or value <= high)
        if not fits:
            span = f" from {low:g} to {high:g}" if low is not None and high is not None else ""
            raise ConfigError(
                f"{_name(component)} must be a finite {'whole ' if whole else ''}number{span}, got {value!r:.40}"
            )

    def _choice(self, component, value) -> None:
        choices = _choices(component)
        many = getattr(component, "multiselect", None) or isinstance(component, gr.CheckboxGroup)
        values = value if many and isinstance(value, list) else [value]
        if (many and not isinstance(value, list)) or any(v not in choices for v in values if v is not None):
            shown = ", ".join(map(str, choices[:16]))
            raise ConfigError(f"{_name(component)} must be {'some' if many else 'one'} of: {shown}; got {value!r:.60}")

    def _flag(self, component, value) -> None:
        if not isinstance(value, bool) and value is not None:
            raise ConfigError(f"{_name(component)} must be true or false, got {value!r:.40}")

    def _text(self, component, value) -> None:
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"{_name(component)} must be text, got {value!r:.40}")
        if value is not None and len(value) > self.max_chars:
            raise ConfigError(f"{_name(component)} must be at most {self.max_chars:,} characters, got {len(value):,}")

    def _message(self, component, value) -> None:
        """The shape Gradio's own data model takes: "text" (a string) and "files" (a list, here of at most one
        file); other keys are dropped by it unread (the page itself sends Gradio's `__type__` marker once a turn
        has emptied the box), so they pass."""
        if value is None:
            return
        files = value.get("files", []) if isinstance(value, dict) else None
        if not isinstance(value, dict) or not isinstance(files, list):
            raise ConfigError(f'{_name(component)} must be {{"text": ..., "files": [at most one file]}}')
        if len(files) > 1 or not all(_file_data(f) for f in files):
            raise ConfigError(f"{_name(component)} takes at most one file, as Gradio's file data")
        text = value.get("text")
        if not isinstance(text, str):
            raise ConfigError(f"{_name(component)} must be text, got {text!r:.40}")
        check_characters(text, self._bounds.question_tokens, self._bounds.where)

    def _file(self, component, value) -> None:
        if value is not None and not _file_data(value):
            raise ConfigError(f"{_name(component)} must be one file, as Gradio's file data, got {value!r:.40}")


_KINDS: dict[type, Callable[[ApiValues, Any, Any], None]] = {
    gr.Number: ApiValues._number,
    gr.Slider: ApiValues._number,
    gr.Dropdown: ApiValues._choice,
    gr.Radio: ApiValues._choice,
    gr.CheckboxGroup: ApiValues._choice,
    gr.Checkbox: ApiValues._flag,
    gr.Textbox: ApiValues._text,
    gr.HTML: ApiValues._text,
    gr.Markdown: ApiValues._text,
    gr.MultimodalTextbox: ApiValues._message,
    gr.File: ApiValues._file,
}
