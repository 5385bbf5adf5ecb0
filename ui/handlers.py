"""Callbacks of the page. Each reads the per-session UserState, calls the library, and formats.

Nothing here computes: turns run through `visualkv.runtime.streaming`, figures and overlays come
from `visualkv.report.viz`, numbers from the session report. Every failure a user can cause
(bad file, empty question, unknown model, bad setting) is shown in the error line and
leaves the chat, its cache and the loaded model as they were.
"""

from __future__ import annotations

import dataclasses
import html
import re
import shutil
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import gradio as gr

from visualkv.errors import ConfigError, VisualKVError
from visualkv.media import FrameSampling, MediaLimits, load_media
from visualkv.methods import is_bounded, media_limits
from visualkv.report import viz
from visualkv.report.telemetry import TIME_LIMIT_STOP, write_json
from visualkv.runtime.session import ChatSession, SessionConfig
from visualkv.runtime.streaming import (
    TIME_LIMIT_STOPPED,
    failure_message,
    live_report,
    method_options,
    stream_compare,
    stream_turn,
    turn_report,
)

from . import text
from .state import ModelCache, UserState, is_offline_model

try:  # Hugging Face ZeroGPU: borrow a GPU for each model computation
    import spaces

    gpu = spaces.GPU(duration=120)
except Exception:  # noqa: BLE001 - not on a Space (ImportError) or spaces unusable here

    def gpu(fn):
        return fn


MAX_FILE_BYTES = 200 * 1024**2  # default upload limit (a Space); `python app.py --max-upload 4GB` raises it
# the "blocks per vision-tower call" field's bound: more is one call for most inputs anyway, and the memory
# guard refuses a call that would not fit
MAX_VISION_AHEAD = 64
MAX_SAMPLED_FRAMES = 10_800  # the "frames sampled at most" field's bound: 3 h at 1 fps (MediaLimits caps further)
NOT_AVAILABLE = "_Not available for this method._"


def _error(message: str, paths: list[str] | None = None) -> str:
    """The error line: Markdown-escaped, with server-side upload paths shortened to file names and
    hints meant for library users (e.g. "(or raise MediaLimits.max_image_pixels)") left out."""
    for path in paths or []:
        message = message.replace(str(path), Path(path).name)
    message = re.sub(r"\s*\(or raise MediaLimits\.\w+\)", "", message)
    return "⚠️ " + text.md_escape(message)


def _whole(value, name: str, low: int, high: int | None = None, hint: str = "") -> int:
    """A number field's value as an int in [low, high], or a one-line ConfigError naming the field."""
    if value is None or value == "":
        raise ConfigError(f"{name} is empty: type a whole number ≥ {low}{hint}")
    number = float(value)
    if number != int(number) or number < low or (high is not None and number > high):
        limit = f"between {low} and {high}" if high is not None else f"≥ {low}"
        raise ConfigError(f"{name} must be a whole number {limit}{hint}, got {value:g}")
    return int(number)


def _real(value, name: str, low: float, high: float, low_open: bool = False) -> float:
    if value is None or value == "":
        raise ConfigError(f"{name} is empty: type a number")
    number = float(value)
    if number < low or number > high or (low_open and number == low):
        raise ConfigError(
            f"{name} must be {'above' if low_open else 'at least'} {low:g} and at most {high:g}, got {number:g}"
        )
    return number


def _progress(done: int, total: int, label: str) -> str:
    total = max(total, 1)
    return (
        f'<div class="vkv-progress-text">{html.escape(label)}</div>'
        f'<progress class="vkv-bar" value="{done}" max="{total}"></progress>'
    )


# Fewest seconds between two live block updates sent to the browser. A small model finishes a block in
# ~30 ms; drawing every one made the page fall seconds behind the engine (a Stop clicked at "block 2" then
# reached a prefill that had already ended). Skipped blocks still count: the next update draws them all.
LIVE_UPDATE_SECONDS = 0.25

