"""The app under load: sessions at once through its API (tests/test_load.py, recorded with VISUALKV_RECORD=1)."""

from __future__ import annotations

from pathlib import Path

from visualkv.bench.tables.format import MIB, load, render

LOAD_RESULTS = "load_8_sessions.json"


def server_memory_under_sessions(results: Path) -> str:
    """Wall time and the server's RSS before, at the peak of, and after eight sessions at once."""
    d = load(LOAD_RESULTS, results)
    body = [
        [
            f"{d['sessions']} × {d['turns_per_session']}",
            f"{d['wall_seconds']:.1f} s",
            f"{d['server_rss_before_bytes'] / MIB:,.0f} MiB",
            f"{d['server_rss_peak_bytes'] / MIB:,.0f} MiB",
            f"{d['server_rss_after_close_bytes'] / MIB:,.0f} MiB",
            f"{d['after_over_before']:.3f}×",
        ]
    ]
    header = ["sessions × turns", "wall", "server RSS before", "peak", "after every session closed", "after / before"]
    return render(header, body, [(LOAD_RESULTS, d)])


TABLES = {"load": server_memory_under_sessions}
#: block name -> the source paths its figures measure (`visualkv.bench.staleness`)
MEASURES = {
    "load": ("visualkv/runtime", "ui", "app.py"),
}
