"""What every table shares: where the committed JSON lives, how it is read, and the Markdown pieces.

Every table ends with a source line: the JSON file, the command that wrote it, the machine (cores or GPU, idle or
loaded) and the commit measured, from its ``provenance`` block (see :mod:`visualkv.bench.provenance`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from visualkv.bench.provenance import machine_label

ROOT = Path(__file__).resolve().parents[3]
RESULTS = ROOT / "docs" / "results"
MIB = 2**20
#: the newer families' tiny aliases, in the order their rows appear
FAMILY_ALIASES = ("tiny-qwen3-vl", "tiny-llava-onevision", "tiny-internvl3.5")

Table = Callable[[Path], str]  # a table from the results folder


def load(name: str, results: Path = RESULTS) -> dict[str, Any]:
    with open(results / name) as fh:
        return json.load(fh)


def source_line(*names_and_data: tuple[str, dict[str, Any]], prefix: str = "docs/results/") -> str:
    parts = []
    for name, data in names_and_data:
        prov = data.get("provenance") or {}
        command = prov.get("command") or data.get("command", "command not recorded")
        machine = machine_label(prov) if prov else data.get("machine", "machine not recorded")
        commit = commit_phrase(prov)
        parts.append(f"[`{name}`]({prefix}{name}): `{command}` ({machine}{commit})")
    return "Source: " + "; ".join(parts) + "."


def commit_phrase(prov: dict[str, Any]) -> str:
    """ ", commit `abc1234`", with ", from a dirty tree (diff sha256 `…`)" when the measured code was not that commit."""
    if not prov.get("commit"):
        return ""
    commit = prov["commit"].removesuffix("+changes")
    dirty = prov.get("dirty") or prov["commit"].endswith("+changes")
    if not dirty:
        return f", commit `{commit}`"
    diff = f" (diff sha256 `{prov['diff_sha256'][:12]}`)" if prov.get("diff_sha256") else ""
    return f", commit `{commit}` from a dirty tree{diff}"


def table_lines(header: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table: the header, its rule, one line per row."""
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def render(header: list[str], rows: list[list[str]], sources: list[tuple[str, dict]], *notes: str) -> str:
    """A table, then each note as its own paragraph, then the source line of `sources`."""
    return "\n\n".join(["\n".join(table_lines(header, rows)), *notes, source_line(*sources)])


def render_with_source(header: list[str], rows: list[list[str]], note: str, source: str) -> str:
    """A table, a note, then `source`: the caller's own source line, for figures from no file under docs/results."""
    return "\n\n".join(["\n".join(table_lines(header, rows)), note, source])


def mib(n: float) -> str:
    return f"{n / MIB:.2f} MiB"


def times(v: float) -> str:
    """A ratio: "2.50×"."""
    return f"{v:.2f}×"


def grouped(rows: list[dict], key: Callable[[dict], Any]) -> dict[Any, list[dict]]:
    """`rows` grouped by `key`, groups and rows in first-seen order."""
    out: dict[Any, list[dict]] = {}
    for row in rows:
        out.setdefault(key(row), []).append(row)
    return out


def family_results(results: Path, pattern: str, sources: list[tuple[str, dict]]) -> Iterator[tuple[str, dict]]:
    """(alias, JSON) for each newer family whose `pattern.format(alias=...)` file exists; each is added to
    `sources` for the table's source line."""
    for alias in FAMILY_ALIASES:
        name = pattern.format(alias=alias)
        if (results / name).exists():
            d = load(name, results)
            sources.append((name, d))
            yield alias, d


def matching_results(results: Path, pattern: str, sources: list[tuple[str, dict]]) -> Iterator[tuple[str, dict]]:
    """(name, JSON) of each result file matching the glob `pattern`, in name order; each is added to `sources`."""
    for path in sorted(results.glob(pattern)):
        d = load(path.name, results)
        sources.append((path.name, d))
        yield path.name, d