READING_LABEL = "reading the input…"
PREFILL_LABEL = "prefill block"  # + " k/N (…)"; the line stays on the last block while the answer streams
STOPPING_LABEL = "stopping… (a prefill ends at its next block boundary; an answer at its next token)"
COMPARE_STOPPING = "stopping… (the running method ends at its next block boundary or token)"
WAITING_LABEL = "waiting: position"  # + " k in the queue (…)"
STARTING_LABEL = "starting…"
WITHDRAWN_TURN = "⏹ Stopped while it waited in the queue: nothing ran, and the question is still in the box."
WITHDRAWN_COMPARE = "⏹ Stopped while it waited in the queue: no method ran."


def stopping_html() -> str:
    """The progress line Stop shows: at once in the browser (ui/app.py), then again from the server."""
    return _progress(0, 1, STOPPING_LABEL)


def _session_key(request) -> str | None:
    """The browser session a queue entry belongs to (None in calls without a request, e.g. some tests)."""
    return getattr(request, "session_hash", None)


class Handlers:
    """Callbacks bound to the shared model cache; per-user data arrives as the `state` argument."""

    compare_headers = viz.COMPARE_HEADERS
    turn_time_limit: float | None = None  # seconds; a longer turn is stopped like Stop (set by build_app)
    max_file_bytes: int = MAX_FILE_BYTES  # largest upload accepted (set by build_app from --max-upload)

    def __init__(self, cache: ModelCache, default_model: str) -> None:
        self.cache = cache
        self.default_model = default_model
        self.method_keys: list[tuple[str, str]] = []  # (method, setting key) of each method-settings input
        self.group_names: list[str] = []  # methods with a settings group, in output order
        self._tmp = Path(tempfile.mkdtemp(prefix="visualkv-reports-"))
        self._queue_lock = threading.Lock()
        # (session, kind) -> when each of its waiting computations was sent, oldest first (Gradio's queue is
        # first in, first out, so the oldest is the next to come up; a session can have two of a kind waiting,
        # e.g. a turn sent with Enter and another with Send, or a second send after a Stop)
        self._waiting: dict[tuple, list[float]] = {}
        # (session, kind) -> how many of its computations Stop withdrew while they waited: that many of the next
        # to come up are skipped (they are the oldest: all that waited when Stop was pressed)
        self._withdrawn: Counter[tuple] = Counter()
        self._running_since: dict[tuple, float] = {}  # (session, kind) computing now -> when it started
        self._turn_seconds = 0.0  # moving average of recent turn times
        # id() of the UserStates with a computation running -> "turn" or "compare" (what each Stop button stops)
        self._active: dict[int, str] = {}

    # -- helpers --------------------------------------------------------------------------------
    def _state(self, state: UserState | None) -> UserState:
        return state if state is not None else UserState(model_name=self.default_model)

    def _config(
        self, method, budget, block_size, max_new, temperature, followup, prefill, vision_ahead, method_values
    ) -> SessionConfig:
        """The session config from the form, checking every field first (one line naming the field)."""
        if method not in text.method_choices():
            raise ConfigError(f"unknown method {method!r}; choose one of: {', '.join(text.method_choices())}")
        needs_budget = text.traits(method).needs_budget
        values = {key: v for (name, key), v in zip(self.method_keys, method_values) if name == method}
        cfg = SessionConfig(
            method=method,
            budget=_whole(budget, "budget M", 1, hint=" (visual entries kept per layer and KV head)")
            if needs_budget
            else None,
            block_size=_whole(block_size, "block size", 0, hint=" (0 = auto)") or None,
            prefill=None if prefill in (None, "auto") else prefill,
            max_new_tokens=_whole(max_new, "max new tokens", 1, 4096),
            temperature=_real(temperature, "temperature", 0.0, 5.0),
            followup=followup or "reuse",
            vision_ahead=_whole(
                vision_ahead, "blocks per vision-tower call", 1, MAX_VISION_AHEAD, hint=" (1 = a call per block)"
            ),
            method_options=method_options(method, values),
        )
        cfg.validate()
        return cfg

    @staticmethod
    def _sampling(fps, max_frames) -> FrameSampling:
        rate = _real(fps, "frames per second sampled", 0.0, 60.0, low_open=True)
        count = _whole(max_frames, "frames sampled at most", 1, MAX_SAMPLED_FRAMES)
        try:
            return FrameSampling(fps=rate, max_frames=count)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"video sampling: {exc}") from None

    def _write_report(self, report: dict[str, Any], previous: str | None) -> str:
        """The report as a JSON file of its own (the session's previous one is deleted). The media's
        path is reduced to its file name: the server's upload folder is nobody's business."""
        if previous and Path(previous).parent.parent == self._tmp:
            shutil.rmtree(Path(previous).parent, ignore_errors=True)
        folder = Path(tempfile.mkdtemp(dir=self._tmp))
        path = folder / "visualkv_report.json"
        media = report.get("media")
        if media and media.get("path"):
            report = {**report, "media": {**media, "path": Path(media["path"]).name}}
        write_json(report, str(path))
        return str(path)

    # -- queue ----------------------------------------------------------------------------------
    # Chat turns, comparisons and model loads share one compute queue (ui/app.py): each counts in the others'
    # positions. A session may have one of each waiting: entries are keyed by (session, kind), kind "turn",
    # "compare" or "load" (a load only runs here: its own wait is Gradio's progress on the model note).
    def _enqueue(self, request, kind: str) -> int | None:
        """Registers a computation sent now: how many run or wait ahead of it. None when it is already running
        (this at-once event arrived after the queued one had started: an entry then would never be removed)."""
        now = time.monotonic()
        key = (_session_key(request), kind)
        with self._queue_lock:
            if now - self._running_since.get(key, float("-inf")) < 2.0:
                return None
            self._forget_lost(now)
            self._waiting.setdefault(key, []).append(now)
            ahead = sum(t < now for sent in self._waiting.values() for t in sent)
            return ahead + (1 if self._running_since else 0)

    def _forget_lost(self, now: float) -> None:
        """Drops entries older than half an hour: an event whose handler never ran (a closed tab, a Gradio
        cancel) would otherwise count in every later position."""
        fresh = {key: [t for t in sent if now - t < 1800] for key, sent in self._waiting.items()}
        self._waiting = {key: sent for key, sent in fresh.items() if sent}

    def _waiting_line(self, ahead: int) -> str:
        if not ahead:
            return STARTING_LABEL
        per_turn = f" Recent chat turns took about {self._turn_seconds:.0f} s each." if self._turn_seconds else ""
        return (
            f"{WAITING_LABEL} {ahead + 1} in the queue ({ahead} computation(s) ahead of yours: chat turns, "
            f"comparisons or model loads; one runs at a time).{per_turn}"
        )

    def queued(self, request: gr.Request, message, state):
        """Runs at once when a turn is sent: where it waits while other computations run."""
        if not (message or {}).get("text", "").strip():
            return gr.skip()
        ahead = self._enqueue(request, "turn")
        return gr.skip() if ahead is None else _progress(0, 1, self._waiting_line(ahead))

    def compare_queued(self, request: gr.Request, state):
        """Runs at once when Compare is clicked: where the comparison waits, in Compare's status line."""
        ahead = self._enqueue(request, "compare")
        return gr.skip() if ahead is None else self._waiting_line(ahead)

    def _leave_queue(self, request, kind: str) -> bool:
        """A queued computation reached the front (or was refused): it no longer counts in others' positions.
        False if Stop withdrew it while it waited: it must not run (its entry went with the Stop, so an entry
        still there belongs to a later send, which keeps its place)."""
        key = (_session_key(request), kind)
        with self._queue_lock:
            if self._withdrawn[key]:
                self._withdrawn[key] -= 1
                if not self._withdrawn[key]:
                    del self._withdrawn[key]
                return False
            sent = self._waiting.get(key)
            if sent:
                sent.pop(0)
                if not sent:
                    del self._waiting[key]
            return True

    def _withdraw(self, request, kind: str) -> bool:
        """Stop while waiting: True if this session had computations of `kind` waiting (none of them will run)."""
        key = (_session_key(request), kind)
        with self._queue_lock:
            sent = self._waiting.pop(key, None)
            if not sent:
                return False
            self._withdrawn[key] += len(sent)
            return True

    def _cancel_waiting(self, request, kind: str) -> None:
        """New chat cancels this session's waiting events of `kind` in Gradio's queue (ui/app.py): none of them
        comes up, so neither their entries nor a withdrawal of them may outlive it."""
        key = (_session_key(request), kind)
        with self._queue_lock:
            self._waiting.pop(key, None)
            self._withdrawn.pop(key, None)

    def _started(self, request, kind: str) -> None:
        with self._queue_lock:
            self._running_since[(_session_key(request), kind)] = time.monotonic()

    def _finished(self, request, kind: str, seconds: float | None) -> None:
        """A computation ended; `seconds`: a chat turn's time (None for a comparison or a load, not a turn)."""
        with self._queue_lock:
            self._running_since.pop((_session_key(request), kind), None)
            if seconds is not None:  # a moving average of turn times, for the waiting message
                self._turn_seconds = seconds if not self._turn_seconds else 0.7 * self._turn_seconds + 0.3 * seconds

    # -- chat -----------------------------------------------------------------------------------
    @gpu
    def chat(
        self,
        request: gr.Request,
        message,
        state,
        method,
        budget,
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
        """Generator: one turn, streamed. Outputs: chatbot, input, state, error, progress, plot, download,
        summary, follow-up note."""
        if not self._leave_queue(request, "turn"):
            skip = gr.skip()
            yield (skip, skip, skip, skip, _progress(0, 1, WITHDRAWN_TURN), skip, skip, skip, skip)
            return
        self._started(request, "turn")
        t0 = time.monotonic()
        try:
            yield from self._turn(
                message,
                state,
                method,
                budget,
                block_size,
                max_new,
                temperature,
                followup,
                prefill,
                vision_ahead,
                fps,
                max_frames,
                method_values,
            )
        finally:
            self._finished(request, "turn", time.monotonic() - t0)

    def _turn(
        self,
        message,
        state,
        method,
        budget,
        block_size,
        max_new,
        temperature,
        followup,
        prefill,
        vision_ahead,
        fps,
        max_frames,
        method_values,
    ):
        st = self._state(state)
        skip = gr.skip()
        message = message or {}
        prompt = (message.get("text") or "").strip()
        files = message.get("files") or []

        def fail(msg: str):
            return (skip, skip, st, _error(msg, files), "", skip, skip, skip, skip)

        if not prompt:
            yield fail("The question is empty: type a question about the image or video, then send.")
            return
        try:
            cfg = self._config(
                method, budget, block_size, max_new, temperature, followup, prefill, vision_ahead, method_values
            )
            media = None
            if files:  # validate the file first, so its own problem is what the user reads
                media = load_media(
                    files[0],
                    limits=media_limits(cfg.method, MediaLimits(max_file_bytes=self.max_file_bytes)),
                    sampling=self._sampling(fps, max_frames),
                )
            session = st.session
            new_session = session is None
            if files and not new_session:
                raise ConfigError("this chat has already started; click New chat to ask about another file")
            if new_session:
                session = ChatSession(self.cache.get(st.model_name), cfg)
        except VisualKVError as exc:
            yield fail(str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - shown, never a traceback on the page
            yield fail(failure_message(exc))
            return

        notes = []
        if not new_session and st.settings_used and st.settings_used != cfg.__dict__:
            notes.append("This chat keeps the settings it started with; click New chat to apply new ones.")
        chat_cfg = session.config
        followup_md = text.chat_followup_note(chat_cfg.method, chat_cfg.followup, method, followup)
        before = list(st.history)
        user_content: list[Any] = ([{"path": files[0]}] if files else []) + [prompt]
        st.history = [*before, {"role": "user", "content": user_content}, {"role": "assistant", "content": ""}]
        st.stop = threading.Event()
        st.live_blocks = []
        self._active[id(st)] = "turn"
        try:
            yield (
                st.history,
                {"text": "", "files": []},
                st,
                "",
                _progress(0, 1, READING_LABEL),
                skip,
                skip,
                skip,
                followup_md,
            )
            yield from self._stream(st, session, prompt, media, files, before, new_session, cfg, notes)
        finally:
            self._active.pop(id(st), None)

    def _stream(self, st: UserState, session, prompt, media, files, before, new_session, cfg, notes):
        """The events of one running turn, as outputs (see `chat`)."""
        skip = gr.skip()

        answer = ""
        epoch = st.epoch
        t_prefill = time.monotonic()
        video = media if media is not None else session.media  # a follow-up re-reads the chat's media
        duration = video.duration if video is not None and video.kind == "video" else None
        last_update = float("-inf")
        for kind, payload in stream_turn(session, prompt, media, st.stop, time_limit=self.turn_time_limit):
            if st.epoch != epoch:  # New chat or another model was chosen meanwhile: drop this turn quietly
                return
            if kind == "block":
                st.live_blocks.append(payload)
                done, total = payload.index + 1, payload.n_blocks
                now = time.monotonic()
                if now - last_update < LIVE_UPDATE_SECONDS and done < total and not st.stop.is_set():
                    continue  # drawn with the next update (the first and the last block are always drawn)
                if st.stop.is_set():
                    label = f"stopping… (after block {done}/{total}; nothing of this turn is kept)"
                else:
                    # the remaining blocks at the mean pace of the blocks done so far
                    left = (now - t_prefill) / done * (total - done)
                    eta = f" · about {left:.0f} s left" if total > done else ""
                    read = viz.video_read(payload.media_seconds, duration)
                    label = (
                        f"{PREFILL_LABEL} {done}/{total} ({payload.kind}, +{payload.tokens_in} tokens)"
                        f"{' · video ' + read if read else ''} · KV {payload.kv_bytes / viz.MIB:.2f} MiB{eta}"
                    )
                fig = viz.block_memory_figure(
                    live_report(session, st.live_blocks), n_blocks=total, media_duration=duration
                )
                yield (skip, skip, st, "", _progress(done, total, label), fig, skip, skip, skip)
                # the interval counts from when this update was drawn and handed on: on a loaded machine drawing
                # can itself take longer than the interval, and the page must not get every block then either
                last_update = time.monotonic()
            elif kind == "text":
                answer += payload
                st.history[-1] = {"role": "assistant", "content": answer}
                yield (st.history, skip, st, "", skip, skip, skip, skip, skip)
            elif kind in ("error", "stopped"):
                st.history = before  # the failed or stopped turn leaves no trace; the session is unchanged
                if kind == "error":
                    line = _error(payload, files)
                elif payload == TIME_LIMIT_STOPPED:
                    line = (
                        f"⏱ This instance's turn time limit ({self.turn_time_limit:g} s) stopped the turn while it "
                        "read the media: nothing of it was kept, the chat is as it was. A block-wise method, a "
                        "smaller budget or fewer frames reads faster."
                    )
                else:
                    line = (
                        "⏹ Stopped while reading the media: nothing of this turn was kept, the chat is as it was. "
                        "Send again to retry."
                    )
                # the question (and its file) go back into the input box, so nothing typed is lost
                yield (st.history, {"text": prompt, "files": files}, st, line, "", skip, skip, skip, skip)
                return
            else:  # done
                record = payload
                if new_session:
                    st.session, st.media_path, st.first_prompt = session, files[0] if files else None, prompt
                    st.settings_used = dict(cfg.__dict__)
                stopped = record.stopped in ("stopped", TIME_LIMIT_STOP)
                content = record.answer or "(empty answer)"
                if record.stopped == "stopped":
                    content = f"{record.answer} … (stopped by you after {len(record.token_ids)} token(s))"
                elif record.stopped == TIME_LIMIT_STOP:
                    content = (
                        f"{record.answer} … (stopped by this instance's turn time limit of "
                        f"{self.turn_time_limit:g} s after {len(record.token_ids)} token(s))"
                    )
                st.history[-1] = {"role": "assistant", "content": content}
                st.report = viz_report = turn_report(session)
                st.report_path = self._write_report(viz_report, st.report_path)
                fig = viz.block_memory_figure(viz_report) if viz_report.get("blocks") else skip
                label = (
                    f"done · TTFT {record.ttft_seconds:.2f} s · {viz.decode_speed(record.to_dict())}"
                    f" · KV {record.kv_bytes_after / viz.MIB:.2f} MiB{' · stopped' if stopped else ''}"
                )
                if notes:
                    label += " · " + " ".join(notes)
                summary = viz.summary_line(viz_report)
                if session.media is None:
                    summary = (
                        "⚠️ No image or video in this chat: the model answered from the text alone. "
                        "Attach a file (New chat) to ask about one. · " + summary
                    )
                n = max(len(viz_report.get("blocks") or []), 1)
                yield (
                    st.history,
                    skip,
                    st,
                    "",
                    _progress(n, n, label),
                    fig,
                    gr.update(value=st.report_path, interactive=True),
                    summary,
                    skip,
                )

    def stop(self, request: gr.Request, state):
        """The chat's Stop: a running turn ends at its next block boundary or token; a waiting one will not run."""
        if state is not None and self._active.get(id(state)) == "turn":
            state.stop.set()
            return stopping_html()
        if self._withdraw(request, "turn"):
            return _progress(0, 1, WITHDRAWN_TURN)
        return gr.skip()  # nothing of this session's is running or waiting: nothing to stop

    def stop_compare(self, request: gr.Request, state):
        """Compare's own Stop: the running method ends at its next block boundary or token, and a waiting
        comparison will not run. For a running one it writes nothing: the browser shows "stopping…" itself
        (ui/app.py), and the comparison's own last status line, which may come first, must not be overwritten."""
        if state is not None and self._active.get(id(state)) == "compare":
            state.stop.set()
        elif self._withdraw(request, "compare"):
            return WITHDRAWN_COMPARE
        return gr.skip()

    def new_chat(self, request: gr.Request, state, method, followup):
        self._cancel_waiting(request, "turn")
        st = self._state(state)
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
            text.followup_note(method, followup),
            *self._empty_views(),
        )

    # -- views after prefill ----------------------------------------------------------------------
    def _empty_views(self):
        return (
            gr.update(choices=["average"], value="average"),
            text.EMPTY_HEAT_NOTE,
            None,
            "Sali-Cache only.",
            None,
            None,
            "Video only.",
            None,
            None,
            "LightKV only.",
            None,
            None,
            "No turn yet.",
        )

    def _before_after(self, st: UserState, layer_choice, opacity):
        """(media alone, keep map over it): the two sides of the before/after slider."""
        media = st.session.media
        layer = _layer_index(layer_choice)
        alpha = min(max(float(opacity if opacity is not None else 0.6), 0.0), 1.0)
        return (
            viz.retained_view(media.frames, media.times, st.report, layer=layer, opacity=0.0),
            viz.retained_view(media.frames, media.times, st.report, layer=layer, opacity=alpha),
        )

    def views(self, state, layer_choice, opacity=0.6):
        st = self._state(state)
        rep = st.report
        if rep is None or st.session is None:
            return self._empty_views()
        media = st.session.media
        # only len() and frames[i] are used (the views draw a few evenly spaced frames): a lazily decoded
        # hour of video is never materialised here
        frames = media.frames if media is not None else []
        times = media.times if media is not None else None
        has_frames = len(frames) > 0
        n_layers = len(rep.get("retained_per_layer") or [])
        layers = ["average", *(f"layer {i}" for i in range(n_layers))]
        layer_value = layer_choice if layer_choice in layers else "average"
        layer_dd = gr.update(choices=layers, value=layer_value)
        n_layout = len((rep.get("layout") or {}).get("frames") or [])
        sampled = (
            f" A long video: {viz.MAX_FRAMES_SHOWN} of its {n_layout} frames are drawn, evenly spaced."
            if viz.is_video(rep) and n_layout > viz.MAX_FRAMES_SHOWN
            else ""
        )

        if has_frames and rep.get("visual_tokens"):
            heat = self._before_after(st, layer_value, opacity)
            kept = sum(rep.get("retained") or []) / max(rep["visual_tokens"], 1)
            heat_note = (
                f"{rep['visual_tokens']} visual tokens, {kept:.1%} of their entries kept on average. "
                "Left of the slider the media, right the keep map (yellow kept, dark purple evicted"
                + ("; one tile per frame)." if viz.is_video(rep) else ").")
                + sampled
            )
        else:
            heat, heat_note = None, "No image or video in this chat."

        if has_frames and viz.has_saliency(rep):
            sal, tiers = viz.saliency_gallery(frames, times, rep), viz.tier_gallery(frames, times, rep)
            sali_note = (
                "Saliency (bright = salient) and the precision tier of each visual token, one image per "
                "frame: click one to zoom." + sampled
            )
        else:
            sal, tiers, sali_note = None, None, NOT_AVAILABLE + " Saliency and tiers come from Sali-Cache."

        if rep.get("frames"):
            timeline, thumbs = viz.frame_timeline_figure(rep), viz.frame_gallery(frames, rep)
            timeline_note = (
                "Motion per sampled frame, the skip threshold, and skipped frames (shaded)."
                if viz.has_motion(rep)
                else "Sampled frames (skipped spans shaded; without motion scores for this method)."
            )
            if len(rep["frames"]) > viz.TIMELINE_MAX_FRAMES:
                timeline_note += (
                    f" {len(rep['frames'])} frames, grouped in bins: drag on the chart or use the range slider "
                    "under it to zoom into a stretch of the video (double-click to zoom out)."
                )
        else:
            timeline, thumbs, timeline_note = None, None, NOT_AVAILABLE + " The timeline is for videos."

        if viz.has_merge_map(rep):
            merge = viz.merge_view(frames, times, rep) if has_frames else None
            layer_fig, merge_note = (
                viz.layer_tokens_figure(rep),
                (
                    "Dark: merged into a neighbour. Yellow to red: a kept token that now stands for 2 up to the most "
                    "tokens (see the legend). Untouched tokens are shown as they are."
                ),
            )
        else:
            merge, layer_fig, merge_note = None, None, NOT_AVAILABLE + " Merge maps come from LightKV."

        numbers = "| quantity | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in viz.summary_rows(rep))
        return (
            layer_dd,
            heat_note,
            heat,
            sali_note,
            sal,
            tiers,
            timeline_note,
            timeline,
            thumbs,
            merge_note,
            merge,
            layer_fig,
            numbers,
        )

    def layer_changed(self, state, layer_choice, opacity=0.6):
        st = self._state(state)
        if st.report is None or st.session is None or st.session.media is None or not st.report.get("visual_tokens"):
            return gr.skip()
        return self._before_after(st, layer_choice, opacity)

    # -- model ------------------------------------------------------------------------------------
    def load_model(self, request: gr.Request, choice, typed, state, progress=gr.Progress()):  # noqa: B008 - Gradio injects progress
        """Loads (or builds) a model into the shared cache: it holds the compute queue like a turn, so it counts in
        the positions of the turns and comparisons waiting behind it."""
        st = self._state(state)
        skip = gr.skip()
        name = (typed or "").strip() or (choice or "").strip()
        keep = (skip,) * (5 + len(self._empty_views()))  # chat, progress, plot, download, summary, views
        if not name:
            return (st, skip, _error("Choose a model or type a Hub id / local folder."), *keep)
        progress(0.1, desc=f"loading {name}…")
        self._started(request, "load")
        try:
            self.cache.get(name)
        except Exception as exc:  # noqa: BLE001 - ModelLoadError or anything else: keep the current model
            return (st, skip, _error(f"{failure_message(exc)} — still using {st.model_name}."), *keep)
        finally:
            self._finished(request, "load", None)
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
            *self._empty_views(),
        )

    # -- settings ---------------------------------------------------------------------------------
    def method_changed(self, method, followup, state=None):
        """Method or follow-up choice changed: its help, the budget field, its settings group, and the
        follow-up note of the method the chat really runs (a started chat keeps its own)."""
        cls = text.traits(method)
        budget = gr.update(interactive=bool(cls and cls.needs_budget), info=text.budget_info(method))
        groups = [gr.update(visible=name == method) for name in self.group_names]
        chat = state.session.config if state is not None and state.session is not None else None
        note = text.chat_followup_note(chat.method if chat else None, chat.followup if chat else None, method, followup)
        return (text.method_line(method), budget, note, *groups)

    # -- compare ----------------------------------------------------------------------------------
    @gpu
    def compare(
        self,
        request: gr.Request,
        state,
        methods,
        question,
        file,
        method,
        budget,
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
        """Generator: the ticked methods one after another. Outputs: table, chart, status line, state (a
        session's first event may be a comparison: its Stop needs the state this run uses).

        Stoppable (`stop_compare`, New chat) and bounded by the turn time limit as a whole: on a shared
        instance one comparison holds the model no longer than one chat turn may."""
        skip = gr.skip()
        if not self._leave_queue(request, "compare"):
            yield skip, skip, WITHDRAWN_COMPARE, skip
            return
        st = self._state(state)
        question = (question or "").strip() or st.first_prompt
        path = file or st.media_path
        try:
            if not question:
                raise ConfigError("type a question (or chat first: the chat's first question is the default)")
            if not path:
                raise ConfigError("give a file here or start a chat with an image or video first")
            if not methods:
                raise ConfigError("tick at least one method to compare")
            base = self._config(
                method, budget, block_size, max_new, temperature, followup, prefill, vision_ahead, method_values
            )
            base = dataclasses.replace(base, budget=int(budget) if budget else None)  # for the methods that use one
            options = {}
            for name in methods:
                vals = {key: v for (m, key), v in zip(self.method_keys, method_values) if m == name}
                options[name] = method_options(name, vals)
            # one input for every ticked method: the frame cap of the first that holds every frame, if any
            capped = next((m for m in methods if not is_bounded(m)), methods[0])
            limits = media_limits(capped, MediaLimits(max_file_bytes=self.max_file_bytes))
            media = load_media(path, limits=limits, sampling=self._sampling(fps, max_frames))
            adapter = self.cache.get(st.model_name)
        except Exception as exc:  # noqa: BLE001 - shown in the status line
            yield skip, skip, _error(failure_message(exc), [path] if path else None), skip
            return
        st.stop = threading.Event()
        self._active[id(st)] = "compare"
        self._started(request, "compare")
        results: dict[str, Any] = {}
        try:
            yield skip, skip, f"running {len(methods)} methods…", st
            last_update = float("-inf")
            events = stream_compare(
                adapter, media, question, methods, base, options, st.stop, time_limit=self.turn_time_limit
            )
            for kind, payload in events:
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
                elif kind == "result":
                    name, report = payload
                    results[name] = report
                    status = f"{len(results)}/{len(methods)} done"
                    yield viz.compare_rows(results), viz.compare_memory_figure(results), status, skip
                elif kind == "stopped":
                    message, by_time_limit = payload
                    line = (
                        f"⏱ {message[0].upper()}{message[1:]} ({self.turn_time_limit:g} s on this instance; "
                        "fewer methods, a smaller budget or fewer frames fit in it)"
                        if by_time_limit
                        else f"⏹ {message[0].upper()}{message[1:]}; the table keeps the finished ones"
                    )
                    yield viz.compare_rows(results), viz.compare_memory_figure(results), line, skip
                else:  # done
                    line = f"done: {len(results)} methods on “{html.escape(question)}”"
                    yield viz.compare_rows(results), viz.compare_memory_figure(results), line, skip
        except Exception as exc:  # noqa: BLE001 - shown in the status line
            yield skip, skip, _error(failure_message(exc), [path]), skip
        finally:
            self._active.pop(id(st), None)
            self._finished(request, "compare", None)


def _layer_index(choice: str | None) -> int | None:
    if not choice or choice == "average":
        return None
    try:
        return int(choice.split()[-1])
    except ValueError:
        return None
