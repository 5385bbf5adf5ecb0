"""The demo model's training (scripts/train_demo.py), from the log it wrote beside the weights."""

from __future__ import annotations

import json
from pathlib import Path

from visualkv.bench.tables.format import ROOT, render_with_source

DEMO_TRAINING = ROOT / "assets" / "visualkv-demo" / "training.json"
ANSWER_KINDS = ("color", "count", "presence", "quadrant", "when")


def demo_training_phases(results: Path) -> str:
    """Steps, minutes, last loss and teacher-forced accuracy per answer kind of each training phase."""
    with open(DEMO_TRAINING) as fh:
        d = json.load(fh)
    phases = [k for k in d if k.startswith("phase")]
    body = []
    for phase in phases:
        p = d[phase]
        last = p["history"][-1]
        acc = last.get("tf_acc", {})
        body.append(
            [
                phase.removeprefix("phase"),
                str(p.get("stop_at_step") or last["step"]),
                f"{p['seconds'] / 60:.0f}",
                f"{last['loss']:.3f}",
                *(f"{acc[k] * 100:.0f} %" if k in acc else "—" for k in ANSWER_KINDS),
            ]
        )
    params = {p["params"] for p in (d[k] for k in phases)}
    minutes = sum(d[k]["seconds"] for k in phases if k[len("phase")] in "123") / 60
    note = (
        f"{', '.join(f'{n:,}' for n in sorted(params))} parameters; phases 1-3 took {minutes:.0f} min and phase 4 "
        f"{sum(d[k]['seconds'] for k in phases if k.startswith('phase4')) / 60:.0f} min of wall-clock, one thread "
        f"per run (`threads` {', '.join(sorted({str(d[k]['args']['threads']) for k in phases}))}) on shared CPU "
        "cores. Accuracy per answer kind: teacher-forced answer tokens at the last log of each phase, on fresh training "
        "samples (not held out); phases 1-2 logged it with a bug that overstates it (the log's own note)."
    )
    header = ["phase", "steps", "minutes", "loss", *ANSWER_KINDS]
    rel = DEMO_TRAINING.relative_to(ROOT)
    source = (
        f"Source: [`{rel.name}`]({rel}): `python scripts/train_demo.py` with each phase's arguments (stored in the "
        "file), one thread per run on shared CPU cores."
    )
    return render_with_source(header, body, note, source)


TABLES = {"demo-training": demo_training_phases}
#: block name -> the source paths its figures measure (`visualkv.bench.staleness`); the training log
#: describes the committed demo weights, not the library's code
MEASURES = {
    "demo-training": (),
}
