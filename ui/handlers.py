"""Callbacks of the page. Each reads the per-session UserState, calls the library, and formats.

Nothing here computes: turns run through `visualkv.streaming`, figures and overlays come
from `visualkv.viz`, numbers from the session report. Every failure a user can cause
(bad file, empty question, unknown model, bad setting) is shown in the error line and
leaves the chat, its cache and the loaded model as they were.
"""

from __future__ import annotations

import dataclasses
import html
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import gradio as gr

from visualkv import viz
from visualkv.errors import ConfigError, VisualKVError
from visualkv.media import FrameSampling, MediaLimits, load_media
from visualkv.methods import METHODS
from visualkv.session import ChatSession, SessionConfig
from visualkv.streaming import (
    compare_methods,
    failure_message,
    live_report,
    method_options,
    stream_turn,
    turn_report,
)
from visualkv.telemetry import write_json

from . import text
from .state import ModelCache, UserState, is_offline_model

try:  # Hugging Face ZeroGPU: borrow a GPU for each model computation
    import spaces

    gpu = spaces.GPU(duration=120)
except Exception:  # noqa: BLE001 - not on a Space (ImportError) or spaces unusable here
    def gpu(fn):
        return fn

MAX_FILE_BYTES = 200 * 1024**2
NOT_AVAILABLE = "_Not available for this method._"


def _error(message: str, paths: list[str] | None = None) -> str:
    """The error line: Markdown-escaped, with server-side upload paths shortened to file names."""
    for path in paths or []:
        message = message.replace(str(path), Path(path).name)
    return "⚠️ " + text.md_escape(message)


def _progress(done: int, total: int, label: str) -> str:
    total = max(total, 1)
    return (f'<div class="vkv-progress-text">{html.escape(label)}</div>'
            f'<progress class="vkv-bar" value="{done}" max="{total}"></progress>')


