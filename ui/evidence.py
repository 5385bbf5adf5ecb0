"""The Evidence tab: where the uncompressed model's answer looked, with the tokens the cache kept outlined.

Opt-in: "Compute evidence" runs a second pass of the conversation through the uncompressed model
(`ChatSession.compute_evidence`, visualkv.runtime.evidence), queued with the turns, its progress shown per
block. The layer selector is the Kept tokens tab's; the drawing is `viz.evidence_view`'s. Compare's optional
evidence recall column is filled here too (`table_update`).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import gradio as gr
import pandas as pd

from visualkv.report import viz
from visualkv.runtime.streaming import failure_message, turn_report

from .gpu import compute_evidence
from .queue import COMPUTE_ID
from .state import write_report
from .status import EVIDENCE_LABEL, note_html, progress_html
from .views import layer_index

#: the needle benchmark's committed results (scripts/evidence_needle.py): what answers with a given recall were worth
NEEDLE_RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results" / "evidence_needle.json"

NOTE_BEFORE = (
    "Evidence: where the **uncompressed** model's answer looked (its attention from the answer's first 16 tokens "
    "to each visual token) and how much of it this chat's cache kept. It costs a second pass over the "
    "conversation without compression (about one `full` prefill): press *Compute evidence* after a turn."
)
NO_TURN = "Ask a question about an image or video first: the evidence is that of the last answer."
RUNNING = "Computing evidence: the uncompressed pass…"
NOTHING_KEPT = "nothing of it was kept; the chat and its answer are as they were."
EVIDENCE_STOPPED = f"Stopped the evidence pass: {NOTHING_KEPT}"


@dataclass
class EvidencePanel:
    """The Evidence tab's components."""

    button: gr.Button
    note: gr.Markdown
    image: gr.Image

    @property
    def outputs(self) -> list:
        return [self.note, self.image]


def build_evidence_tab() -> EvidencePanel:
    with gr.Tab("Evidence"):
        button = gr.Button("Compute evidence", elem_id="vkv-evidence-run", size="sm", min_width=80)
        note = gr.Markdown(NOTE_BEFORE, elem_classes="vkv-small", elem_id="vkv-evidence-note")
        image = gr.Image(
            label="the answer's attention per visual token; outlined: kept in the cache",
            type="pil",
            interactive=False,
            elem_id="vkv-evidence",
            buttons=["download", "fullscreen"],
        )
    return EvidencePanel(button, note, image)


def redraw(state, layer_choice, opacity=0.6):
    """(note, image) for the chat's last report: the evidence if it was computed, else what the button does."""
    report = getattr(state, "report", None)
    session = getattr(state, "session", None)
    if report is None or session is None or session.media is None:
        return NO_TURN, None
    if not viz.has_evidence(report):
        return NOTE_BEFORE, None
    layer = layer_index(layer_choice)
    alpha = min(max(float(opacity if opacity is not None else 0.6), 0.0), 1.0)
    media = session.media
    image = viz.evidence_view(media.frames, media.times, report, layer=layer, opacity=alpha)
    evidence = report["evidence"]
    note = (
        f"**{viz.evidence_recall_text(report, layer)}** of the uncompressed model's attention on the visual tokens "
        f"(from the answer's first {evidence['queries']} token(s)) falls on tokens this chat's cache kept. "
        f"Bright: where the answer looked; cyan outline: kept. Second pass: {evidence['seconds']:.1f} s."
    )
    return f"{note}\n\n{needle_context(evidence['recall'])}".strip(), image


@cache
def _needle_buckets() -> tuple[list, str]:
    """The needle benchmark's accuracy by recall bucket and the model it ran on ([] when the file is absent)."""
    try:
        data = json.loads(NEEDLE_RESULTS.read_text())
    except (OSError, ValueError):
        return [], ""
    return list(data.get("accuracy_by_recall") or []), str(data.get("model") or "")


def needle_context(recall: float) -> str:
    """One sentence putting `recall` in context: how often answers with a recall in its range were right in the
    needle benchmark (docs/results/evidence_needle.json); "" without that file or a matching range."""
    buckets, model = _needle_buckets()
    entry = viz.recall_bucket(buckets, recall)
    if entry is None:
        return ""
    bucket = str(entry["bucket"])
    span = f"in {bucket}" if bucket.startswith("[") else bucket
    return (
        f"In the needle benchmark ({model}, questions with a known answer, docs/results/evidence_needle.json), "
        f"answers whose recall was {span} were right {entry['accuracy']:.0%} of the time "
        f"({entry['n']} answers): the higher the recall, the less of what the answer needed was dropped."
    )


