"""Where a computation stands in the one compute queue that chat turns, comparisons and model loads share.

Every model computation is an event of Gradio's concurrency group `compute` (one runs at a time), and positions
are read from Gradio's own queue of that group when a computation is about to join it: what Gradio holds, plus
the sends of the last moment that are on their way to it (at most one per session and kind, none that Gradio will
refuse, each gone once its event arrives or after a few seconds). Nothing outlives its event (it ran, was
cancelled, or its tab closed), and a session's several waiting computations of one kind count once, so no
session can inflate the positions others are told. The app keeps only which waiting events Stop withdrew
(each is skipped when it comes up) and what runs for each chat state (`active`), so each Stop button stops its
own. Gradio's queue is read, never changed.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from .status import STARTING_LABEL, WAITING_LABEL

COMPUTE_ID = "compute"  # the concurrency group of every model computation
JOIN_SECONDS = 5.0  # how long a send counts before its event is in Gradio's queue (the page sends it right after)
WITHDRAWN_KEPT_SECONDS = 3600.0  # a withdrawn event that never comes up (New chat cancelled it) is forgotten then


def session_key(request) -> str | None:
    """The browser session a computation belongs to (None in calls without a request, e.g. some tests)."""
    return getattr(request, "session_hash", None)


def current_event_id() -> str | None:
    """Gradio's id of the event whose handler runs in this thread (None outside Gradio, e.g. in tests)."""
    from gradio.context import LocalContext

    return LocalContext.event_id.get(None)


class ComputeQueue:
    """Reads Gradio's queue of the `compute` group; shared by every session's callbacks (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._blocks: Any = None  # the gr.Blocks whose queue is read (`attach`)
        self._kind_of_fn: dict[int, str] = {}  # Gradio function id -> "turn", "compare" or "load"
        self._withdrawn: dict[str, float] = {}  # event id Stop withdrew -> when
        self._joining: dict[tuple, float] = {}  # (session, kind) sent a moment ago, not yet in Gradio's queue -> when
        self._turn_seconds = 0.0  # moving average of recent turn times
        # id() of the UserStates with a computation running -> "turn" or "compare" (what each Stop button stops)
        self.active: dict[int, str] = {}

    def attach(self, blocks) -> None:
        """Read the queue of `blocks` (its `queue()` call may come later: the queue is looked up on each read)."""
        self._blocks = blocks

    def register(self, kind: str, dependency) -> None:
        """The event listener `dependency` (what `.click(...)` returned) runs computations of `kind`."""
        self._kind_of_fn[dependency["id"]] = kind

    def _events(self) -> tuple[list, list]:
        """(waiting, running) events of the compute group as Gradio holds them now, waiting ones oldest first."""
        gradio_queue = getattr(self._blocks, "_queue", None)
        if gradio_queue is None:
            return [], []
        group = gradio_queue.event_queue_per_concurrency_id.get(COMPUTE_ID)
        waiting = list(group.queue) if group is not None else []
        jobs = list(gradio_queue.active_jobs)
        running = [e for job in jobs if job for e in job if e.concurrency_id == COMPUTE_ID]
        return waiting, running

    def _kind(self, event) -> str | None:
        return self._kind_of_fn.get(event.fn._id)

    def ahead_of_a_new_one(self, request, kind: str) -> int | None:
        """For the at-once call the page sends just before a computation of `kind` joins Gradio's queue: how many
        computations will run or wait ahead of it. None when Gradio will refuse it (its queue is full: the page
        then shows Gradio's own "busy" message), and then nothing is noted. Otherwise the send is noted as about
        to join (one note per session and kind), so that a send a moment later counts it too; the note goes
        when its event is in Gradio's queue, or after JOIN_SECONDS. Withdrawn computations are left out (they end
        at once); a session's several waiting computations of one kind count once."""
        gradio_queue = getattr(self._blocks, "_queue", None)
        if (
            gradio_queue is not None
            and gradio_queue.max_size is not None
            and len(gradio_queue) >= gradio_queue.max_size
        ):
            return None
        waiting, running = self._events()
        now = time.monotonic()
        with self._lock:
            self._joining = {
                key: sent
                for key, sent in self._joining.items()
                if now - sent < JOIN_SECONDS
                and not any(
                    (e.session_hash, self._kind(e)) == key and e.enqueue_time >= sent for e in waiting + running
                )
            }
            ahead = {(e.session_hash, self._kind(e)) for e in waiting if e._id not in self._withdrawn}
            mine = (session_key(request), kind)  # a note of its own earlier send is replaced by this one
            held = {(e.session_hash, self._kind(e)) for e in running}
            ahead |= {key for key in self._joining if key != mine and key not in held}
            self._joining[mine] = now
        return len(ahead) + len(running)

    def waiting_line(self, ahead: int) -> str:
        """What a computation with `ahead` others before it shows while it waits."""
        if not ahead:
            return STARTING_LABEL
        per_turn = f" Recent chat turns took about {self._turn_seconds:.0f} s each." if self._turn_seconds else ""
        return (
            f"{WAITING_LABEL} {ahead + 1} in the queue ({ahead} computation(s) ahead of yours: chat turns, "
            f"comparisons or model loads; one runs at a time).{per_turn}"
        )

    def withdraw(self, request, kind: str) -> bool:
        """Stop while waiting: this session's waiting computations of `kind` will not run when they come up.
        False if none waits."""
        session = session_key(request)
        waiting, _ = self._events()
        ids = [e._id for e in waiting if e.session_hash == session and self._kind(e) == kind]
        now = time.monotonic()
        with self._lock:
            self._withdrawn = {i: t for i, t in self._withdrawn.items() if now - t < WITHDRAWN_KEPT_SECONDS}
            for event_id in ids:
                self._withdrawn.setdefault(event_id, now)
        return bool(ids)

    def comes_up(self, request, kind: str) -> bool:
        """Called first in a computation's handler: False if Stop withdrew its event (it must not run). Its
        session's note of a send on its way goes now too (a computation that never waited is not seen waiting)."""
        event_id = current_event_id()
        with self._lock:
            self._joining.pop((session_key(request), kind), None)
            return event_id is None or self._withdrawn.pop(event_id, None) is None

    def turn_took(self, seconds: float) -> None:
        """A chat turn ended after `seconds`: kept as a moving average for the waiting line."""
        with self._lock:
            self._turn_seconds = seconds if not self._turn_seconds else 0.7 * self._turn_seconds + 0.3 * seconds
