"""HR-Bench (DreamMr/HR-Bench): four-option questions on 4K and 8K images, single- and cross-instance.

Release layout under DATA: ``hr_bench_4k.parquet`` / ``hr_bench_8k.parquet`` (or the ``.tsv`` copies, or
VLMEvalKit's ``HRBench4K.tsv`` / ``HRBench8K.tsv``), columns index, question, answer, category,
cycle_category, A, B, C, D and image (base64). ``--subset 4k|8k`` reads one file. Prompt: lmms-eval's
tasks/hrbench ("{question}", "A. ..." lines, "Answer the option letter directly."); extraction: the rule
stage of VLMEvalKit's ``can_infer`` (a lone option letter, else the option whose text the answer holds),
without the GPT judge lmms-eval adds. Overall: the mean over ``cycle_category`` of each one's accuracy
(HR-Bench's own average).
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

from visualkv.eval.choices import letter_token, option_text
from visualkv.eval.items import DataError, EvalItem, field_of, read_table, require_columns, require_dir

NAME = "hrbench"
SUBSETS = ("4k", "8k")
GROUPS = ("resolution", "category")
COLUMNS = ("index", "question", "answer", "category", "A", "B", "image")
FILES = {
    "4k": ("hr_bench_4k.parquet", "hr_bench_4k.tsv", "HRBench4K.tsv"),
    "8k": ("hr_bench_8k.parquet", "hr_bench_8k.tsv", "HRBench8K.tsv"),
}


def prompt(question: str, options: list[str]) -> str:
    lines = [f"{letter}. {text}" for letter, text in zip("ABCD", options)]
    return "\n".join([question.strip(), *lines, "Answer the option letter directly."])


def read(data: Path, subset: str | None = None) -> list[EvalItem]:
    require_dir(data, "HR-Bench's folder")
    items = []
    for resolution in (subset,) if subset else SUBSETS:
        path = next((data / name for name in FILES[resolution] if (data / name).is_file()), None)
        if path is None:
            if subset:
                raise DataError(f"{data}: no {' / '.join(FILES[resolution])} (HR-Bench {resolution})")
            continue
        rows = read_table(path)
        require_columns(rows, path, COLUMNS)
        items += [_item(row, resolution, path) for row in rows]
    if not items:
        raise DataError(f"{data}: no HR-Bench table ({', '.join(FILES['4k'] + FILES['8k'])})")
    return items


def _item(row: dict, resolution: str, path: Path) -> EvalItem:
    options = [str(row[k]) for k in "ABCD" if k in row and _present(row[k])]
    encoded = str(field_of(row, "image", path, f"row {row['index']}"))
    return EvalItem(
        item_id=f"{resolution}/{row['index']}",
        media=lambda: _decode(encoded, path, row["index"]),
        prompt=prompt(str(row["question"]), options),
        options=options,
        answer=str(row["answer"]).strip().upper(),
        groups={
            "resolution": resolution,
            "category": str(row["category"]),
            "cycle": str(row.get("cycle_category", "")),
        },
        question=str(row["question"]),
    )


def _present(value) -> bool:
    return value is not None and str(value) not in ("", "nan", "None")


def _decode(encoded: str, path: Path, index):
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(base64.b64decode(encoded)))
        return image.convert("RGB")
    except Exception:  # noqa: BLE001 - a corrupt cell: binascii, PIL and OS errors alike
        raise DataError(f"{path}: row {index}'s image is not a base64-encoded picture") from None


def extract(answer: str, item: EvalItem) -> str | None:
    letters = "ABCD"[: len(item.options)]
    return letter_token(answer, letters) or option_text(answer, item.options, letters)


def overall(rows: list[dict]) -> float:
    """HR-Bench's average: the mean over cycle categories of each one's accuracy."""
    by_cycle: dict[str, list[bool]] = {}
    for r in rows:
        by_cycle.setdefault(r["groups"].get("cycle", ""), []).append(r["correct"])
    return sum(sum(v) / len(v) for v in by_cycle.values()) / len(by_cycle)
