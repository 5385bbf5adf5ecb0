"""Who may join the compute queue: one computation per session, a few sessions per visitor.

Every model computation is an event of Gradio's concurrency group `compute` (ui/queue.py). A session that already
has one waiting or running is refused its next in one line, and so is a visitor (one network address) whose
sessions already hold `max_client_sessions` of them: a script that re-sends every moment, or opens many sessions
with made-up ids, holds at most that many places, and everyone else's turn comes within as many turn time limits.
The check runs when Gradio is asked to queue the event (its `push`), before anything is queued; a computation
Stop withdrew is not counted (it ends at once when it comes up). Gradio's queue itself is only read.
"""

from __future__ import annotations

import functools
import os
from collections import Counter
from typing import Any

from visualkv.runtime.access import SPACE_ENV

from .queue import COMPUTE_ID, ComputeQueue

ONE_PER_SESSION = (
    "one computation at a time per chat: yours is still waiting or running; wait for it to end (or press Stop)"
)


def client_of(request: Any) -> str:
    """The visitor's network address: the socket's peer, or on a Space the address its proxy saw (the last entry
    of X-Forwarded-For, which the proxy appends: what a visitor writes there comes before it)."""
    headers = getattr(request, "headers", None) or {}
    forwarded = headers.get("x-forwarded-for", "") if os.environ.get(SPACE_ENV) else ""
    if forwarded:
        return forwarded.split(",")[-1].strip()
    client = getattr(request, "client", None)
    return getattr(client, "host", None) or "?"


class QueueGate:
    """Refuses a compute event before Gradio queues it when its session or its visitor holds enough already."""

    def __init__(self, queue: ComputeQueue, max_client_sessions: int | None = None, where: str = "") -> None:
        self.queue = queue
        self.max_client_sessions = max_client_sessions
        self.where = where  # said after a refusal: whose limit it is
        self._joining: Counter = Counter()  # (session, client) of pushes under way (Gradio awaits inside its push)

    def install(self, blocks) -> None:
        """Check every push to `blocks`' queue (after `blocks.queue()`)."""
        gradio_queue = blocks._queue
        push = gradio_queue.push

        @functools.wraps(push)
        async def gated_push(body, request, username):
            fn = blocks.fns.get(body.fn_index)
            if fn is None or fn.concurrency_id != COMPUTE_ID:
                return await push(body, request, username)
            key = (body.session_hash, client_of(request))
            refusal = self.refusal(*key)
            if refusal is not None:
                return False, refusal, "error"
            self._joining[key] += 1
            try:
                return await push(body, request, username)
            finally:
                self._joining[key] -= 1
                if not self._joining[key]:
                    del self._joining[key]

        gradio_queue.push = gated_push

    def refusal(self, session: str | None, client: str) -> str | None:
        """The one line refusing a new computation of `session` from `client`, or None when it may join."""
        held = [(e.session_hash, client_of(e.request)) for e in self.queue.held()] + list(self._joining)
        if session is not None and any(s == session for s, _ in held):
            return ONE_PER_SESSION
        limit = self.max_client_sessions
        if limit is not None and len({s for s, c in held if c == client}) >= limit:
            return (
                f"this address already has {limit} computation(s) waiting or running, the most per visitor"
                f"{self.where}: wait for one to end"
            )
        return None
