"""Video times as people read them ("7:05", "12:30 of 1:00:00 read"), shared by the CLI and the app's views.

A module of its own (no plotly, no PIL) so that the CLI can say how far a prefill has read into a video on
machines without the plotting packages (a GPU box).
"""

from __future__ import annotations


def clock(seconds: float) -> str:
    """Seconds as a clock: "7:05", "1:02:03"."""
    whole = max(round(float(seconds)), 0)
    h, m, s = whole // 3600, whole // 60 % 60, whole % 60
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def video_read(seconds: float | None, duration: float | None) -> str:
    """How far a prefill has read into a video: "12:30 of 1:00:00 read" ("12:30 read" without a duration;
    "" before any video frame was reached)."""
    if seconds is None:
        return ""
    return f"{clock(seconds)} of {clock(duration)} read" if duration else f"{clock(seconds)} read"
