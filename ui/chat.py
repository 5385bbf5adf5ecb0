"""The chat's callbacks: a turn sent, streamed and stopped, and New chat.

A turn runs through `visualkv.runtime.streaming.stream_turn`; its live chart and summary come from
`visualkv.report.viz`. Every failure a user can cause is shown in the error line and leaves the chat, its
cache and the loaded model as they were. Outputs of a turn: chatbot, input, state, error, progress, memory
chart, download, summary, follow-up note.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr

from visualkv.errors import ConfigError, VisualKVError
from visualkv.media import load_media
from visualkv.report import viz
from visualkv.report.telemetry import TIME_LIMIT_STOP
from visualkv.runtime.question import question_tokens
from visualkv.runtime.session import ChatSession, SessionConfig
from visualkv.runtime.streaming import TIME_LIMIT_STOPPED, failure_message, live_report, turn_report

from . import text
from .compare import empty_compare
from .context import AppContext
from .forms import FormValues
from .gpu import stream_turn  # through a ZeroGPU call where the app runs on one
from .state import UserState, write_report
from .status import (
    LIVE_UPDATE_SECONDS,
    PREFILL_LABEL,
    READING_LABEL,
    SEND_REFUSED,
    WITHDRAWN_TURN,
    block_kind,
    done_label,
    error_line,
    progress_html,
)
from .views import empty_views


class ReportFiles:
    """Each turn's report as a JSON file of its own, for the download button."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="visualkv-reports-"))

    def write(self, report: dict[str, Any], previous: str | None) -> str:
        """Writes `report` (the session's `previous` file is deleted). The media's path is reduced to its
        file name: the server's upload folder is nobody's business."""
        if previous and Path(previous).parent.parent == self.folder:
            shutil.rmtree(Path(previous).parent, ignore_errors=True)
        folder = Path(tempfile.mkdtemp(dir=self.folder))
        path = folder / "visualkv_report.json"
        write_report(report, str(path))
        return str(path)


class FileRefused(ConfigError):
    """The file sent with a turn could not be used (unreadable, too large, too long): it leaves the input."""


@dataclass
class Turn:
    """One running turn: what its events need to update the page."""

    st: UserState
    session: ChatSession
    prompt: str
    media: Any  # the file sent with this turn (None for a follow-up)
    files: list[str]
    before: list[dict[str, Any]]  # the chat's messages before this turn: restored if it fails or stops
    new_session: bool
    cfg: SessionConfig
    notes: list[str]  # said at the end of the progress line


