"""The Compare tab's callbacks: the chat's media (or a file given there) and one question through several methods.

Each method runs in a fresh cache through `visualkv.runtime.streaming.stream_compare`; the table and the chart
come from `visualkv.report.viz`. Outputs: table, chart, status line, state (a session's first event may be a
comparison: its Stop needs the state this run uses).
"""

from __future__ import annotations

import dataclasses
import html
import threading
import time
from typing import Any

import gradio as gr

from visualkv.errors import ConfigError, VisualKVError
from visualkv.media import load_media, media_kind
from visualkv.report import viz
from visualkv.runtime.frame_cap import is_bounded
from visualkv.runtime.question import question_tokens
from visualkv.runtime.streaming import COMPARED_BY_DEFAULT, compared_by_default, failure_message, method_options

from . import text
from .context import AppContext
from .evidence import table_columns, table_update
from .forms import FormValues
from .gpu import stream_compare  # through a ZeroGPU call where the app runs on one
from .state import UserState
from .status import (
    COMPARE_STOPPING,
    LIVE_UPDATE_SECONDS,
    PREFILL_LABEL,
    READING_LABEL,
    WITHDRAWN_COMPARE,
    error_line,
)


def default_ticks(kind: str, method_names: list[str]) -> list[str]:
    """The methods ticked by default for media of `kind` ("image" or "video"), in menu order (the library chooses)."""
    return compared_by_default(kind, method_names)


def empty_compare() -> tuple:
    """Compare's table, chart, status line and whole-answer line with no comparison (outputs: table, chart,
    status, answer)."""
    return [], None, "", ""


#: said after a finished comparison: the table shows one line of each answer
WHOLE_ANSWER_HINT = "click a row to read its answer in full"


def whole_answer(evt: gr.SelectData) -> str:
    """The line under Compare's table for the clicked row: its method and its whole answer (the last column)."""
    row = evt.row_value or []
    if len(row) < 2:
        return ""
    return f"**{text.md_escape(str(row[0]))}**: {text.md_escape(str(row[-1]))}"


@dataclasses.dataclass
class Comparison:
    """A comparison ready to run: its checked inputs."""

    adapter: Any
    media: Any
    question: str
    methods: list[str]
    base: Any  # the SessionConfig every method starts from
    options: dict[str, dict]  # each method's own settings


