"""Rule-based choice extraction shared by the readers (VLMEvalKit's ``can_infer``, the stage before its judge).

``letter_token``: the one option letter standing alone in the answer ("B", "(B)", "B." or "Answer: B").
``option_text``: the one option whose text the answer contains ("red" -> the option "red"). A reader first
applies its benchmark's official extraction and falls back to these, so a model that answers with the
option's words (as the bundled demo model does) is scored like one that answers with its letter.
"""

from __future__ import annotations

import re

_TOKENS = re.compile(r"[A-Za-z0-9]+")


def letter_token(answer: str, letters: str) -> str | None:
    """The single option letter that appears as a word of `answer` (upper case only), else None."""
    found = {t for t in _TOKENS.findall(answer) if len(t) == 1 and t in letters}
    return found.pop() if len(found) == 1 else None


def option_text(answer: str, options: list[str], letters: str) -> str | None:
    """The letter of the single option whose text `answer` contains (case-insensitive, as whole words)."""
    said = " " + " ".join(_TOKENS.findall(answer.lower())) + " "
    hits = [
        letter
        for letter, text in zip(letters, options)
        if (words := " ".join(_TOKENS.findall(text.lower()))) and f" {words} " in said
    ]
    return hits[0] if len(hits) == 1 else None


def fallback(answer: str, options: list[str], letters: str) -> str | None:
    """Option text first (a word answer), then a lone letter."""
    return option_text(answer, options, letters) or letter_token(answer, letters)
