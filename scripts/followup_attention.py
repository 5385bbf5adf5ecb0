"""A follow-up question over a long cache, end to end: the engine's lower-right marker against the tensor mask.

Usage: python scripts/followup_attention.py OUT.json [--model bench-qwen2.5-vl] [--method full] [--image 3840x2160]
  [--repeats 2] [--questions 3]

Why: `visualkv.attention.block` lets every block after cached entries attend without transformers' K/V repeat
(`scripts/block_attention.py` times one layer's call). This measures what a user sees: per session, a first turn
over a synthetic image (the cache), then follow-up questions, each a block of a few tokens after every entry.
Two sessions alternate in one process on the same input: `tensor mask` builds the engine's dense bool mask for
every block (without block_attention: transformers' SDPA then repeats K/V to every query head) and
`marker` runs as shipped. Per follow-up: TTFT (the question's prefill and the first answer token) and the
growth of the process's peak RSS over its RSS before the turn (Linux's VmHWM, reset before each follow-up). Read
the memory from a run with `--pin-mmap` (glibc's mmap threshold pinned at 64 KiB, so every tensor's memory is
returned when freed and a transient shows) and the times from one without (pinned, every large allocation costs
fresh pages).
CPU timings are this machine's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

from visualkv.bench.provenance import save_json, start
from visualkv.bench.synthetic import image_media
from visualkv.models.registry import load_model
from visualkv.report.telemetry import reset_peak_rss, rss_bytes, rss_peak_since_reset
from visualkv.runtime import engine
from visualkv.runtime.session import ChatSession, SessionConfig

CASES = ("tensor mask", "marker")
PINNED = "65536"
QUESTIONS = ("What colour is the largest shape?", "Is there any text in the picture?", "How many circles are there?")


def tensor_mask(q: int, n_past: int, impl: str, device):
    """The engine's mask without `block_attention`: a dense bool tensor for every block after the cache."""
    mask = shipped(q, n_past, impl, device)
    return mask.dense(n_past + q, device) if isinstance(mask, engine.AfterCache) else mask


shipped = engine.attention_mask


def run(case: str, adapter, config: SessionConfig, image, questions: int) -> dict:
    engine.attention_mask = tensor_mask if case == "tensor mask" else shipped
    try:
        session = ChatSession(adapter, config)
        first = session.ask("Describe the picture.", image)
        ttft, growth = [], []
        for question in QUESTIONS[:questions]:
            reset_peak_rss()
            before = rss_bytes()
            ttft.append(session.ask(question).ttft_seconds)
            growth.append(rss_peak_since_reset() - before)
        entries = session.cache.layers[0].get_seq_length()
        return {
            "first_ttft_s": first.ttft_seconds,
            "followup_ttft_s": ttft,
            "rss_growth_bytes": growth,
            "entries": entries,
        }
    finally:
        engine.attention_mask = shipped


def main() -> None:
    if "--pin-mmap" in sys.argv and os.environ.get("MALLOC_MMAP_THRESHOLD_") != PINNED:
        # the variable is read when the process starts: start again with it
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": PINNED}
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]], env)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--model", default="bench-qwen2.5-vl")
    parser.add_argument("--method", default="full")
    parser.add_argument("--image", default="3840x2160")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--questions", type=int, default=3, choices=range(1, len(QUESTIONS) + 1))
    parser.add_argument(
        "--pin-mmap",
        action="store_true",
        help="pin glibc's mmap threshold at 64 KiB (MALLOC_MMAP_THRESHOLD_), so a turn's transients show in its RSS "
        "peak (glibc otherwise serves them from memory earlier turns freed); large allocations then cost fresh "
        "pages, so time without it",
    )
    args = parser.parse_args()
    provenance = start()
    provenance["command"] = "python scripts/followup_attention.py " + " ".join(sys.argv[1:])
    width, height = (int(v) for v in args.image.split("x"))
    adapter = load_model(args.model)
    image = image_media(width, height, seed=7)
    config = SessionConfig(method=args.method, max_new_tokens=1, decode="eager")
    runs: dict[str, list[dict]] = {case: [] for case in CASES}
    with torch.no_grad():
        for _ in range(args.repeats):
            for case in CASES:
                runs[case].append(run(case, adapter, config, image, args.questions))
                r = runs[case][-1]
                print(
                    f"{case:12s} follow-up TTFT {' '.join(f'{t:.3f}' for t in r['followup_ttft_s'])} s over {r['entries']:,} entries, "
                    f"RSS peak + {' '.join(f'{g / 2**20:.1f}' for g in r['rss_growth_bytes'])} MiB",
                    flush=True,
                )
    summary = {
        case: {
            "followup_ttft_median_s": statistics.median(t for r in rs for t in r["followup_ttft_s"]),
            "followup_rss_growth_median_bytes": statistics.median(g for r in rs for g in r["rss_growth_bytes"]),
            "entries_per_layer": rs[0]["entries"],
        }
        for case, rs in runs.items()
    }
    result = {"kind": "followup_attention", "model": args.model, "method": args.method, "image": args.image}
    result["malloc_mmap_threshold"] = os.environ.get("MALLOC_MMAP_THRESHOLD_", "glibc default")
    result.update(summary=summary, runs=runs)
    save_json(result, args.out, provenance)
    for case, s in summary.items():
        print(
            f"{case:12s} median follow-up TTFT {s['followup_ttft_median_s']:.3f} s, RSS peak + {s['followup_rss_growth_median_bytes'] / 2**20:.1f} MiB"
        )


if __name__ == "__main__":
    main()
