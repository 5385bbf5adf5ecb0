"""The lines a computation shows while it waits, runs or stops, and the error line.

The Stop buttons answer in the browser first (`stop_ack_js`, `compare_stop_ack_js`): the server's own answer
can wait behind a loaded machine's stream of block updates.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

from . import text

# Fewest seconds between two live block updates sent to the browser. A small model finishes a block in
# ~30 ms: drawing every one would leave the page seconds behind the engine (a Stop clicked at "block 2" would
# reach a prefill that had already ended). Skipped blocks still count: the next update draws them all.
LIVE_UPDATE_SECONDS = 0.25

READING_LABEL = "reading the input…"
PREFILL_LABEL = "prefill block"  # + " k/N (…)"; the line stays on the last block while the answer streams
STOPPING_LABEL = "stopping… (a prefill ends at its next block boundary; an answer at its next token)"
COMPARE_STOPPING = "stopping… (the running method ends at its next block boundary or token)"
WAITING_LABEL = "waiting: position"  # + " k in the queue (…)"
STARTING_LABEL = "starting…"
WITHDRAWN_TURN = "⏹ Stopped while it waited in the queue: nothing ran, and the question is still in the box."
WITHDRAWN_COMPARE = "⏹ Stopped while it waited in the queue: no method ran."


def error_line(message: str, paths: list[str] | None = None) -> str:
    """The error line: Markdown-escaped, with server-side upload paths shortened to file names and
    hints meant for library users (e.g. "(or raise MediaLimits.max_image_pixels)") left out."""
    for path in paths or []:
        message = message.replace(str(path), Path(path).name)
    message = re.sub(r"\s*\(or raise MediaLimits\.\w+\)", "", message)
    return "⚠️ " + text.md_escape(message)


def progress_html(done: int, total: int, label: str) -> str:
    """The chat's progress line: a label over a bar `done` of `total` full."""
    total = max(total, 1)
    return (
        f'<div class="vkv-progress-text">{html.escape(label)}</div>'
        f'<progress class="vkv-bar" value="{done}" max="{total}"></progress>'
    )


def stopping_html() -> str:
    """The progress line Stop shows: at once in the browser, then again from the server."""
    return progress_html(0, 1, STOPPING_LABEL)


def stop_ack_js() -> str:
    """Browser-side Stop: the progress line of a turn waiting or running (reading, prefilling or answering)
    becomes the "stopping…" line; any other line is returned unchanged."""
    # each label up to its "…": the stopping line has two endings ("(a prefill ends…" and "(after block k/N…")
    running_labels = (WAITING_LABEL, STARTING_LABEL, READING_LABEL, PREFILL_LABEL, STOPPING_LABEL)
    labels = "|".join(re.escape(label.split("…")[0]) for label in running_labels)
    running = rf"vkv-progress-text\">({labels})"
    return f"(p) => (/{running}/.test(p || '') ? {json.dumps(stopping_html())} : p)"


def compare_stop_ack_js() -> str:
    """Browser-side Stop of Compare: a waiting or running comparison's status line ("waiting: position 2…",
    "running 5 methods…", "2/5 · lightkv: prefill block 3/12", "1/5 done") becomes the "stopping…" line; a
    finished one is returned unchanged."""
    waiting = "|".join(re.escape(label.split("…")[0]) for label in (WAITING_LABEL, STARTING_LABEL))
    running = rf"^({waiting}|running \d+ methods|\d+\/\d+ (·|done))"
    return f"(s) => (/{running}/.test(s || '') ? {json.dumps(COMPARE_STOPPING)} : s)"
