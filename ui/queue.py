"""Where a computation stands in the one compute queue that chat turns, comparisons and model loads share.

Every model computation is an event of Gradio's concurrency group `compute` (one runs at a time). The position a
user is told is Gradio's own rank of that user's event in the group's queue (the `rank` of Gradio's estimation
messages) plus the computations running, read while the event waits there: never a tally of the app's own,
never more than the computations that exist, and nothing at all for a send Gradio refused (ui/gate.py keeps a
session to one computation, so its event is found by its session). The page sends a click's events one after
the other and joins the queue only after the at-once ones answered, so the line comes from a watch: the send
starts a page timer (`sent`), and each tick reads where the event waits now (`watch`) until it runs, or is
not found a moment after the send (refused, withdrawn or cancelled). The app keeps only which waiting events
Stop withdrew (each is skipped when it comes up) and what runs for each chat state (`active`), so each Stop
button stops its own. Gradio's queue is read, never changed.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from .status import STARTING_LABEL, WAITING_LABEL

COMPUTE_ID = "compute"  # the concurrency group of every model computation
JOIN_SECONDS = 3.0  # a send's event not in Gradio's queue this long after the send was refused (or withdrawn)
WATCH_SECONDS = 0.5  # how often a page reads where its sent computation waits
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
        self._sent: dict[tuple, float] = {}  # (session, kind) -> when its computation was sent (watched)
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

    def held(self) -> list:
        """The compute events waiting (less those Stop withdrew) or running now."""
        waiting, running = self._events()
        with self._lock:
            return [e for e in waiting if e._id not in self._withdrawn] + running

    def ahead_of_mine(self, request, kind: str) -> int | None:
        """How many computations run or wait ahead of this session's computation of `kind` in Gradio's queue now:
        Gradio's rank of it plus those running (0 once it runs); None when it has none there (Gradio or
        ui/gate.py refused it, it has not joined yet, Stop withdrew it or it ended)."""
        session = session_key(request)
        waiting, running = self._events()
        with self._lock:
            withdrawn = set(self._withdrawn)

        def mine(event) -> bool:
            return event.session_hash == session and self._kind(event) == kind and event._id not in withdrawn

        if any(mine(e) for e in running):
            return 0
        rank = next((rank for rank, e in enumerate(waiting) if mine(e)), None)
        return None if rank is None else rank + len(running)

    def sent(self, request, kind: str) -> None:
        """This session's computation of `kind` is being sent (the at-once call the page makes first)."""
        now = time.monotonic()
        with self._lock:  # sends never watched (a script's) are forgotten a moment later
            self._sent = {key: t for key, t in self._sent.items() if now - t < JOIN_SECONDS}
            self._sent[(session_key(request), kind)] = now

    def watch(self, request, kind: str) -> tuple[str | None, bool]:
        """One tick of the page's watch of its sent computation of `kind`: (the waiting line to show, or None to
        leave the page's line as it is; whether to tick again). It ends once the computation runs, or when it
        is not in Gradio's queue JOIN_SECONDS after the send."""
        ahead = self.ahead_of_mine(request, kind)
        if ahead:
            return self.waiting_line(ahead), True
        with self._lock:
            since = self._sent.get((session_key(request), kind))
        joining = ahead is None and since is not None and time.monotonic() - since < JOIN_SECONDS
        if not joining:
            with self._lock:
                self._sent.pop((session_key(request), kind), None)
        return None, joining

    def waiting_line_of_mine(self, request, kind: str) -> str | None:
        """The waiting line of this session's computation of `kind` now (`ahead_of_mine`), or None when it has
        none in Gradio's queue or already runs."""
        ahead = self.ahead_of_mine(request, kind)
        return None if not ahead else self.waiting_line(ahead)

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
        """Called first in a computation's handler: False if Stop withdrew its event (it must not run)."""
        event_id = current_event_id()
        with self._lock:
            return event_id is None or self._withdrawn.pop(event_id, None) is None

    def turn_took(self, seconds: float) -> None:
        """A chat turn ended after `seconds`: kept as a moving average for the waiting line."""
        with self._lock:
            self._turn_seconds = seconds if not self._turn_seconds else 0.7 * self._turn_seconds + 0.3 * seconds
