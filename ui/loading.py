"""Model loading: the start model, and the Load model button.

A load holds the compute queue like a chat turn, so it counts in the positions of the turns and comparisons
waiting behind it.
"""

from __future__ import annotations

import html

import gradio as gr

from visualkv.runtime.streaming import failure_message

from . import text
from .compare import empty_compare
from .context import AppContext
from .state import ModelCache, default_offline_model, is_offline_model
from .status import error_line
from .views import empty_views


def start_model(cache: ModelCache, requested: str | None) -> tuple[str, str | None]:
    """Load the start model: `requested` if given and loadable, else an offline model (and why)."""
    if requested:
        try:
            cache.get(requested)
            return requested, None
        except Exception as exc:  # noqa: BLE001 - start on an offline model instead, and say so
            return default_offline_model(cache), str(exc)
    return default_offline_model(cache), None


class ModelLoading:
    """The Load model button. Outputs: state, model note, error, chat, progress, memory chart, download,
    summary, the result tabs, then Compare's table, chart and status (a new chat: old results go)."""

    def __init__(self, context: AppContext) -> None:
        self.context = context

    def load_model(self, request: gr.Request, choice, typed, state, progress=gr.Progress()):  # noqa: B008 - Gradio injects progress
        """Loads (or builds) a model into the shared cache and starts a new chat on it; a failure keeps the
        current model."""
        st = self.context.user_state(state)
        skip = gr.skip()
        name = (typed or "").strip() or (choice or "").strip()
        keep = (skip,) * (5 + len(empty_views()) + len(empty_compare()))  # chat … summary, views, Compare's
        if not name:
            return (st, skip, error_line("Choose a model or type a Hub id / local folder."), *keep)
        progress(0.1, desc=f"loading {name}…")
        try:
            self.context.cache.get(name)
        except Exception as exc:  # noqa: BLE001 - ModelLoadError or anything else: keep the current model
            return (st, skip, error_line(f"{failure_message(exc)} — still using {st.model_name}."), *keep)
        progress(1.0, desc="loaded")
        st.model_name = name
        st.new_chat()  # a chat's cache belongs to its model: every result view of the old one goes
        note = text.offline_note(name, is_offline_model(name))
        return (
            st,
            note,
            "",
            [],
            f"Loaded {html.escape(name)}; new chat started.",
            None,
            gr.update(value=None, interactive=False),
            "",
            *empty_views(),
            *empty_compare(),
        )
