"""Per-browser-session state and the shared model cache.

Each browser session holds one `UserState` in a `gr.State`: its model choice, its
ChatSession (cache, media, history), its last report. Nothing in it is shared
between sessions. Model weights are shared: `ModelCache` keeps the few most
recently used adapters keyed by (name, device); sessions hold a reference to
theirs, so an adapter evicted from the cache lives as long as a chat uses it.
"""

from __future__ import annotations

import logging
import shutil
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from visualkv.errors import ModelLoadError
from visualkv.models.registry import (
    DEMO_MODEL,
    FALLBACK_MODEL,
    OFFLINE_MODELS,
    default_offline_model_name,
    load_model,
    offline_aliases,
)
from visualkv.report.telemetry import write_json
from visualkv.runtime.access import ModelPolicy, scrub_paths

log = logging.getLogger(__name__)


def is_offline_model(name: str) -> bool:
    """An alias built in code or shipped with the repo (needs no network)."""
    return name in offline_aliases() or any(c.name == name and c.offline for c in OFFLINE_MODELS)


class ModelCache:
    """Loaded adapters shared by all sessions, at most `capacity` of them (least recently used goes).

    Every load goes through `policy` (a shared instance loads only its allowed models).
    """

    def __init__(self, device: str = "cpu", capacity: int = 2, policy: ModelPolicy | None = None) -> None:
        self.device = device
        self.capacity = capacity
        self.policy = policy or ModelPolicy()
        self._adapters: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, name: str):
        """The adapter for `name`, loading it if needed (raises ModelLoadError with one line)."""
        self.policy.check(name)
        with self._lock:
            if name in self._adapters:
                self._adapters.move_to_end(name)
                return self._adapters[name]
        try:
            adapter = load_model(name, device=self.device)
        except ModelLoadError as exc:
            if not self.policy.public:
                raise
            raise ModelLoadError(scrub_paths(str(exc))) from None  # a public page shows no server path
        with self._lock:
            self._adapters[name] = adapter
            self._adapters.move_to_end(name)
            while len(self._adapters) > self.capacity:
                self._adapters.popitem(last=False)
        return adapter

    def loaded(self) -> list[str]:
        with self._lock:
            return list(self._adapters)


def default_offline_model(cache: ModelCache) -> str:
    """The bundled demo model when it loads, else the tiny random-weight Qwen2.5-VL."""
    if default_offline_model_name() == DEMO_MODEL:  # its checkpoint is present
        try:
            cache.get(DEMO_MODEL)
            return DEMO_MODEL
        except Exception as exc:  # noqa: BLE001 - any failure: fall back to the tiny model
            log.warning("demo model %s not loadable (%s); using %s", DEMO_MODEL, exc, FALLBACK_MODEL)
    cache.get(FALLBACK_MODEL)
    return FALLBACK_MODEL


@dataclass
class UserState:
    """One browser session's chat. Created lazily by the first event of the session."""

    model_name: str
    session: Any = None  # visualkv.runtime.session.ChatSession of the current chat, None before its first turn
    history: list[dict[str, Any]] = field(default_factory=list)  # gr.Chatbot messages
    report: dict[str, Any] | None = None  # report after the last turn
    report_path: str | None = None  # that report as a JSON file, for the download button
    media_path: str | None = None  # the chat's image or video (uploaded copy)
    first_prompt: str = ""
    live_blocks: list[Any] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    settings_used: dict[str, Any] = field(default_factory=dict)  # settings the current chat was started with
    epoch: int = 0  # bumped by new_chat: a turn of an older chat still finishing must not write here

    def release(self) -> None:
        """The browser session closed: stop its turn, drop its cache, media and report (and its file)."""
        if self.report_path and Path(self.report_path).name == "visualkv_report.json":
            shutil.rmtree(Path(self.report_path).parent, ignore_errors=True)
        self.new_chat()

    def new_chat(self) -> None:
        self.stop.set()  # a turn still running ends at its next read of tokens
        self.stop = threading.Event()
        self.epoch += 1
        self.session = None
        self.history = []
        self.report = None
        self.report_path = None
        self.media_path = None
        self.first_prompt = ""
        self.live_blocks = []
        self.settings_used = {}


def write_report(report: dict[str, Any], path: str) -> None:
    """Writes a turn's report for download (the media's path reduced to its file name: the server's upload folder
    is nobody's business); a turn's file is rewritten in place when its evidence is computed."""
    media = report.get("media")
    if media and media.get("path"):
        report = {**report, "media": {**media, "path": Path(media["path"]).name}}
    write_json(report, path)