class Handlers:
    """Callbacks bound to the shared model cache; per-user data arrives as the `state` argument."""

    compare_headers = viz.COMPARE_HEADERS
    turn_time_limit: float | None = None  # seconds; a longer turn is stopped like Stop (set by build_app)

    def __init__(self, cache: ModelCache, default_model: str) -> None:
        self.cache = cache
        self.default_model = default_model
        self.method_keys: list[tuple[str, str]] = []  # (method, setting key) of each method-settings input
        self.group_names: list[str] = []  # methods with a settings group, in output order
        self._tmp = Path(tempfile.mkdtemp(prefix="visualkv-reports-"))

    # -- helpers --------------------------------------------------------------------------------
    def _state(self, state: UserState | None) -> UserState:
        return state if state is not None else UserState(model_name=self.default_model)

    def _config(self, method, budget, block_size, max_new, temperature, followup, prefill,
                method_values) -> SessionConfig:
        if method not in METHODS:
            raise ConfigError(f"unknown method {method!r}")
        values = {key: v for (name, key), v in zip(self.method_keys, method_values) if name == method}
        cfg = SessionConfig(
            method=method,
            budget=int(budget) if METHODS[method].needs_budget and budget is not None else None,
            block_size=int(block_size) if block_size else None,
            prefill=None if prefill in (None, "auto") else prefill,
            max_new_tokens=int(max_new or 64),
            temperature=float(temperature or 0.0),
            followup=followup or "reuse",
            method_options=method_options(method, values),
        )
        cfg.validate()
        return cfg

    @staticmethod
    def _sampling(fps, max_frames) -> FrameSampling:
        try:
            return FrameSampling(fps=float(fps or 1.0), max_frames=int(max_frames or 32))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"video sampling: {exc}") from None

    def _write_report(self, report: dict[str, Any], previous: str | None) -> str:
        """The report as a JSON file of its own (the session's previous one is deleted)."""
        if previous and Path(previous).parent.parent == self._tmp:
            shutil.rmtree(Path(previous).parent, ignore_errors=True)
        folder = Path(tempfile.mkdtemp(dir=self._tmp))
        path = folder / "visualkv_report.json"
        write_json(report, str(path))
        return str(path)

    # -- chat -----------------------------------------------------------------------------------
    @gpu
    def chat(self, message, state, method, budget, block_size, max_new, temperature, followup, prefill, fps,
             max_frames, *method_values):
        """Generator: one turn, streamed. Outputs: chatbot, input, state, error, progress, plot, download."""
        st = self._state(state)
        skip = gr.skip()
        message = message or {}
        prompt = (message.get("text") or "").strip()
        files = message.get("files") or []

        def fail(msg: str):
            return (skip, skip, st, _error(msg, files), skip, skip, skip)

        if not prompt:
            yield fail("The question is empty: type a question about the image or video, then send.")
            return
        try:
            cfg = self._config(method, budget, block_size, max_new, temperature, followup, prefill, method_values)
            media = None
            if files:  # validate the file first, so its own problem is what the user reads
                media = load_media(files[0], limits=MediaLimits(max_file_bytes=MAX_FILE_BYTES),
                                   sampling=self._sampling(fps, max_frames))
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
        before = list(st.history)
        user_content: list[Any] = ([{"path": files[0]}] if files else []) + [prompt]
        st.history = [*before, {"role": "user", "content": user_content}, {"role": "assistant", "content": ""}]
        st.stop = threading.Event()
        st.live_blocks = []
        yield (st.history, {"text": "", "files": []}, st, "", _progress(0, 1, "reading the input…"), skip, skip)

        answer = ""
        epoch = st.epoch
        for kind, payload in stream_turn(session, prompt, media, st.stop, time_limit=self.turn_time_limit):
            if st.epoch != epoch:  # New chat or another model was chosen meanwhile: drop this turn quietly
                return
            if kind == "block":
                st.live_blocks.append(payload)
                label = (f"prefill block {payload.index + 1}/{payload.n_blocks} ({payload.kind}, +{payload.tokens_in} "
                         f"tokens) · KV {payload.kv_bytes / viz.MIB:.2f} MiB")
                fig = viz.block_memory_figure(live_report(session, st.live_blocks), n_blocks=payload.n_blocks)
                yield (skip, skip, st, "", _progress(payload.index + 1, payload.n_blocks, label), fig, skip)
            elif kind == "text":
                answer += payload
                st.history[-1] = {"role": "assistant", "content": answer}
                yield (st.history, skip, st, "", skip, skip, skip)
            elif kind == "error":
                st.history = before  # the failed turn leaves no trace; the session is unchanged
                yield (st.history, skip, st, _error(payload, files), "", skip, skip)
                return
            else:  # done
                record = payload
                if new_session:
                    st.session, st.media_path, st.first_prompt = session, files[0] if files else None, prompt
                    st.settings_used = dict(cfg.__dict__)
                st.history[-1] = {"role": "assistant", "content": record.answer or "(empty answer)"}
                st.report = viz_report = turn_report(session)
                st.report_path = self._write_report(viz_report, st.report_path)
                fig = viz.block_memory_figure(viz_report) if viz_report.get("blocks") else skip
                stopped = " · stopped" if record.stopped == "stopped" else ""
                label = (f"done · TTFT {record.ttft_seconds:.2f} s · {record.decode_tokens_per_second:.1f} tokens/s"
                         f" · KV {record.kv_bytes_after / viz.MIB:.2f} MiB{stopped}")
                if notes:
                    label += " · " + " ".join(notes)
                n = max(len(viz_report.get("blocks") or []), 1)
                yield (st.history, skip, st, "", _progress(n, n, label), fig,
                       gr.update(value=st.report_path, interactive=True))

    def stop(self, state):
        if state is not None:
            state.stop.set()
        return gr.skip()

    def new_chat(self, state):
        st = self._state(state)
        st.new_chat()
        return (st, [], "", "", None, gr.update(value=None, interactive=False), *self._empty_views())

    # -- views after prefill ----------------------------------------------------------------------
    def _empty_views(self):
        return (gr.update(choices=["average"], value="average"), "Ask a question to see the kept tokens.", None,
                "Sali-Cache only.", None, None, "Video only.", None, None, "LightKV only.", None, None, "No turn yet.")

    def views(self, state, layer_choice):
        st = self._state(state)
        rep = st.report
        if rep is None or st.session is None:
            return self._empty_views()
        media = st.session.media
        frames = media.frames if media is not None else []
        times = media.times if media is not None else None
        n_layers = len(rep.get("retained_per_layer") or [])
        layers = ["average", *(f"layer {i}" for i in range(n_layers))]
        layer_value = layer_choice if layer_choice in layers else "average"
        layer_dd = gr.update(choices=layers, value=layer_value)

        if frames and rep.get("visual_tokens"):
            heat = viz.retained_view(frames, times, rep, layer=_layer_index(layer_value))
            kept = sum(rep.get("retained") or []) / max(rep["visual_tokens"], 1)
            heat_note = (f"{rep['visual_tokens']} visual tokens, {kept:.1%} of their entries kept on average "
                         "(green kept, red evicted; " + ("one tile per frame)." if viz.is_video(rep) else
                                                         "downscaled for display).")
                         )
        else:
            heat, heat_note = None, "No image or video in this chat."

        if frames and viz.has_saliency(rep):
            sal, tiers, sali_note = viz.saliency_view(frames, times, rep), viz.tier_view(frames, times, rep), \
                "Saliency (bright = salient) and the precision tier of each visual token."
        else:
            sal, tiers, sali_note = None, None, NOT_AVAILABLE + " Saliency and tiers come from Sali-Cache."

        if rep.get("frames"):
            timeline, thumbs = viz.frame_timeline_figure(rep), viz.frame_thumbnails(frames, rep)
            timeline_note = ("Motion per sampled frame, the skip threshold, and skipped frames." if viz.has_motion(rep)
                             else "Sampled frames (this method skips none and measures no motion).")
        else:
            timeline, thumbs, timeline_note = None, None, NOT_AVAILABLE + " The timeline is for videos."

        if viz.has_merge_map(rep):
            merge = viz.merge_view(frames, times, rep) if frames else None
            layer_fig, merge_note = viz.layer_tokens_figure(rep), "Tokens merged together share a colour."
        else:
            merge, layer_fig, merge_note = None, None, NOT_AVAILABLE + " Merge maps come from LightKV."

        numbers = "| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in viz.summary_rows(rep))
        return (layer_dd, heat_note, heat, sali_note, sal, tiers, timeline_note, timeline, thumbs, merge_note, merge,
                layer_fig, numbers)

    def layer_changed(self, state, layer_choice):
        st = self._state(state)
        if st.report is None or st.session is None or st.session.media is None or not st.report.get("visual_tokens"):
            return gr.skip()
        media = st.session.media
        return viz.retained_view(media.frames, media.times, st.report, layer=_layer_index(layer_choice))

    # -- model ------------------------------------------------------------------------------------
    def load_model(self, choice, typed, state, progress=gr.Progress()):  # noqa: B008 - how Gradio injects progress
        st = self._state(state)
        skip = gr.skip()
        name = (typed or "").strip() or (choice or "").strip()
        if not name:
            return (st, skip, _error("Choose a model or type a Hub id / local folder."), skip, skip, skip, skip)
        progress(0.1, desc=f"loading {name}…")
        try:
            self.cache.get(name)
        except Exception as exc:  # noqa: BLE001 - ModelLoadError or anything else: keep the current model
            return (st, skip, _error(f"{failure_message(exc)} — still using {st.model_name}."), skip, skip, skip,
                    skip)
        progress(1.0, desc="loaded")
        st.model_name = name
        st.new_chat()  # a chat's cache belongs to its model
        note = text.offline_note(name, is_offline_model(name))
        return (st, note, "", [], f"Loaded {html.escape(name)}; new chat started.", None,
                gr.update(value=None, interactive=False))

    # -- settings ---------------------------------------------------------------------------------
    def method_changed(self, method, followup):
        cls = METHODS.get(method)
        budget = gr.update(interactive=bool(cls and cls.needs_budget))
        groups = [gr.update(visible=name == method) for name in self.group_names]
        return (text.method_line(method), budget, text.followup_note(method, followup), *groups)

    # -- compare ----------------------------------------------------------------------------------
    @gpu
    def compare(self, state, methods, question, file, method, budget, block_size, max_new, temperature, followup,
                prefill, fps, max_frames, *method_values):
        st = self._state(state)
        question = (question or "").strip() or st.first_prompt
        path = file or st.media_path
        try:
            if not question:
                raise ConfigError("type a question (or chat first: the chat's first question is the default)")
            if not path:
                raise ConfigError("give a file here or start a chat with an image or video first")
            base = self._config(method, budget, block_size, max_new, temperature, followup, prefill, method_values)
            base = dataclasses.replace(base, budget=int(budget) if budget else None)  # for the methods that use one
            options = {}
            for name in methods or []:
                vals = {key: v for (m, key), v in zip(self.method_keys, method_values) if m == name}
                options[name] = method_options(name, vals)
            media = load_media(path, limits=MediaLimits(max_file_bytes=MAX_FILE_BYTES),
                               sampling=self._sampling(fps, max_frames))
            adapter = self.cache.get(st.model_name)
            results: dict[str, Any] = {}
            yield gr.skip(), gr.skip(), f"running {len(methods or [])} methods…"
            for name, rep in compare_methods(adapter, media, question, methods or [], base, options):
                results[name] = rep
                yield (viz.compare_rows(results), viz.compare_memory_figure(results),
                       f"{len(results)}/{len(methods)} done")
            yield viz.compare_rows(results), viz.compare_memory_figure(results), \
                f"done: {len(results)} methods on “{html.escape(question)}”"
        except Exception as exc:  # noqa: BLE001 - shown in the status line
            yield gr.skip(), gr.skip(), _error(failure_message(exc), [path] if path else None)


def _layer_index(choice: str | None) -> int | None:
    if not choice or choice == "average":
        return None
    try:
        return int(choice.split()[-1])
    except ValueError:
        return None
