"""`python -m visualkv eval`: accuracy on Video-MME, MLVU, V*Bench and HR-Bench (see docs/EVAL.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

from visualkv.cli.args import (
    DEVICES,
    DTYPES,
    HelpFormatter,
    comma_list,
    method_list,
    non_negative_int,
    positive_float,
    positive_int,
)


def add_eval_args(p: argparse.ArgumentParser) -> None:
    from visualkv.eval.benchmarks import BENCHMARKS
    from visualkv.eval.runner import PROMPT_STYLES

    p.formatter_class = HelpFormatter
    p.description = (
        "Each item of a public benchmark (in its release layout under --data) answered under each method and "
        "budget; one JSON line per answer in --out, resumable, data-parallel under torchrun / accelerate launch."
    )
    p.add_argument("--benchmark", required=True, choices=list(BENCHMARKS), help="which benchmark")
    p.add_argument("--data", required=True, type=Path, help="the downloaded release's folder (docs/EVAL.md)")
    p.add_argument("--out", required=True, type=Path, help="results folder (a rerun resumes in it)")
    p.add_argument("--model", default="visualkv-demo", help="offline alias, Hub id or local path")
    p.add_argument("--methods", type=method_list, default=["full"], help="comma-separated methods")
    p.add_argument(
        "--budgets",
        type=comma_list(positive_int),
        default=[],
        help="visual KV entries kept per layer and KV head, comma-separated; each budget method runs at each",
    )
    p.add_argument("--limit", type=positive_int, help="the first N items only (after --subset)")
    p.add_argument("--subset", help="videomme: short|medium|long; mlvu: a task; vstar: a category; hrbench: 4k|8k")
    p.add_argument(
        "--prompt",
        choices=PROMPT_STYLES,
        default="official",
        help="the benchmark's prompt, or the bare question (for a model that answers in words, like visualkv-demo)",
    )
    p.add_argument("--fps", type=positive_float, default=1.0, help="video frames sampled per second")
    p.add_argument("--max-frames", type=non_negative_int, default=64, help="video frames at most (0: no cap)")
    p.add_argument("--max-new-tokens", type=positive_int, default=16, help="answer length limit")
    p.add_argument("--block-size", type=positive_int, help="visual tokens per prefill block (default: model's)")
    p.add_argument("--evidence", action="store_true", help="also record each answer's evidence recall")
    p.add_argument("--device", choices=DEVICES, default="cpu", help="cuda: each rank takes GPU LOCAL_RANK")
    p.add_argument("--dtype", choices=DTYPES, default="auto")


def cmd_eval(args: argparse.Namespace) -> int:
    """The options named like `EvalConfig`'s fields become its values (`--max-frames 0`: no cap)."""
    from dataclasses import fields

    from visualkv.eval.runner import EvalConfig, run_eval

    values = {f.name: getattr(args, f.name) for f in fields(EvalConfig) if hasattr(args, f.name)}
    config = EvalConfig(**{**values, "max_frames": args.max_frames or None})
    run_eval(config, getattr(args, "command_argv", None))
    return 0
