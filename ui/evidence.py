"""The Evidence tab: where the uncompressed model's answer looked, with the tokens the cache kept outlined.

Opt-in: "Compute evidence" runs a second pass of the conversation through the uncompressed model
(`ChatSession.compute_evidence`, visualkv.runtime.evidence), queued with the turns, its progress shown per
block. The layer selector is the Kept tokens tab's; the drawing is `viz.evidence_view`'s. Compare's optional
evidence recall column is filled here too (`table_update`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import gradio as gr
import pandas as pd

from visualkv.errors import PrefillStopped
from visualkv.report import viz
from visualkv.runtime.streaming import failure_message, turn_report

from .gpu import compute_evidence
from .queue import COMPUTE_ID
from .state import write_report
from .views import layer_index

NOTE_BEFORE = (
    "Evidence: where the **uncompressed** model's answer looked (its attention from the answer's first 16 tokens "
    "to each visual token) and how much of it this chat's cache kept. It costs a second pass over the "
    "conversation without compression (about one `full` prefill): press *Compute evidence* after a turn."
)
NO_TURN = "Ask a question about an image or video first: the evidence is that of the last answer."
RUNNING = "Computing evidence: the uncompressed pass…"


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
    return note, image


def compute(state, layer_choice, opacity, progress=gr.Progress(), time_limit=None):  # noqa: B008 - Gradio's progress
    """Run the evidence pass for the last turn (outputs: note, image, the chat's summary line, its report file).
    The chat's Stop and the instance's turn time limit end it as they end a turn's prefill."""
    session = getattr(state, "session", None)
    if session is None or getattr(state, "report", None) is None or session.media is None:
        return NO_TURN, None, gr.skip(), gr.skip()
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
    try:
        compute_evidence(session, on_block=on_block, stop=state.stop)
    except Exception as exc:  # noqa: BLE001 - shown in the tab, the chat kept
        if isinstance(exc, PrefillStopped) and timed_out.is_set():
            return time_limit_line(time_limit), None, gr.skip(), gr.skip()
        return f"Evidence not computed: {failure_message(exc)}", None, gr.skip(), gr.skip()
    finally:
        if timer is not None:
            timer.cancel()
    state.report = turn_report(session)
    download = gr.skip()
    if getattr(state, "report_path", None):  # the downloadable report gains the evidence fields
        write_report(state.report, state.report_path)
        download = gr.update(value=state.report_path, interactive=True)
    note, image = redraw(state, layer_choice, opacity)
    return note, image, viz.summary_line(state.report), download


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


def wire_evidence(page, time_limit: float | None = None) -> None:
    """The button (queued with the turns, bounded by the turn time limit), the shared layer selector and opacity,
    and a new turn or chat."""
    panel: EvidencePanel = page.views.evidence
    inputs = [page.state, page.views.layer_dd, page.views.opacity]

    def run(state, layer_choice, opacity, progress=gr.Progress()):  # noqa: B008 - Gradio's progress injection
        return compute(state, layer_choice, opacity, progress, time_limit=time_limit)

    panel.button.click(
        run,
        inputs,
        [panel.note, panel.image, page.chat.summary_md, page.chat.download_btn],
        concurrency_id=COMPUTE_ID,
        concurrency_limit=1,
        show_progress_on=[panel.image],
    )
    at_once = {"queue": False, "show_progress": "hidden"}
    for control in (page.views.layer_dd, page.views.opacity):
        control.input(redraw, inputs, panel.outputs, trigger_mode="always_last", **at_once)
    page.chat.new_btn.click(lambda: (NO_TURN, None), None, panel.outputs, **at_once)
