"""Incremental detokenization: the text of each new token in O(1) work per token.

Re-decoding the whole answer for every token is O(n^2) in its length. Instead, like transformers'
TextStreamer and vLLM, we decode a short window: the tokens since the last emitted piece plus the few
before them (so a tokenizer that drops a word's leading space at the start of a decode, or merges bytes
across tokens, sees the same context it would in the whole answer), and emit what the window adds.
A piece that ends inside a multi-byte UTF-8 character decodes to U+FFFD: it is held back until the
character is complete.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Feed token ids one by one; `push` returns the new text (possibly "")."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the context window
        self.read_offset = 0  # tokens up to here have been emitted
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token: int) -> str:
        self.ids.append(token)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        window = self._decode(self.ids[self.prefix_offset :])
        if len(window) <= len(prefix) or window.endswith("\ufffd"):
            return ""  # nothing printable yet (special token, or a character cut mid-sequence)
        piece = window[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += piece
        return piece
