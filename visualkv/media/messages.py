"""One-line wording for the messages of :class:`~visualkv.errors.MediaError` (a library's text shortened,
sizes and durations in human units)."""

from __future__ import annotations

import re

from visualkv.errors import MediaError

_MAX_MESSAGE_DETAIL = 160


def one_line(text: object) -> str:
    """Collapse a library's message to one short line for our own messages."""
    flat = re.sub(r"\s+", " ", str(text)).strip()
    # decord prefixes "[12:00:00] /src/file.cc:42: " to its messages
    flat = re.sub(r"\[[\d:]+\] \S+\.(?:cc|h|cpp):\d+: ", "", flat)
    return flat if len(flat) <= _MAX_MESSAGE_DETAIL else flat[: _MAX_MESSAGE_DETAIL - 3] + "..."


def human_bytes(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.1f} s"


def no_decodable_frame(name: str, sampled: int) -> MediaError:
    return MediaError(
        f"'{name}': video has no decodable frame (sampled {sampled}, none decoded) "
        "— re-encode it (e.g. ffmpeg -i in -c:v libx264 out.mp4)"
    )
