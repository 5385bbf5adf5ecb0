"""The lines a computation shows while it waits, runs or stops, and the error line.

The Stop buttons answer in the browser first (`stop_ack_js`, `compare_stop_ack_js`): the server's own answer
can wait behind a loaded machine's stream of block updates.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

from visualkv.report import viz

from . import text

# Fewest seconds between two live block updates sent to the browser. A small model finishes a block in
# ~30 ms: drawing every one would leave the page seconds behind the engine (a Stop clicked at "block 2" would
# reach a prefill that had already ended). Skipped blocks still count: the next update draws them all.
LIVE_UPDATE_SECONDS = 0.25

READING_LABEL = "reading the input…"
PREFILL_LABEL = "prefill block"  # + " k/N (…)"; the line stays on the last block while the answer streams
STOPPING_LABEL = "stopping… (a prefill ends before its next layer; an answer at its next read of tokens)"
COMPARE_STOPPING = "stopping… (the running method ends before its next layer or token)"
EVIDENCE_LABEL = "evidence pass: reading the conversation again, uncompressed…"
WAITING_LABEL = "waiting: position"  # + " k in the queue (…)"
STARTING_LABEL = "starting…"
# plain words, no symbol such as U+23F9: a font without the glyph draws an empty box
WITHDRAWN_TURN = "Stopped while it waited in the queue: nothing ran, and the question is still in the box."
WITHDRAWN_COMPARE = "Stopped while it waited in the queue: no method ran."
#: a send while this chat's turn waits or runs (the page would drop it unsaid): the question stays in the box
SEND_REFUSED = (
    "Your previous question is still waiting or running, so this one was not sent: it stays in the box. "
    "Send it once the answer is done (or press Stop)."
)

#: what a prefill block holds, in words (`visualkv.layout.Block.kind`)
BLOCK_KINDS = {
    "bulk": "a first stretch in one pass",
    "rows": "rows of the image",
    "tile": "image tiles",
    "frame": "video frames",
    "text": "text",
}


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
    """The progress line Stop shows, at once, in the browser (`stop_ack_js`); the server adds nothing, so the
    turn's own final line is the last word."""
    return progress_html(0, 1, STOPPING_LABEL)


def stop_ack_js() -> str:
    """Browser-side Stop: the progress line of a turn waiting or running (reading, prefilling or answering) or
    of an evidence pass becomes the "stopping…" line; any other line is returned unchanged."""
    # each label up to its "…": the stopping line has two endings ("(a prefill ends…" and "(after block k/N…")
    running_labels = (WAITING_LABEL, STARTING_LABEL, READING_LABEL, PREFILL_LABEL, STOPPING_LABEL, EVIDENCE_LABEL)
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


def block_kind(kind: str) -> str:
    """What a prefill block holds, as the progress line says it ("rows of the image", "video frames")."""
    return BLOCK_KINDS.get(kind, kind)


def done_label(turn: dict, stopped: bool, notes: list[str]) -> str:
    """The progress line of an answered turn (`turn`: `TurnRecord.to_dict()`), every number with its name:
    "done · time to first token (TTFT) 3.06 s · answer: 24 tokens at 12.3 tokens/s · KV cache 1.23 MiB"."""
    tokens = len(turn.get("token_ids") or [])
    speed = viz.decode_speed(turn)
    pace = f" at {speed}" if speed != "n/a" else " (too short to time)"
    parts = [
        "done",
        f"time to first token (TTFT) {turn.get('ttft_seconds') or 0.0:.2f} s",
        f"answer: {tokens} token{'' if tokens == 1 else 's'}{pace}",
        f"KV cache {(turn.get('kv_bytes_after') or 0) / viz.MIB:.2f} MiB",
    ]
    if stopped:
        parts.append("stopped")
    return " · ".join(parts) + (" · " + " ".join(notes) if notes else "")


def note_html(message: str) -> str:
    """A line in the progress area without a bar (e.g. what a click on an example card did)."""
    return f'<div class="vkv-progress-text">{html.escape(message)}</div>'


def open_tab_js(label: str, condition: str, passes: int = 0) -> str:
    """Browser-side: open the result tab named `label` when `condition` (JavaScript, on the page) holds; the
    function hands its `passes` arguments on unchanged (as an event's `js` before its Python function)."""
    find = f"Array.from(document.querySelectorAll('#vkv-results button[role=tab]')).find(b => b.innerText.trim() === {json.dumps(label)})"
    args = ", ".join(f"a{k}" for k in range(passes))
    return f"({args}) => {{ if ({condition}) {{ const tab = {find}; if (tab) tab.click(); }} return [{args}]; }}"
