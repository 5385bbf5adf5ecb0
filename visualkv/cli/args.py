"""Value types and help formatting for the command line, so that bad options fail at parse time.

Each type raises `argparse.ArgumentTypeError` with a message that names the bad value and what is
expected; the CLI's parser prints it on one line and exits with code 2 before any model loads.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

DEVICES = ("cpu", "cuda", "auto")
DTYPES = ("auto", "float32", "bfloat16", "float16")
MAX_SCENE_SIDE = 7680  # 8K: beyond it a synthetic scene is only a memory hazard


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description as written; appends "(default: X)" to an option's help unless the default
    is None/False or the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def _number(text: str, kind: type) -> int | float:
    try:
        return kind(text)
    except ValueError:
        what = "a whole number" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


def positive_int(text: str) -> int:
    value = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive whole number, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def media_path(text: str) -> str:
    """A media file's path: an empty one is refused here (it would otherwise read as "no media")."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty: give an image or video file")
    return text


def positive_float(text: str) -> float:
    value = _number(text, float)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return value


def fraction(text: str) -> float:
    """A share of the visual tokens: 0 < f <= 1."""
    value = _number(text, float)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"a budget fraction must be in (0, 1], got {text} (10 % is 0.1)")
    return value


def scene_size(text: str) -> tuple[int, int]:
    """ "WxH" in pixels, e.g. 672x378."""
    parts = text.lower().replace("×", "x").split("x")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"a size is WIDTHxHEIGHT in pixels, e.g. 672x378; got {text!r}")
    from visualkv.bench.scenes import MIN_SCENE_SIDE

    w, h = (_number(p.strip(), int) for p in parts)
    if not (MIN_SCENE_SIDE <= w <= MAX_SCENE_SIDE and MIN_SCENE_SIDE <= h <= MAX_SCENE_SIDE):
        raise argparse.ArgumentTypeError(
            f"each side must be {MIN_SCENE_SIDE} to {MAX_SCENE_SIDE} pixels (room for the needles), got {text!r}"
        )
    return w, h


def comma_list(item: Callable[[str], T]) -> Callable[[str], list[T]]:
    """A comma-separated list of `item` values (at least one); the error names the bad item."""

    def parse(text: str) -> list[T]:
        values = [item(part.strip()) for part in text.split(",") if part.strip()]
        if not values:
            raise argparse.ArgumentTypeError("expected at least one comma-separated value")
        return values

    parse.__name__ = f"list of {getattr(item, '__name__', 'values')}"
    return parse


def method_list(text: str) -> list[str]:
    """Comma-separated method names (see `visualkv.methods.method_names`, composed ones included), or "all"
    (the single methods)."""
    from visualkv.errors import ConfigError
    from visualkv.methods import METHODS, method_traits

    if text.strip() == "all":
        return list(METHODS)
    names = [m.strip() for m in text.split(",") if m.strip()]
    unknown = []
    for name in names:
        try:
            method_traits(name)
        except ConfigError:
            unknown.append(name)
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown method {', '.join(unknown) or text!r}; choose from {', '.join(METHODS)} "
            "(or compose with +, e.g. blockwise-keydiff+salicache) or all"
        )
    return names


def output_file(text: str) -> str:
    """A file the run will write at its end (a JSON report): checked now, by creating it and removing it
    again, so a bad path fails in one line before minutes of work, not after them."""
    path = Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; give a file name, e.g. {text.rstrip('/')}/report.json")
    if path.parent.exists() and not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{str(path.parent)!r} is a file, not a folder")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"the folder {str(path.parent)!r} does not exist; create it first")
    existed = path.exists()
    try:
        with path.open("a"):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {exc.strerror or exc}") from None
    if not existed:
        path.unlink()
    return text


def check_output_folder(text: str) -> None:
    """Create the output folder `text` if needed and check a file can be written in it (one line otherwise)."""
    from visualkv.errors import VisualKVError

    try:
        os.makedirs(text, exist_ok=True)
        with tempfile.TemporaryFile(dir=text):
            pass
    except OSError as exc:
        raise VisualKVError(f"cannot write into the output folder {text!r}: {exc.strerror or exc}") from None
