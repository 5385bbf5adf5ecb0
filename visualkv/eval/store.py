"""Results as JSON lines: one per (item, method, budget), crash-safe, resumable, merged across ranks.

Each rank appends to its own ``shards/rank-R-of-W.jsonl``, one whole line per write, flushed and fsynced.
A crash mid-write can leave a torn last line: reading skips it and `ShardWriter` cuts it off before appending,
so the next line starts clean. A rerun (any number of ranks) skips every key found in any shard or in the
merged ``results.jsonl``; rank 0 merges all lines into ``results.jsonl`` in the item order.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

RESULTS = "results.jsonl"
SHARDS = "shards"


def row_key(row: dict[str, Any]) -> tuple[str, str, int | None]:
    return (str(row["item_id"]), str(row["method"]), row.get("budget"))


def read_lines(path: Path) -> list[dict[str, Any]]:
    """The complete JSON lines of `path` (a torn or corrupt line is skipped)."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and "item_id" in row:
            rows.append(row)
    return rows


def shard_path(out: Path, rank: int, world: int) -> Path:
    return out / SHARDS / f"rank-{rank}-of-{world}.jsonl"


def existing_rows(out: Path) -> list[dict[str, Any]]:
    """Every line written so far, by any rank of any earlier run, and the merged file's."""
    paths = [out / RESULTS, *sorted((out / SHARDS).glob("*.jsonl"))] if (out / SHARDS).is_dir() else [out / RESULTS]
    return [row for path in paths for row in read_lines(path)]


def done_keys(out: Path) -> set[tuple]:
    return {row_key(r) for r in existing_rows(out)}


class ShardWriter:
    """Appends whole lines to one rank's shard (each write opened, flushed and fsynced: a kill loses at most
    the line being written); a torn tail from an earlier crash is cut off first."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        _cut_torn_tail(path)
        self.path = path

    def write(self, row: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(row, sort_keys=True) + "\n")
            fh.flush()
            os.fsync(fh.fileno())


def _cut_torn_tail(path: Path) -> None:
    if not path.is_file():
        return
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1  # 0 when no line ended
    if end != len(data):
        with open(path, "r+b") as fh:
            fh.truncate(end)


def merge(out: Path, order: list[str]) -> list[dict[str, Any]]:
    """Write ``results.jsonl``: one line per key (the latest written wins), in item order, then method and
    budget as first seen; atomically (a temporary file renamed over it)."""
    position = {item_id: i for i, item_id in enumerate(order)}
    rows: dict[tuple, dict[str, Any]] = {}
    for row in existing_rows(out):
        rows[row_key(row)] = row
    merged = sorted(rows.values(), key=lambda r: (position.get(str(r["item_id"]), len(position)), r["run_index"]))
    tmp = out / (RESULTS + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(r, sort_keys=True) + "\n" for r in merged)
    os.replace(tmp, out / RESULTS)
    return merged
