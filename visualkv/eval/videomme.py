"""Video-MME (lmms-lab/Video-MME): 2,700 four-option questions on 900 videos, short / medium / long.

Release layout under DATA: ``videomme/test-*.parquet`` (columns videoID, question_id, duration, domain,
task_type, question, options ["A. ...", ...], answer "A") and the videos as ``data/<videoID>.mp4`` (the
unzipped ``videos_chunked_*.zip``; ``.MP4`` / ``.mkv`` and a flat ``DATA/<videoID>.mp4`` are found too).
Prompt: Video-MME's frames-only instruction (the official repository's, also in lmms-eval's
tasks/videomme/utils.py); extraction: its ``extract_characters_regex`` (answer prefixes removed, the first
capital A-D), then the option-text fallback of :mod:`visualkv.eval.choices`. Overall: the plain mean.
"""

from __future__ import annotations

import re
from pathlib import Path

from visualkv.eval.choices import fallback
from visualkv.eval.items import DataError, EvalItem, field_of, read_table, require_columns, require_dir

NAME = "videomme"
SUBSETS = ("short", "medium", "long")
GROUPS = ("duration", "task", "domain")
COLUMNS = ("videoID", "question_id", "duration", "task_type", "question", "options", "answer")
INSTRUCTION = (
    "Select the best answer to the following multiple-choice question based on the video. "
    "Respond with only the letter (A, B, C, or D) of the correct option."
)
ANSWER_PREFIXES = (
    "The best answer is",
    "The correct answer is",
    "The answer is",
    "The answer",
    "The best option is",
    "The correct option is",
    "Best answer:",
    "Best option:",
)
_OPTION_LABEL = re.compile(r"^\s*[A-D][.)]\s*")


def prompt(question: str, options: list[str]) -> str:
    return "\n".join([INSTRUCTION, question, *options, "The best answer is:"])


def read(data: Path, subset: str | None = None) -> list[EvalItem]:
    tables = sorted(require_dir(data / "videomme", "Video-MME's question table").glob("test-*.parquet"))
    if not tables:
        raise DataError(f"{data / 'videomme'}: no test-*.parquet (Video-MME's question table)")
    items = []
    for table in tables:
        rows = read_table(table)
        require_columns(rows, table, COLUMNS)
        for row in rows:
            if subset and row["duration"] != subset:
                continue
            items.append(_item(row, table, data))
    return items


def _item(row: dict, table: Path, data: Path) -> EvalItem:
    options = [str(o) for o in field_of(row, "options", table, f"question {row['question_id']}")]
    return EvalItem(
        item_id=str(row["question_id"]),
        media=_video(data, str(row["videoID"])),
        prompt=prompt(str(row["question"]), options),
        options=[_OPTION_LABEL.sub("", o) for o in options],
        answer=str(row["answer"]).strip(),
        groups={"duration": str(row["duration"]), "task": str(row["task_type"]), "domain": str(row.get("domain", ""))},
        question=str(row["question"]),
    )


def _video(data: Path, video_id: str) -> Path:
    for folder in (data / "data", data):
        for suffix in (".mp4", ".MP4", ".mkv"):
            if (path := folder / f"{video_id}{suffix}").is_file():
                return path
    return data / "data" / f"{video_id}.mp4"  # missing: the run names it when it reaches the item


def official_choice(answer: str) -> str | None:
    """Video-MME's rule: drop answer prefixes; a long answer without a capital A-D says nothing; else its
    first capital A-D."""
    text = answer.strip()
    for prefix in ANSWER_PREFIXES:
        text = text.replace(prefix, "")
    found = re.search(r"[ABCD]", text)
    return found.group(0) if found else None


def extract(answer: str, item: EvalItem) -> str | None:
    letters = "ABCD"[: len(item.options)]
    return official_choice(answer) or fallback(answer, item.options, letters)


def overall(rows: list[dict]) -> float:
    return sum(r["correct"] for r in rows) / len(rows)
