"""`python -m visualkv eval`: each item of a benchmark answered under each (method, budget), one turn each.

Every rank reads the whole item list, answers its shard (skipping what any earlier run wrote), appends a JSON
line per answer to its own shard file and prints its progress with an ETA; after a barrier rank 0 merges the
shards, writes the summary (JSON and a table) and the accuracy-vs-KV chart.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from visualkv.errors import ConfigError
from visualkv.eval import ranks, store
from visualkv.eval.benchmarks import benchmark
from visualkv.eval.items import DataError, EvalItem

PROMPT_STYLES = ("official", "question")
#: EvalConfig fields passed on to every item's SessionConfig unchanged
SESSION_OPTIONS = ("block_size", "max_new_tokens", "seed", "evidence")


@dataclass
class EvalConfig:
    benchmark: str
    data: Path
    out: Path
    model: str = "visualkv-demo"
    methods: list[str] = field(default_factory=lambda: ["full"])
    budgets: list[int] = field(default_factory=list)
    limit: int | None = None
    subset: str | None = None
    device: str = "cpu"
    dtype: str = "auto"
    fps: float = 1.0
    max_frames: int | None = 64
    max_new_tokens: int = 16  # lmms-eval's generation_kwargs for all four benchmarks
    block_size: int | None = None
    evidence: bool = False
    prompt: str = "official"  # or "question": the bare question (a model that answers in words)
    seed: int = 0


@dataclass(frozen=True)
class Point:
    method: str
    budget: int | None
    index: int


def points(methods: list[str], budgets: list[int]) -> list[Point]:
    """One point per method without a budget, one per budget for each method that takes one."""
    from visualkv.methods import method_traits

    out: list[Point] = []
    for method in methods:
        if not method_traits(method).needs_budget:
            out.append(Point(method, None, len(out)))
            continue
        if not budgets:
            raise ConfigError(f"--method {method} keeps a budget of visual KV entries; give --budgets (e.g. 256,1024)")
        out += [Point(method, b, len(out) + i) for i, b in enumerate(budgets)]
    return out


def load_items(config: EvalConfig) -> list[EvalItem]:
    """The benchmark's items (after --subset and --limit), every media file checked to exist."""
    module = benchmark(config.benchmark, config.subset)
    if not config.data.is_dir():
        raise DataError(f"{config.data}: no such folder (--data, the downloaded {config.benchmark} release)")
    items = module.read(config.data, config.subset)[: config.limit]
    if not items:
        raise DataError(
            f"{config.data}: no {config.benchmark} questions" + (f" in {config.subset}" if config.subset else "")
        )
    for item in items:
        if not callable(item.media) and not Path(item.media).is_file():
            raise DataError(f"{item.media}: no such file (the media of {config.benchmark} item {item.item_id})")
    return items


def run_eval(config: EvalConfig, argv: list[str] | None = None, log=print) -> dict[str, Any] | None:
    """Run this rank's shard; on rank 0 return the summary (None on the other ranks)."""
    from visualkv.models.registry import load_model

    rank = ranks.from_env()
    module = benchmark(config.benchmark, config.subset)
    plan = points(config.methods, config.budgets)
    items = load_items(config)
    config.out.mkdir(parents=True, exist_ok=True)
    ranks.start(rank)
    try:
        done = store.done_keys(config.out)
        todo = [i for i in rank.shard(items) if any((i.item_id, p.method, p.budget) not in done for p in plan)]
        log(f"[{rank.label}] {len(rank.shard(items))} items in this shard, {len(todo)} to run", file=sys.stderr)
        if todo:
            adapter = load_model(config.model, device=ranks.device_for(rank, config.device), dtype=config.dtype)
            _run_shard(adapter, module, config, plan, todo, done, rank, log)
        ranks.barrier(rank)
        if rank.rank != 0:
            return None
        from visualkv.eval.summary import write_summary

        merged = store.merge(config.out, [i.item_id for i in items])
        return write_summary(merged, items, plan, module, config, argv, log)
    finally:
        ranks.stop(rank)


def _run_shard(adapter, module, config, plan, todo, done, rank, log) -> None:
    writer = store.ShardWriter(store.shard_path(config.out, rank.rank, rank.world))
    started = time.perf_counter()
    for n, item in enumerate(todo, start=1):
        for point in plan:
            if (item.item_id, point.method, point.budget) not in done:
                writer.write(answer_item(adapter, module, item, point, config))
        elapsed = time.perf_counter() - started
        log(
            f"[{rank.label}] {n}/{len(todo)} items, {elapsed:.0f} s, ETA {elapsed / n * (len(todo) - n):.0f} s",
            file=sys.stderr,
        )


def answer_item(adapter, module, item: EvalItem, point: Point, config: EvalConfig) -> dict[str, Any]:
    """One turn of `item` under `point`: the JSON line recorded for it."""
    from visualkv.runtime.session import ChatSession, SessionConfig

    shared = {name: getattr(config, name) for name in SESSION_OPTIONS}
    session = ChatSession(adapter, SessionConfig(method=point.method, budget=point.budget, **shared))
    started = time.perf_counter()
    turn = session.ask(item.prompt if config.prompt == "official" else item.question, _media(item, point, config))
    report = session.report()
    choice = module.extract(turn.answer, item)
    row = {
        "item_id": item.item_id,
        "benchmark": config.benchmark,
        "method": point.method,
        "budget": point.budget,
        "run_index": point.index,
        "groups": item.groups,
        "answer": turn.answer,
        "choice": choice,
        "expected": item.answer,
        "correct": choice == item.answer,
        "visual_tokens": report["visual_tokens"],
        "peak_kv_bytes": report["peak_kv_bytes"],
        "final_kv_bytes": report["final_kv_bytes"],
        "full_kv_bytes": report["full_kv_bytes"],
        "ttft_seconds": round(turn.ttft_seconds, 4),
        "seconds": round(time.perf_counter() - started, 3),
    }
    if config.evidence:
        row["evidence_recall"] = turn.evidence_recall
    return row


def _media(item: EvalItem, point: Point, config: EvalConfig):
    from visualkv.media import FrameSampling, load_image, load_media
    from visualkv.runtime.frame_cap import media_limits

    limits = media_limits(point.method)
    if callable(item.media):
        return load_image(item.media(), limits=limits)
    return load_media(item.media, limits=limits, sampling=FrameSampling(fps=config.fps, max_frames=config.max_frames))
