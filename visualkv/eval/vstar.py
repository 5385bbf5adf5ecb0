"""V*Bench (craigwu/vstar_bench): 191 four-option questions on high-resolution images.

Release layout under DATA: ``test_questions.jsonl`` (one {image, text, category, question_id, label} per
line; ``text`` holds the question and its "(A) ..." option lines) and the images in the category folders
it names (``direct_attributes/*.jpg``, ``relative_position/*.jpg``). Prompt: lmms-eval's tasks/vstar_bench
(the question, "A. ..." option lines, "Answer with the option's letter from the given choices directly.");
extraction: its ``extract_answer_letter`` patterns, then the option-text fallback. Overall: the plain mean.
"""

from __future__ import annotations

import re
from pathlib import Path

from visualkv.eval.choices import fallback
from visualkv.eval.items import DataError, EvalItem, field_of, option_letters, read_jsonl, require_file

NAME = "vstar"
SUBSETS = ("direct_attributes", "relative_position")
GROUPS = ("category",)
POST_PROMPT = "Answer with the option's letter from the given choices directly."
_OPTION = re.compile(r"^\s*\(([A-J])\)\s*(.*)$")
_PATTERNS = (
    r"^([A-D])\s*[.)\]]*",
    r"(?:THE\s+)?(?:ANSWER|CHOICE|OPTION)(?:\s+IS)?[\s:]+([A-D])",
    r"\(([A-D])\)",
    r"([A-D])\s*(?:\.|\)|])",
    r"(?:^|\s)([A-D])(?:\s|$)",
)


def split_text(text: str, path: Path, where: str) -> tuple[str, list[str]]:
    """The question and the option texts of a ``text`` field ("... (A) x (B) y", one option per line or not)."""
    pieces = re.split(r"\(([A-J])\)", text)
    question, options = pieces[0].strip(), [p.strip() for p in pieces[2::2]]
    if len(options) < 2:
        raise DataError(f"{path}: {where} has no '(A) ... (B) ...' options in its text")
    last = options[-1].split("\n")
    options[-1] = last[0].strip()  # an instruction line after the last option is not part of it
    return question, options


def prompt(question: str, options: list[str]) -> str:
    lines = [f"{letter}. {text}" for letter, text in zip(option_letters(len(options)), options)]
    return "\n".join([question, *lines, POST_PROMPT])


def read(data: Path, subset: str | None = None) -> list[EvalItem]:
    path = require_file(data / "test_questions.jsonl", "V*Bench's question file")
    items = []
    for number, row in enumerate(read_jsonl(path), start=1):
        where = f"line {number}"
        category = str(field_of(row, "category", path, where))
        if subset and category != subset:
            continue
        question, options = split_text(str(field_of(row, "text", path, where)), path, where)
        items.append(
            EvalItem(
                item_id=str(row.get("question_id", number - 1)),
                media=data / str(field_of(row, "image", path, where)),
                prompt=prompt(question, options),
                options=options,
                answer=str(field_of(row, "label", path, where)).strip().upper(),
                groups={"category": category},
                question=question,
            )
        )
    return items


def official_choice(answer: str) -> str | None:
    """lmms-eval's V* rule: the first of its patterns that matches the upper-cased answer, else a lone A-D."""
    text = answer.strip().upper()
    for pattern in _PATTERNS:
        if found := re.search(pattern, text):
            return found.group(1)
    letters = re.findall(r"[A-D]", text)
    return letters[0] if len(letters) == 1 else None


def extract(answer: str, item: EvalItem) -> str | None:
    """The option text first: upper-casing makes a word answer ("red" -> "RED") look like a letter ("D")."""
    letters = option_letters(len(item.options))
    return fallback(answer, item.options, letters) or official_choice(answer)


def overall(rows: list[dict]) -> float:
    return sum(r["correct"] for r in rows) / len(rows)
