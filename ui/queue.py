"""Positions in the one compute queue that chat turns, comparisons and model loads share.

Each computation is keyed by (browser session, kind), kind "turn", "compare" or "load"; a session may have one
of each waiting (a load only runs: its own wait is Gradio's progress on the model note). Stop withdraws a
session's waiting computations; `active` says what runs for each chat state, so each Stop button stops its own.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

from .status import STARTING_LABEL, WAITING_LABEL

LOST_AFTER_SECONDS = 1800  # an entry whose handler never ran (a closed tab, a Gradio cancel) is dropped then


def session_key(request) -> str | None:
    """The browser session a queue entry belongs to (None in calls without a request, e.g. some tests)."""
    return getattr(request, "session_hash", None)


class ComputeQueue:
    """Where each waiting computation stands; shared by every session's callbacks (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
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
        self.active: dict[int, str] = {}

    def enqueue(self, request, kind: str) -> int | None:
        """Registers a computation sent now: how many run or wait ahead of it. None when it is already running
        (this at-once event arrived after the queued one had started: an entry then would never be removed)."""
        now = time.monotonic()
        key = (session_key(request), kind)
        with self._lock:
            if now - self._running_since.get(key, float("-inf")) < 2.0:
                return None
            self._forget_lost(now)
            self._waiting.setdefault(key, []).append(now)
            ahead = sum(t < now for sent in self._waiting.values() for t in sent)
            return ahead + (1 if self._running_since else 0)

    def _forget_lost(self, now: float) -> None:
        """Drops entries older than half an hour: an event whose handler never ran would otherwise count in
        every later position."""
        fresh = {key: [t for t in sent if now - t < LOST_AFTER_SECONDS] for key, sent in self._waiting.items()}
        self._waiting = {key: sent for key, sent in fresh.items() if sent}

    def waiting_line(self, ahead: int) -> str:
        """What a computation with `ahead` others before it shows while it waits."""
        if not ahead:
            return STARTING_LABEL
        per_turn = f" Recent chat turns took about {self._turn_seconds:.0f} s each." if self._turn_seconds else ""
        return (
            f"{WAITING_LABEL} {ahead + 1} in the queue ({ahead} computation(s) ahead of yours: chat turns, "
            f"comparisons or model loads; one runs at a time).{per_turn}"
        )

    def leave(self, request, kind: str) -> bool:
        """A queued computation reached the front (or was refused): it no longer counts in others' positions.
        False if Stop withdrew it while it waited: it must not run (its entry went with the Stop, so an entry
        still there belongs to a later send, which keeps its place)."""
        key = (session_key(request), kind)
        with self._lock:
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

    def withdraw(self, request, kind: str) -> bool:
        """Stop while waiting: True if this session had computations of `kind` waiting (none of them will run)."""
        key = (session_key(request), kind)
        with self._lock:
            sent = self._waiting.pop(key, None)
            if not sent:
                return False
            self._withdrawn[key] += len(sent)
            return True

    def cancel_waiting(self, request, kind: str) -> None:
        """New chat cancels this session's waiting events of `kind` in Gradio's queue: none of them comes up,
        so neither their entries nor a withdrawal of them may outlive it."""
        key = (session_key(request), kind)
        with self._lock:
            self._waiting.pop(key, None)
            self._withdrawn.pop(key, None)

    def started(self, request, kind: str) -> None:
        with self._lock:
            self._running_since[(session_key(request), kind)] = time.monotonic()

    def finished(self, request, kind: str, seconds: float | None) -> None:
        """A computation ended; `seconds`: a chat turn's time (None for a comparison or a load, not a turn)."""
        with self._lock:
            self._running_since.pop((session_key(request), kind), None)
            if seconds is not None:  # a moving average of turn times, for the waiting message
                self._turn_seconds = seconds if not self._turn_seconds else 0.7 * self._turn_seconds + 0.3 * seconds