class ChatCallbacks:
    """Send (Enter or the button), Stop and New chat."""

    def __init__(self, context: AppContext) -> None:
        self.context = context
        self.reports = ReportFiles()

    def queued(self, request: gr.Request, message, state):
        """Runs at once when a turn is sent, just before it joins Gradio's queue: starts the page's watch of
        where it waits (`where`). While this chat's previous turn still waits or runs, the page does not send the
        new one (an event runs once at a time): the notice line says so and the question stays in the box.
        Outputs: the watch timer, the notice line."""
        if not (message or {}).get("text", "").strip():
            return gr.skip(), gr.skip()
        queue = self.context.queue
        if queue.ahead_of_mine(request, "turn") is not None:
            return gr.skip(), SEND_REFUSED
        queue.sent(request, "turn")
        return gr.Timer(active=True), gr.skip()

    def where(self, request: gr.Request):
        """A tick of the page's watch: where the sent turn waits now in Gradio's queue (`ComputeQueue.watch`);
        nothing once it runs (it shows its own progress), or when it was refused or withdrawn."""
        line, again = self.context.queue.watch(request, "turn")
        return (gr.skip() if line is None else progress_html(0, 1, line)), gr.Timer(active=again)

    def chat(
        self,
        request: gr.Request,
        message,
        state,
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
        """Generator: one turn, streamed (outputs: see the module's docstring)."""
        queue = self.context.queue
        if not queue.comes_up(request, "turn"):
            skip = gr.skip()
            yield (skip, skip, skip, skip, progress_html(0, 1, WITHDRAWN_TURN), skip, skip, skip, skip)
            return
        form = FormValues(
            method, budget, keep, block_size, max_new, temperature, followup, prefill, vision_ahead, fps, max_frames,
            method_values,
        )  # fmt: skip
        t0 = time.monotonic()
        try:
            yield from self._turn(message, state, form)
        finally:
            queue.turn_took(time.monotonic() - t0)

    def _turn(self, message, state, form: FormValues):
        st = self.context.user_state(state)
        skip = gr.skip()
        message = message or {}
        prompt = (message.get("text") or "").strip()
        files = message.get("files") or []

        def fail(msg: str, refused_file: bool = False):
            # a refused file leaves the input (the question stays): what is attached is what the next send sends
            box = {"text": prompt, "files": []} if refused_file else skip
            return (skip, box, st, error_line(msg, files), "", skip, skip, skip, skip)

        if not prompt:
            yield fail("The question is empty: type a question about the image or video, then send.")
            return
        try:
            turn = self._open(st, prompt, files, form)
        except FileRefused as exc:
            yield fail(str(exc), refused_file=True)
            return
        except VisualKVError as exc:
            yield fail(str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - shown, never a traceback on the page
            yield fail(failure_message(exc))
            return
        chat_cfg = turn.session.config
        followup_md = text.chat_followup_note(chat_cfg.method, chat_cfg.followup, form.method, form.followup)
        user_content: list[Any] = ([{"path": files[0]}] if files else []) + [prompt]
        st.history = [*turn.before, {"role": "user", "content": user_content}, {"role": "assistant", "content": ""}]
        st.stop = threading.Event()
        st.live_blocks = []
        active = self.context.queue.active
        active[id(st)] = "turn"
        try:
            reading = progress_html(0, 1, READING_LABEL)
            yield (st.history, {"text": "", "files": []}, st, "", reading, skip, skip, skip, followup_md)
            yield from self._stream(turn)
        finally:
            active.pop(id(st), None)

    def _open(self, st: UserState, prompt: str, files: list[str], form: FormValues) -> Turn:
        """The turn about to run, every input checked first (raises with one line)."""
        cfg = form.session_config(self.context.method_keys, self.context.bounds)
        sampling = form.sampling(self.context.bounds)  # checked with the rest of the form, a video given or not
        self._check_length(st, prompt)
        media = None
        if files:  # validate the file first, so its own problem is what the user reads
            try:
                media = load_media(files[0], limits=self.context.media_limits(cfg.method), sampling=sampling)
            except VisualKVError as exc:
                raise FileRefused(str(exc)) from exc
        session = st.session
        new_session = session is None
        if files and not new_session:
            raise ConfigError("this chat has already started; click New chat to ask about another file")
        if new_session:
            session = ChatSession(self.context.cache.get(st.model_name), cfg)
        notes = []
        if not new_session and st.settings_used and st.settings_used != cfg.__dict__:
            notes.append("This chat keeps the settings it started with; click New chat to apply new ones.")
        return Turn(st, session, prompt, media, files, list(st.history), new_session, cfg, notes)

    def _check_length(self, st: UserState, prompt: str) -> None:
        """The chat's turns and the question's tokens within this instance's bounds (one line), before any compute."""
        bounds = self.context.bounds
        if sum(message.get("role") == "user" for message in st.history) >= bounds.turns:
            raise ConfigError(
                f"this chat has reached {bounds.turns:,} turns, the most per chat{bounds.where}: "
                "click New chat to start over"
            )
        tokenizer = (st.session.adapter if st.session is not None else self.context.cache.get(st.model_name)).tokenizer
        question_tokens(tokenizer, prompt, bounds.question_tokens, bounds.where)

    def _stream(self, turn: Turn):
        """The events of one running turn, as outputs."""
        st, session, skip = turn.st, turn.session, gr.skip()
        answer = ""
        epoch = st.epoch
        t_prefill = time.monotonic()
        last_update = float("-inf")
        limit = self.context.turn_time_limit
        video = turn.media if turn.media is not None else session.media  # a follow-up re-reads the chat's media
        duration = video.duration if video is not None and video.kind == "video" else None
        for kind, payload in stream_turn(session, turn.prompt, turn.media, st.stop, time_limit=limit):
            if st.epoch != epoch:  # New chat or another model was chosen meanwhile: drop this turn, no line left
                yield (skip, skip, skip, skip, "", skip, skip, skip, skip)
                return
            if kind == "block":
                st.live_blocks.append(payload)
                done, total = payload.index + 1, payload.n_blocks
                now = time.monotonic()
                if now - last_update < LIVE_UPDATE_SECONDS and done < total and not st.stop.is_set():
                    continue  # drawn with the next update (the first and the last block are always drawn)
                yield self._block_output(turn, payload, now - t_prefill, duration)
                # the interval counts from when this update was drawn and handed on: on a loaded machine drawing
                # can itself take longer than the interval, and the page must not get every block then either
                last_update = time.monotonic()
            elif kind == "text":
                answer += payload
                st.history[-1] = {"role": "assistant", "content": answer}
                yield (st.history, skip, st, "", skip, skip, skip, skip, skip)
            elif kind in ("error", "stopped"):
                yield self._ended_output(turn, kind, payload)
                return
            else:  # done
                yield self._done_output(turn, payload)

    def _block_output(self, turn: Turn, block, seconds_so_far: float, duration: float | None):
        """A prefill block's update: the progress line and the live memory chart (`duration`: a video's)."""
        st, session, skip = turn.st, turn.session, gr.skip()
        done, total = block.index + 1, block.n_blocks
        if st.stop.is_set():
            label = f"stopping… (after block {done}/{total}; nothing of this turn is kept)"
        else:
            # the remaining blocks at the mean pace of the blocks done so far
            left = seconds_so_far / done * (total - done)
            eta = f" · about {left:.0f} s left" if total > done else ""
            read = viz.video_read(block.media_seconds, duration)
            label = (
                f"{PREFILL_LABEL} {done}/{total} ({block_kind(block.kind)}, +{block.tokens_in} tokens)"
                f"{' · video ' + read if read else ''} · KV {block.kv_bytes / viz.MIB:.2f} MiB{eta}"
            )
        fig = viz.block_memory_figure(live_report(session, st.live_blocks), n_blocks=total, media_duration=duration)
        return (skip, skip, st, "", progress_html(done, total, label), fig, skip, skip, skip)

    def _ended_output(self, turn: Turn, kind: str, payload):
        """A turn failed or stopped: it leaves no trace, and its question goes back into the input box."""
        st, skip = turn.st, gr.skip()
        st.history = turn.before  # the session is unchanged
        when = "while it read the media" if turn.new_session else "before its answer began"  # a follow-up: its question
        if kind == "error":
            line = error_line(payload, turn.files)
        elif payload == TIME_LIMIT_STOPPED:
            line = (
                f"Time limit: this instance's turn time limit ({self.context.turn_time_limit:g} s) stopped the turn "
                f"{when}: nothing of it was kept, the chat is as it was. A block-wise method, a "
                "smaller budget or fewer frames reads faster."
            )
        else:
            line = f"Stopped {when}: nothing of this turn was kept, the chat is as it was. Send again to retry."
        return (st.history, {"text": turn.prompt, "files": turn.files}, st, line, "", skip, skip, skip, skip)

    def _done_output(self, turn: Turn, record):
        """The answered turn: the chat keeps it, its report is written, the summary tells its numbers."""
        st, session, skip = turn.st, turn.session, gr.skip()
        if turn.new_session:
            st.session, st.media_path, st.first_prompt = session, turn.files[0] if turn.files else None, turn.prompt
            st.settings_used = dict(turn.cfg.__dict__)
        st.history[-1] = {"role": "assistant", "content": self._answer_text(record)}
        st.report = report = turn_report(session)
        st.report_path = self.reports.write(report, st.report_path)
        fig = viz.block_memory_figure(report) if report.get("blocks") else skip
        stopped = record.stopped in ("stopped", TIME_LIMIT_STOP)
        label = done_label(record.to_dict(), stopped, turn.notes)
        summary = viz.summary_line(report)
        if session.media is None:
            summary = (
                "⚠️ No image or video in this chat: the model answered from the text alone. "
                "Attach a file (New chat) to ask about one. · " + summary
            )
        n = max(len(report.get("blocks") or []), 1)
        download = gr.update(value=st.report_path, interactive=True)
        return (st.history, skip, st, "", progress_html(n, n, label), fig, download, summary, skip)

    def _answer_text(self, record) -> str:
        """The answer as the chat shows it, saying who stopped it and when."""
        if record.stopped == "stopped":
            return f"{record.answer} … (stopped by you after {len(record.token_ids)} token(s))"
        if record.stopped == TIME_LIMIT_STOP:
            return (
                f"{record.answer} … (stopped by this instance's turn time limit of "
                f"{self.context.turn_time_limit:g} s after {len(record.token_ids)} token(s))"
            )
        return record.answer or "(empty answer)"

    def stop(self, request: gr.Request, state):
        """The chat's Stop: what this session runs (a turn, an evidence pass or a comparison) ends within a layer
        (a prefill) or a token; a waiting turn will not run."""
        queue = self.context.queue
        if state is not None and queue.active.get(id(state)) in ("turn", "evidence", "compare"):
            state.stop.set()
            # nothing written: the browser already shows "stopping…" (`stop_ack_js`); this answer can arrive
            # after the turn's own final line and would leave a stale "stopping…" under it
            return gr.skip()
        if queue.withdraw(request, "turn"):
            return progress_html(0, 1, WITHDRAWN_TURN)
        return gr.skip()  # nothing of this session's is running or waiting: nothing to stop

    def new_chat(self, state, method, followup):
        """A fresh chat: its waiting turns are cancelled (Gradio's `cancels`), a running comparison stopped,
        every output emptied (Compare's results too: they were about the old chat)."""
        st = self.context.user_state(state)
        st.new_chat()
        return (
            st,
            [],
            {"text": "", "files": []},
            "",
            "",
            None,
            gr.update(value=None, interactive=False),
            "",
            "",  # the follow-up note: shown once a chat exists
            *empty_views(),
            *empty_compare(),
        )
