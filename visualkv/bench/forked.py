"""A generator run in a worker process forked for it, as Hugging Face ZeroGPU runs a `spaces.GPU` call.

Its arguments cross pickled, each item it yields comes back pickled, and a failure in the worker comes back as its
traceback. Used by the ZeroGPU emulation (tests/test_zerogpu.py, scripts/zerogpu_durations.py).
"""

from __future__ import annotations

import multiprocessing
import pickle
import traceback
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

_END, _FAILED = "__end__", "__failed__"


class WorkerFailed(RuntimeError):
    """The call raised in its worker; the message is the worker's traceback."""


def _serve(fn: Callable[..., Iterator], payload: bytes, conn, setup: Callable[[], AbstractContextManager]) -> None:
    """In the worker: run `fn` on the pickled arguments inside `setup()`, sending each item, then the end."""
    try:
        args, kwargs = pickle.loads(payload)
        with setup():
            for item in fn(*args, **kwargs):
                conn.send_bytes(pickle.dumps(item))  # raises on anything unpicklable
        conn.send_bytes(pickle.dumps((_END, None)))
    except BaseException:  # noqa: BLE001 - the parent raises it
        conn.send_bytes(pickle.dumps((_FAILED, traceback.format_exc())))
    finally:
        conn.close()


def run_forked(
    fn: Callable[..., Iterator],
    payload: bytes,
    setup: Callable[[], AbstractContextManager] = nullcontext,
    join_seconds: float | None = 60.0,
) -> Iterator[Any]:
    """The items `fn(*args, **kwargs)` yields in a worker forked for this call (`payload`: the pickled
    `(args, kwargs)`; `setup`: a context the worker runs it in). WorkerFailed when it raised there; the worker is
    killed if it has not ended `join_seconds` after its last item."""
    context = multiprocessing.get_context("fork")
    parent, child = context.Pipe(duplex=False)
    process = context.Process(target=_serve, args=(fn, payload, child, setup), daemon=True)
    process.start()
    child.close()
    try:
        while True:
            kind, value = item = pickle.loads(parent.recv_bytes())
            if kind == _END:
                return
            if kind == _FAILED:
                raise WorkerFailed(value)
            yield item
    finally:
        process.join(timeout=join_seconds)
        if process.is_alive():
            process.kill()