class CompareCallbacks:
    """Compare (queued and run) and Compare's own Stop."""

    def __init__(self, context: AppContext) -> None:
        self.context = context
        self.method_names: list[str] = []  # the Compare tab's methods, in menu order (set when the page is built)

    def compare_queued(self, request: gr.Request, state):
        """Runs at once when Compare is clicked, just before the comparison joins Gradio's queue: starts the
        page's watch of where it waits (`compare_where`)."""
        self.context.queue.sent(request, "compare")
        return gr.Timer(active=True)

    def compare_where(self, request: gr.Request):
        """A tick of the page's watch: where the comparison waits now, in Compare's status line (nothing once it
        runs, or when it was refused or withdrawn)."""
        line, again = self.context.queue.watch(request, "compare")
        return (gr.skip() if line is None else line), gr.Timer(active=again)

    def compare(
        self,
        request: gr.Request,
        state,
        methods,
        question,
        file,
        evidence,
        method,
        budget,
        keep,
        block_size,
        max_new,
        temperature,
        followup,
        prefill,
        vision_ahead,
        fps,
        max_frames,
        *method_values,
    ):
        """Generator: the ticked methods one after another (outputs: see the module's docstring).

        Stoppable (`stop_compare`, New chat) and bounded by the turn time limit as a whole: on a shared
        instance one comparison holds the model no longer than one chat turn may."""
        skip, queue = gr.skip(), self.context.queue
        if not queue.comes_up(request, "compare"):
            yield skip, skip, WITHDRAWN_COMPARE, skip
            return
        st = self.context.user_state(state)
        question = (question or "").strip() or st.first_prompt
        path = file or st.media_path
        form = FormValues(
            method, budget, keep, block_size, max_new, temperature, followup, prefill, vision_ahead, fps, max_frames,
            method_values,
        )  # fmt: skip
        try:
            run = self._prepare(st, methods, question, path, form)
            run.base = dataclasses.replace(run.base, evidence=bool(evidence))  # the recall column, opt-in
        except Exception as exc:  # noqa: BLE001 - shown in the status line
            yield skip, skip, error_line(failure_message(exc), [path] if path else None), skip
            return
        st.stop = threading.Event()
        queue.active[id(st)] = "compare"
        try:
            yield table_columns(bool(evidence)), skip, f"running {len(methods)} methods…", st
            yield from self._run(st, run)
        except Exception as exc:  # noqa: BLE001 - shown in the status line
            yield skip, skip, error_line(failure_message(exc), [path]), skip
        finally:
            queue.active.pop(id(st), None)

    def ticks_for_media(self, state, file, ticked):
        """The method ticks after Compare's file or the chat's media changed: the defaults for that media's kind,
        unless the ticks are the user's own (they are then kept)."""
        path = file or getattr(state, "media_path", None)
        try:
            kind = media_kind(path) if path else "image"
        except VisualKVError:  # an unreadable file: its own error comes with the comparison
            return gr.skip()
        names = self.method_names
        if sorted(ticked or []) not in [sorted(default_ticks(k, names)) for k in COMPARED_BY_DEFAULT]:
            return gr.skip()
        return default_ticks(kind, names)

    def _prepare(self, st: UserState, methods, question: str, path, form: FormValues) -> Comparison:
        """Every input checked and the media read (raises with one line): the form's fields first, as in a chat
        turn, so a value out of its range is named whatever else is missing."""
        keys, bounds = self.context.method_keys, self.context.bounds
        base = form.session_config(keys, bounds)
        sampling = form.sampling(bounds)
        if not question:
            raise ConfigError("type a question (or chat first: the chat's first question is the default)")
        if not path:
            raise ConfigError("give a file here or start a chat with an image or video first")
        if not methods:
            raise ConfigError("tick at least one method to compare")
        question_tokens(self.context.cache.get(st.model_name).tokenizer, question, bounds.question_tokens, bounds.where)
        budget, keep = form.budget_or_keep(bounds)  # for the methods using one
        base = dataclasses.replace(base, budget=budget, keep=keep)
        options = {name: method_options(name, form.method_settings(name, keys, bounds)) for name in methods}
        # one input for every ticked method: the frame cap of the first that holds every frame, if any
        capped = next((m for m in methods if not is_bounded(m)), methods[0])
        media = load_media(path, limits=self.context.media_limits(capped), sampling=sampling)
        adapter = self.context.cache.get(st.model_name)
        return Comparison(adapter, media, question, methods, base, options)

    def _run(self, st: UserState, run: Comparison):
        """The comparison's events, as outputs: a status line per method and block, a table row per result."""
        skip, limit = gr.skip(), self.context.turn_time_limit
        epoch = st.epoch  # New chat or Load model meanwhile cleared the results: this run then writes nothing
        results: dict[str, Any] = {}
        last_update = float("-inf")
        events = stream_compare(
            run.adapter, run.media, run.question, run.methods, run.base, run.options, st.stop, time_limit=limit
        )
        for kind, payload in events:
            if st.epoch != epoch:
                return
            if kind == "method":
                name, index, total = payload
                position = f"{index + 1}/{total}"
                yield skip, skip, f"{position} · {name}: {READING_LABEL}", skip
            elif kind == "block":
                name, block = payload
                done, now = block.index + 1, time.monotonic()
                if now - last_update < LIVE_UPDATE_SECONDS and done < block.n_blocks:
                    continue  # at most a few status lines a second (the last block's always)
                line = COMPARE_STOPPING if st.stop.is_set() else f"{PREFILL_LABEL} {done}/{block.n_blocks}"
                yield skip, skip, f"{position} · {name}: {line}", skip
                last_update = time.monotonic()
            else:
                if kind == "result":
                    name, report = payload
                    results[name] = report
                    line = f"{len(results)}/{len(run.methods)} done"
                elif kind == "stopped":
                    line = self._stopped_line(*payload)
                else:  # done
                    line = f"done: {len(results)} methods on “{html.escape(run.question)}” ({WHOLE_ANSWER_HINT})"
                yield table_update(results), viz.compare_memory_figure(results), line, skip

    def _stopped_line(self, message: str, by_time_limit: bool) -> str:
        if by_time_limit:
            return (
                f"{message[0].upper()}{message[1:]} ({self.context.turn_time_limit:g} s on this instance; "
                "fewer methods, a smaller budget or fewer frames fit in it)"
            )
        return f"{message[0].upper()}{message[1:]}; the table keeps the finished ones"

    def stop_compare(self, request: gr.Request, state):
        """Compare's own Stop: the running method ends within a layer (a prefill) or a token, and a waiting
        comparison will not run. For a running one it writes nothing: the browser shows "stopping…" itself,
        and the comparison's own last status line, which may come first, must not be overwritten."""
        queue = self.context.queue
        if state is not None and queue.active.get(id(state)) == "compare":
            state.stop.set()
        elif queue.withdraw(request, "compare"):
            return WITHDRAWN_COMPARE
        return gr.skip()
