"""Serving limits of a (possibly public) instance: who may load what, queue size, turn time, cleanup.

The policy itself lives in the library (`visualkv.runtime.access`, no gradio there); this module holds the
app's serving options and the two Gradio hooks that free a closed session's memory at once:
`demo.unload` (the tab's heartbeat stopped) and the `gr.State` delete callback (Gradio drops the
state an hour after the tab closed, or `time_to_live` after its last change).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from dataclasses import dataclass, field

import gradio as gr

from visualkv.runtime.memory_guard import release_memory

log = logging.getLogger(__name__)

BUSY_MESSAGE = "The server is busy (its queue is full): try again in a minute."


@dataclass(frozen=True)
class ServeOptions:
    """public: only allowed models load (`--share`, `--public` or a Space).
    allow_models: ids added to the allow-list (`--allow-model`).
    max_queue: events waiting at most; the next visitor is told the server is busy.
    turn_time_limit: seconds a chat turn may run before it is stopped like Stop (None: no limit).
    max_upload_bytes: the largest file a user may upload (200 MiB, fit for a Space; raise it locally
    for an hour of video with `--max-upload 4GB`).
    max_client_sessions: sessions of one visitor (network address) that may have a computation waiting or
    running at once (`--max-client-sessions`; None: no bound, the local default).
    """

    public: bool = False
    allow_models: tuple[str, ...] = field(default_factory=tuple)
    max_queue: int = 16
    turn_time_limit: float | None = 300.0
    max_upload_bytes: int = 200 * 1024**2  # Gradio's upload limit and MediaLimits.max_file_bytes (`--max-upload`)
    max_client_sessions: int | None = None


def _glibc(call: str, *args: int) -> None:
    """Call a glibc malloc function; elsewhere (another libc) its own allocator decides and nothing happens."""
    try:
        getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), call)(*args)
    except (OSError, AttributeError):
        pass


def _trim_heap() -> None:
    """Return freed heap pages to the OS (glibc keeps them otherwise), so RSS reflects what is held."""
    _glibc("malloc_trim", 0)


M_ARENA_MAX = -8  # glibc's mallopt parameter


def limit_heap_arenas(arenas: int = 2) -> None:
    """Keep glibc's malloc to a few arenas. Each turn runs in a thread of its own and glibc gives threads arenas
    of their own (up to 8 per core): a turn's transients would fragment many of them and keep a closed chat's
    memory in the process (tests/test_load.py measures the RSS after sessions close)."""
    _glibc("mallopt", M_ARENA_MAX, arenas)


def release_state(state) -> None:
    """Free one session's chat (cache, media, report); safe on None and on any other value."""
    release = getattr(state, "release", None)
    if release is not None:
        release()
        release_memory()
        _trim_heap()


def release_on_close(demo: gr.Blocks, state: gr.State) -> None:
    """When a tab closes, free its session's state now instead of an hour later."""

    def on_unload(request: gr.Request) -> None:
        holder = getattr(demo, "state_holder", None)
        session_hash = getattr(request, "session_hash", None)
        if holder is None or session_hash is None or session_hash not in holder:
            return
        value = holder.session_data[session_hash].state_data.get(state._id)
        release_state(value)
        log.info("session %s closed: its chat was released", session_hash[:8])

    demo.unload(on_unload)
