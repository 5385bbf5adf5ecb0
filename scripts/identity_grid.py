"""The identity grid: what every method and composition does on every family's tiny model, recorded exactly.

Per (method, family): an image turn and a follow-up on the kept cache, a video turn and a follow-up that
re-prefills the media (query-aware methods; the others reuse their cache). Per turn it records the generated
token ids, a hash of the kept token indices of every layer and tier, and the peak and final KV bytes (and the
device peak, with the transients the methods allocate). A
refactoring of the core must leave every figure equal: tests/test_identity_grid.py recomputes the grid and
compares it with tests/identity_grid.json, written by this script at a known commit.

    python scripts/identity_grid.py --out tests/identity_grid.json
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: per family: (image width, height), (video frames, width, height), block size; the smallest media that still
#: give each several blocks and more visual tokens than the budget (tiling families have a floor of tiles)
FAMILIES = {
    "tiny-qwen2.5-vl": ((224, 168), (4, 112, 84), 16),
    "tiny-smolvlm2": ((28, 560), (2, 56, 56), 64),
    "tiny-qwen3-vl": ((112, 84), (4, 112, 84), 16),
    "tiny-llava-onevision": ((28, 560), (2, 56, 56), 200),
    "tiny-internvl3.5": ((32, 32), (2, 56, 56), 128),
}
PROMPT, FOLLOW_UP = "What is in the picture?", "And the colours?"
NEW_TOKENS = 2
BUDGET = 12


def media(family: str) -> dict[str, Any]:
    """The grid's small image and video for `family` (synthetic, seeded)."""
    from visualkv.bench.synthetic import image_media, video_media

    (w, h), (n, vw, vh), _ = FAMILIES[family]
    return {"image": image_media(w, h, seed=1), "video": video_media(n, vw, vh, fps=1.0, seed=2)}


def kept_hash(cache) -> str:
    """sha256 (16 hex digits) over every layer's kept token indices, tier by tier, in cache order."""
    digest = hashlib.sha256()
    for i, layer in enumerate(cache.layers):
        if not layer.is_initialized:
            continue
        segments = [(0, layer.token_index), *sorted((t, s.token_index) for t, s in layer.quant.items())]
        for tier, index in segments:
            digest.update(f"{i}:{tier}:{tuple(index.shape)}".encode())
            digest.update(index.detach().cpu().long().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def turn_record(session) -> dict[str, Any]:
    report = session.report()
    return {
        "tokens": list(session.turns[-1].token_ids),
        "kept": kept_hash(session.cache),
        "peak_kv_bytes": report["peak_kv_bytes"],
        "final_kv_bytes": report["final_kv_bytes"],
        # with the transients the methods report (scores, dequantized tiers): the memory guard's device view
        "peak_device_kv_bytes": report["peak_device_kv_bytes"],
    }


def grid_methods() -> list[str]:
    """Every choosable method: the single ones and every composition."""
    from visualkv.methods import method_names

    return method_names()


def run_case(adapter, method: str, kind: str, clip, block_size: int) -> dict[str, Any]:
    """One session: a media turn, then a follow-up (re-prefilled for video, kept cache for the image)."""
    from visualkv.methods import method_traits
    from visualkv.runtime.session import ChatSession, SessionConfig

    config = SessionConfig(
        method=method,
        budget=BUDGET if method_traits(method).needs_budget else None,
        block_size=block_size,
        max_new_tokens=NEW_TOKENS,
        followup="reprefill" if kind == "video" else "reuse",
        decode="eager",
    )
    session = ChatSession(adapter, config)
    session.ask(PROMPT, clip)
    first = turn_record(session)
    session.ask(FOLLOW_UP)
    return {kind: first, f"{kind}-followup" if kind == "image" else "video-reprefill": turn_record(session)}


@functools.cache
def tiny_model(family: str):
    from visualkv.models.registry import load_model

    return load_model(family)


def compute_cell(family: str, method: str) -> dict[str, Any]:
    """{case: record} of `method` on `family`'s tiny model."""
    adapter = tiny_model(family)
    cases: dict[str, Any] = {}
    for kind, clip in media(family).items():
        cases.update(run_case(adapter, method, kind, clip, FAMILIES[family][2]))
    return cases


def compute(methods: list[str] | None = None, families=tuple(FAMILIES)) -> dict[str, Any]:
    """{family: {method: {case: record}}} over the grid."""
    return {family: {m: compute_cell(family, m) for m in methods or grid_methods()} for family in families}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args()
    started = time.perf_counter()
    grid = compute()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], check=True, cwd=root, capture_output=True, text=True
    ).stdout.strip()
    doc = {
        "command": "python scripts/identity_grid.py --out " + args.out,
        "commit": commit,
        "machine": f"{platform.machine()} {platform.processor() or platform.system()}, {os.cpu_count()} cpus",
        "seconds": round(time.perf_counter() - started, 1),
        "settings": {"budget": BUDGET, "new_tokens": NEW_TOKENS, "families": FAMILIES},
        "grid": grid,
    }
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"wrote {args.out}: {sum(len(m) for m in grid.values())} method x family cells in {doc['seconds']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
