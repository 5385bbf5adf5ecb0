"""Sizes typed on the command line ("4GB"), without importing gradio (a bad value fails at once)."""

from __future__ import annotations

import re

_SIZE_UNITS = {"": 1, "B": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def parse_size(text: str) -> int:
    """A size such as 500MB, 4GB, 1.5 GiB, 200mb or a number of bytes, in bytes (units of 1024, as Gradio counts).

    Raises ValueError with one line saying what is accepted."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(?:([kmgt])(?:i?b)?|b)?\s*", text or "", flags=re.IGNORECASE)
    if not match:
        raise ValueError(f"not a size: {text!r} (write e.g. 500MB, 4GB or a number of bytes)")
    size = int(float(match.group(1)) * _SIZE_UNITS[(match.group(2) or "").upper()])
    if size < 1:
        raise ValueError(f"the size must be above zero, got {text!r}")
    return size