def compute(state, layer_choice, opacity, progress=gr.Progress(), time_limit=None, active=None):  # noqa: B008
    """Run the evidence pass for the last turn (outputs: note, image, the chat's summary line, its report file, the
    chat's progress line). The chat's Stop and the instance's turn time limit end it as they end a turn's prefill;
    `active` (the queue's record of what each chat runs) names it "evidence" meanwhile, for Stop."""
    session = getattr(state, "session", None)
    if session is None or getattr(state, "report", None) is None or session.media is None:
        return NO_TURN, None, gr.skip(), gr.skip(), ""
    progress(0, desc=RUNNING)

    def on_block(event) -> None:
        progress((event.index + 1) / max(event.n_blocks, 1), desc=f"{RUNNING} block {event.index + 1}")

    state.stop = threading.Event()  # the chat's Stop button sets it
    timed_out = threading.Event()  # set before `stop` when the time limit (not the user) ends the pass

    def expire() -> None:
        timed_out.set()
        state.stop.set()

    timer = threading.Timer(time_limit, expire) if time_limit else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    active = {} if active is None else active
    active[id(state)] = "evidence"
    try:
        compute_evidence(session, on_block=on_block, stop=state.stop)
    except Exception as exc:  # noqa: BLE001 - shown in the tab, the chat kept
        return _not_computed(exc, state.stop.is_set(), time_limit if timed_out.is_set() else None)
    finally:
        active.pop(id(state), None)
        if timer is not None:
            timer.cancel()
    state.report = turn_report(session)
    download = gr.skip()
    if getattr(state, "report_path", None):  # the downloadable report gains the evidence fields
        write_report(state.report, state.report_path)
        download = gr.update(value=state.report_path, interactive=True)
    note, image = redraw(state, layer_choice, opacity)
    recall = viz.evidence_recall_text(state.report, layer_index(layer_choice))
    done = progress_html(1, 1, f"evidence done: {recall} (see the Evidence tab)")
    return note, image, viz.summary_line(state.report), download, done


def _not_computed(exc: BaseException, stopped: bool, expired_limit: float | None) -> tuple:
    """The outputs of an evidence pass that failed or was stopped: the tab and the progress line say which."""
    skip = gr.skip()
    if stopped and expired_limit is not None:  # the turn time limit, not the user, ended it
        line = time_limit_line(expired_limit)
    elif stopped:
        line = EVIDENCE_STOPPED
    else:
        line = f"Evidence not computed: {failure_message(exc)}"
    return line, None, skip, skip, note_html(line)


def time_limit_line(time_limit: float) -> str:
    """What an evidence pass the turn time limit ended says."""
    return (
        f"Evidence not computed: this instance's turn time limit ({time_limit:g} s) ended the second pass; "
        "the chat is as it was."
    )


def table_update(results: dict[str, Any]):
    """Compare's table: its rows; as a frame with the evidence recall column's header when the comparison
    computed it (the table's own headers otherwise)."""
    rows = viz.compare_rows(results)
    if not viz.has_evidence_column(results):
        return rows
    return gr.update(value=pd.DataFrame(rows, columns=viz.compare_headers(results)))


def table_columns(evidence: bool):
    """Compare's column widths for a comparison that starts, with or without the evidence recall column."""
    results = {"": {"evidence_recall": 1.0}} if evidence else {}
    return gr.update(column_widths=viz.compare_widths(results))


def wire_evidence(page, time_limit: float | None = None, active: dict | None = None) -> None:
    """The button (queued with the turns, bounded by the turn time limit, stopped by the chat's Stop: its line in
    the chat's progress line), the shared layer selector and opacity, and a new turn or chat."""
    panel: EvidencePanel = page.views.evidence
    inputs = [page.state, page.views.layer_dd, page.views.opacity]
    at_once = {"queue": False, "show_progress": "hidden"}

    def run(state, layer_choice, opacity, progress=gr.Progress()):  # noqa: B008 - Gradio's progress injection
        return compute(state, layer_choice, opacity, progress, time_limit=time_limit, active=active)

    # at once, in the browser, so the Stop beside the chat has a running line to answer
    running = json.dumps(progress_html(0, 1, EVIDENCE_LABEL))
    panel.button.click(None, None, [page.chat.progress_html], js=f"() => {running}", queue=False)
    ran = panel.button.click(
        run,
        inputs,
        [panel.note, panel.image, page.chat.summary_md, page.chat.download_btn, page.chat.progress_html],
        concurrency_id=COMPUTE_ID,
        concurrency_limit=1,
        show_progress_on=[panel.image],
    )
    if page.chat.notice_md is not None:  # a card refused meanwhile: its line ends with the pass
        ran.then(None, None, [page.chat.notice_md], js="() => ''", **at_once)
    for control in (page.views.layer_dd, page.views.opacity):
        control.input(redraw, inputs, panel.outputs, trigger_mode="always_last", **at_once)
    page.chat.new_btn.click(lambda: (NO_TURN, None), None, panel.outputs, **at_once)
