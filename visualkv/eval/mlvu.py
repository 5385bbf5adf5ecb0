"""MLVU (MLVU/MVLU): long-video multiple choice, seven tasks in the dev set's M-avg.

Release layout under DATA: ``json/<n>_<task>.json`` (a list of {video, duration, question, candidates,
answer (the right candidate's text), question_type}) and the videos in ``video/<n>_<task>/<video>`` (the
folder is the JSON file's stem: file names repeat across tasks). The generation tasks (``8_sub_scene``,
``9_summary``) have no candidates and are not read. Prompt: MLVU's choice_bench (its system line, "Question:
... Options: (A) ..." and "Only give the best option.") with its answer prefix "Best option: (" at the end
of the question, as lmms-eval's tasks/mlvu does; extraction: the letter before the first ")" (MLVU's
``check_ans``), then the option-text fallback. Overall: M-avg, the mean of the per-task accuracies.
"""

from __future__ import annotations

from pathlib import Path

from visualkv.eval.choices import fallback
from visualkv.eval.items import DataError, EvalItem, field_of, option_letters, read_json, require_dir

NAME = "mlvu"
TASKS = ("plotQA", "needle", "ego", "count", "order", "anomaly_reco", "topic_reasoning")
SUBSETS = TASKS
GROUPS = ("task",)
SYSTEM = (
    "Carefully watch this video and pay attention to every detail. Based on your observations, select the best "
    "option that accurately addresses the question."
)


def prompt(question: str, candidates: list[str]) -> str:
    options = [f"({letter}) {text}" for letter, text in zip(option_letters(len(candidates)), candidates)]
    return "\n".join(
        [SYSTEM, f"Question: {question}", "Options:", *options, "Only give the best option.", "Best option: ("]
    )


def read(data: Path, subset: str | None = None) -> list[EvalItem]:
    folder = require_dir(data / "json", "MLVU's per-task JSON files")
    items = []
    for number, task in enumerate(TASKS, start=1):
        if subset and task != subset:
            continue
        path = folder / f"{number}_{task}.json"
        if not path.is_file():
            if subset:
                raise DataError(f"{path}: no such file (MLVU's {task} questions)")
            continue
        entries = read_json(path)
        if not isinstance(entries, list):
            raise DataError(f"{path}: expected a list of questions")
        items += [_item(e, i, task, path, data / "video" / path.stem) for i, e in enumerate(entries)]
    if not items:
        raise DataError(f"{folder}: none of MLVU's task files (1_plotQA.json ... 7_topic_reasoning.json)")
    return items


def _item(entry: dict, index: int, task: str, path: Path, videos: Path) -> EvalItem:
    where = f"question {index}"
    candidates = [str(c) for c in field_of(entry, "candidates", path, where)]
    right = str(field_of(entry, "answer", path, where))
    if right not in candidates:
        raise DataError(f"{path}: {where}'s answer is not one of its candidates")
    question = str(field_of(entry, "question", path, where))
    return EvalItem(
        item_id=f"{task}/{index}",
        media=videos / str(field_of(entry, "video", path, where)),
        prompt=prompt(question, candidates),
        options=candidates,
        answer=option_letters(len(candidates))[candidates.index(right)],
        groups={"task": task},
        question=question,
    )


def official_choice(answer: str, letters: str) -> str | None:
    """MLVU's rule: the character before the first ")" (the prompt ends in "("), else the whole answer."""
    text = answer.strip()
    pick = text[text.index(")") - 1 : text.index(")")] if ")" in text else text
    return pick if len(pick) == 1 and pick in letters else None


def extract(answer: str, item: EvalItem) -> str | None:
    letters = option_letters(len(item.options))
    return official_choice(answer, letters) or fallback(answer, item.options, letters)


def overall(rows: list[dict]) -> float:
    """M-avg: the mean over tasks of each task's accuracy."""
    by_task: dict[str, list[bool]] = {}
    for r in rows:
        by_task.setdefault(r["groups"]["task"], []).append(r["correct"])
    return sum(sum(v) / len(v) for v in by_task.values()) / len(by_task)
