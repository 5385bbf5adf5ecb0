"""A question's length, checked before any compute.

Every decoder layer attends over a question's tokens at once, and that one attention call grows with the square
of its length: a 1 MB question made a single layer of a text pass run for minutes, past any time limit (Stop and
the time limit are asked between layers and between a layer's parts, never inside one kernel). A caller bounds
the question in tokens; a question too long to have fewer tokens than that is refused without being tokenized.
"""

from __future__ import annotations

from typing import Any

from visualkv.errors import ConfigError

#: characters one token holds at most in any text a person asks (a run of spaces merged into one token is the
#: longest); a question longer than this many characters per allowed token is refused unread
CHARS_PER_TOKEN = 32


def question_tokens(tokenizer: Any, question: str, max_tokens: int, where: str = "") -> int:
    """The number of tokens of `question`, or a one-line ConfigError naming the bound when it has more than
    `max_tokens` (`where`: whose bound it is, e.g. " on this shared instance")."""
    check_characters(question, max_tokens, where)
    count = len(tokenizer(question, add_special_tokens=False)["input_ids"])
    if count > max_tokens:
        raise ConfigError(f"{_too_long(max_tokens, where)}, got {count:,}; shorten it")
    return count


def check_characters(question: str, max_tokens: int, where: str = "") -> None:
    """A one-line ConfigError when `question` has too many characters to fit `max_tokens` tokens (unread)."""
    if len(question) > max_tokens * CHARS_PER_TOKEN:
        raise ConfigError(f"{_too_long(max_tokens, where)}, got {len(question):,} characters; shorten it")


def _too_long(max_tokens: int, where: str) -> str:
    return f"the question is too long: at most {max_tokens:,} tokens{where}"
