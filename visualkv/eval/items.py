"""The item every benchmark reader yields, and file reading whose failures are one line naming the file."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from visualkv.errors import VisualKVError

LETTERS = "ABCDEFGHIJ"


class DataError(VisualKVError):
    """A benchmark file is missing or not in its release layout."""


@dataclass
class EvalItem:
    """One multiple-choice question: its media, the official prompt, its options and the right letter.

    ``media`` is a file path or a zero-argument callable returning a PIL image (images stored inline, e.g.
    base64 in a table); ``groups`` are the summary's breakdowns (e.g. {"duration": "short", "task": ...})."""

    item_id: str
    media: Any
    prompt: str
    options: list[str]
    answer: str  # the right option's letter
    groups: dict[str, str] = field(default_factory=dict)
    question: str = ""


def option_letters(n: int) -> str:
    return LETTERS[:n]


def require_dir(path: Path, what: str) -> Path:
    if not path.is_dir():
        raise DataError(f"{path}: no such folder ({what}); see docs/EVAL.md for the release layout")
    return path


def require_file(path: Path, what: str) -> Path:
    if not path.is_file():
        raise DataError(f"{path}: no such file ({what}); see docs/EVAL.md for the release layout")
    return path


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{path}: not readable JSON ({_first_line(exc)})") from None


def read_jsonl(path: Path) -> list[dict]:
    rows = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: not readable ({_first_line(exc)})") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{number}: not a JSON line ({_first_line(exc)})") from None
    return rows


def read_table(path: Path) -> list[dict]:
    """The rows of a parquet or TSV file as dicts (pandas reads both; parquet through pyarrow)."""
    import pandas as pd

    try:
        if path.suffix == ".parquet":
            frame = pd.read_parquet(path)
        else:
            frame = pd.read_csv(path, sep="\t", dtype=str, keep_default_na=False)
    except Exception as exc:  # noqa: BLE001 - pandas/pyarrow raise many types for a broken file
        raise DataError(f"{path}: not a readable {path.suffix.lstrip('.')} table ({_first_line(exc)})") from None
    return frame.to_dict("records")


def require_columns(rows: list[dict], path: Path, columns: tuple[str, ...]) -> None:
    missing = [c for c in columns if rows and c not in rows[0]]
    if missing:
        raise DataError(f"{path}: missing column(s) {', '.join(missing)}; is this the benchmark's release file?")


def field_of(row: dict, key: str, path: Path, where: str) -> Any:
    """row[key], or a one-line DataError naming the file and the row."""
    if key not in row or row[key] is None:
        raise DataError(f"{path}: {where} has no '{key}' field; is this the benchmark's release file?")
    return row[key]


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
