"""The GPU seconds each example card's first turn asks ZeroGPU for, and how long its call takes in a CPU emulation.

For every example card of the app (`ui.examples.chat_examples` over the bundled demo model's scenes), with the
app's default settings (`ui.forms.DEFAULTS`): the turn's plan (`turn_plan`) and the seconds a call asks for on a
first call (`call_seconds` at the `DeviceSpeed` constants: no speed measured yet), and what the same plan would ask
of a model with 7 billion parameters (the demo model is tiny: its calls ask the setup and little more). Then the turn runs through
`ui.gpu.stream_turn` as on a ZeroGPU Space, with a small stand-in `spaces` package: each call forked into a worker
process, its arguments and results pickled; the wall seconds of each call (fork to last result) are measured.
That emulation runs on this machine's CPU: its seconds are not ZeroGPU's. It plans the emulated calls at a CPU
speed (`CPU_SPEED`), so the turn limit inside a call does not cut a turn the CPU runs slower than an H200.

    python scripts/zerogpu_durations.py [--json docs/results/zerogpu_durations.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import pickle
import sys
import time
import types
from collections.abc import Iterator
from typing import ClassVar

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

from visualkv.bench import provenance
from visualkv.bench.demo_examples import load_demo_examples
from visualkv.bench.forked import run_forked
from visualkv.media import load_media
from visualkv.models.registry import DEMO_MODEL, load_model
from visualkv.runtime.calls import MARGIN, DeviceSpeed, call_seconds, turn_plan
from visualkv.runtime.frame_cap import media_limits
from visualkv.runtime.park import ZERO_GPU_ENV
from visualkv.runtime.session import ChatSession

#: what the emulated calls are planned with: a CPU's speed per billion parameters, with time to spare
CPU_SPEED = DeviceSpeed(prefill_tokens_per_second=20.0, decode_tokens_per_second=1.0, seconds_per_block=1.0)


class CallLog:
    """What each emulated call asked for and how long it took (wall seconds, fork to last result)."""

    asked: ClassVar[list[int]] = []
    wall: ClassVar[list[float]] = []


def fake_spaces() -> types.ModuleType:
    """A `spaces` package whose GPU decorator forks a worker per call and pickles what crosses, as ZeroGPU."""

    def GPU(duration=60):  # the package's own name
        def decorate(fn):
            def call(*args, **kwargs) -> Iterator:
                CallLog.asked.append(duration(*args, **kwargs) if callable(duration) else duration)
                start = time.perf_counter()
                try:
                    yield from run_forked(fn, pickle.dumps((args, kwargs)), join_seconds=None)
                finally:
                    CallLog.wall.append(time.perf_counter() - start)

            return call

        return decorate

    module = types.ModuleType("spaces")
    module.GPU = GPU
    return module


def zero_gpu_module():
    """`ui.gpu` as on a ZeroGPU Space: the stand-in `spaces`, `SPACES_ZERO_GPU` set, calls planned at `CPU_SPEED`."""
    os.environ[ZERO_GPU_ENV] = "true"
    sys.modules["spaces"] = fake_spaces()
    import ui.gpu

    gpu = importlib.reload(ui.gpu)
    gpu.DEVICE_SPEED = CPU_SPEED
    return gpu


def measure(gpu, adapter, path: str, question: str) -> dict:
    """One example card's first turn: its plan, the seconds asked on ZeroGPU, the emulated call's wall time."""
    from ui.examples import example_labels
    from ui.forms import DEFAULTS

    config = DEFAULTS.session_config([])
    media = load_media(path, limits=media_limits(config.method), sampling=DEFAULTS.sampling())  # as the app does
    session = ChatSession(adapter, config)
    plan = turn_plan(session, question, media)
    events = list(gpu.stream_turn(session, question, media))
    kind, payload = events[-1]
    if kind != "done":
        raise RuntimeError(f"{path}: {question!r} ended with {kind}: {payload}")
    return {
        "example": example_labels([{"text": question, "files": [path]}])[0],
        "file": os.path.basename(path),
        "question": question,
        "plan": dataclasses.asdict(plan),
        "seconds_asked": call_seconds(plan),
        "seconds_asked_7b": call_seconds(dataclasses.replace(plan, billions=7.0)),
        "emulated_seconds_asked": CallLog.asked[-1],
        "cpu_wall_seconds": round(CallLog.wall[-1], 3),
        "prefill_seconds": round(payload.prefill_seconds, 3),
        "answer_tokens": len(payload.token_ids),
        "stopped": payload.stopped,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default="docs/results/zerogpu_durations.json")
    args = p.parse_args(argv)
    prov = provenance.start()
    prov["command"] = " ".join(["python scripts/zerogpu_durations.py", *(sys.argv[1:] if argv is None else argv)])
    from ui.examples import chat_examples
    from ui.forms import DEFAULTS

    adapter = load_model(DEMO_MODEL)
    gpu = zero_gpu_module()
    rows = []
    for card in chat_examples(load_demo_examples()):
        rows.append(measure(gpu, adapter, card["files"][0], card["text"]))
        row = rows[-1]
        print(f"{row['example']}: asks {row['seconds_asked']} s; CPU emulation {row['cpu_wall_seconds']:.2f} s")
    out = {
        "kind": "zerogpu_durations",
        "model": DEMO_MODEL,
        "settings": {k: v for k, v in dataclasses.asdict(DEFAULTS).items() if k != "method_values"},
        "speed": dataclasses.asdict(DeviceSpeed()),
        "margin": MARGIN,
        "cpu_speed": dataclasses.asdict(CPU_SPEED),
        "rows": rows,
    }
    provenance.save_json(out, args.json, prov)
    print("saved", args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
