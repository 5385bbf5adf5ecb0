"""How the demo model answers questions about shapes that are NOT in the scene.

    python scripts/check_absent.py [--model visualkv-demo] [--sizes 560x315,672x378] [--scenes 80]

`bench needle` asks only about needles that are present (that is what eviction can lose). This
complements it: on held-out scenes (seeds below the training range) it asks, single turn with the
full cache, "Is there a <absent shape>?" (expected "no") and "How many <absent shape>s are there?"
(expected "0"), and prints the accuracy of each per size as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from visualkv.bench.scenes import answer_matches, make_scene, scene_media
from visualkv.cli.args import scene_size
from visualkv.models.registry import load_model
from visualkv.runtime.session import ChatSession, SessionConfig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="visualkv-demo")
    ap.add_argument("--sizes", default="560x315,672x378")
    ap.add_argument("--scenes", type=int, default=80, help="held-out scenes per size (seeds 0..N-1)")
    args = ap.parse_args(argv)
    adapter = load_model(args.model)
    out = {}
    for size_text in args.sizes.split(","):
        size = scene_size(size_text)
        hits: dict[str, list[bool]] = {"presence": [], "count": []}
        for seed in range(args.scenes):
            scene = make_scene(seed, size)
            absent = [q for q in scene.questions if q.kind in hits and q.answer in ("no", "0")]
            if not absent:
                continue
            media = scene_media(scene)
            for kind, kind_hits in hits.items():
                q = next((q for q in absent if q.kind == kind), None)
                if q is None:
                    continue
                answer = ChatSession(adapter, SessionConfig(method="full", max_new_tokens=6)).ask(q.question, media)
                kind_hits.append(answer_matches(answer.answer, q.answer))
        out[size_text] = {kind: {"accuracy": round(float(np.mean(v)), 3), "n": len(v)} for kind, v in hits.items()}
        print(size_text, json.dumps(out[size_text]), flush=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
