"""The app's Evidence tab and Compare's evidence recall column (ui/evidence.py), without a browser."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from PIL import Image

from tests.conftest import get_adapter
from ui import evidence
from ui.state import write_report
from visualkv.report import viz
from visualkv.runtime.session import ChatSession, SessionConfig
from visualkv.runtime.streaming import turn_report

PROMPT = "What is in the picture?"


def _state(small_image, **config):
    session = ChatSession(
        get_adapter("tiny-qwen2.5-vl"), SessionConfig(method="blockwise-keydiff", budget=24, max_new_tokens=3, **config)
    )
    session.ask(PROMPT, small_image)
    return SimpleNamespace(session=session, report=turn_report(session))


def test_the_view_says_it_costs_a_second_pass_until_computed(small_image):
    assert evidence.redraw(None, "average") == (evidence.NO_TURN, None)
    state = _state(small_image)
    note, image = evidence.redraw(state, "average")
    assert "second pass" in note and image is None
    assert "evidence recall" not in viz.summary_line(state.report)


def test_compute_draws_the_view_and_puts_recall_in_the_summary(small_image):
    state = _state(small_image)
    seen = []
    note, image, summary, _download, line = evidence.compute(
        state, "average", 0.6, progress=lambda *a, **k: seen.append((a, k))
    )
    recall = state.session.evidence.recall
    assert 0 < recall < 1
    assert f"evidence recall {recall:.1%}" in note and f"evidence recall {recall:.1%}" in summary
    assert isinstance(image, Image.Image)
    assert "evidence done" in line  # the chat's progress line ends with what the pass found
    assert seen and seen[-1][0][0] == 1.0  # progress reached the last block of the uncompressed pass
    layer_note, layer_image = evidence.redraw(state, "layer 1")  # the shared layer selector
    assert f"{state.session.evidence.recall_per_layer[1]:.1%} in layer 1" in layer_note
    assert isinstance(layer_image, Image.Image)


def test_a_refused_pass_is_a_visible_message_and_the_chat_is_kept(small_image):
    from visualkv.runtime.memory_guard import MemoryGuard

    state = _state(small_image)
    state.session.guard = MemoryGuard(free_bytes=lambda: 1)
    note, image, _summary, _download, line = evidence.compute(state, "average", 0.6, progress=lambda *a, **k: None)
    assert note.startswith("Evidence not computed:") and "evidence recall needs" in note and image is None
    assert "Evidence not computed:" in line  # the chat's progress line says it too, not a frozen "running"
    assert len(state.session.turns) == 1


def test_the_downloadable_report_gains_the_evidence(small_image, tmp_path):
    import json

    state = _state(small_image)
    state.report_path = str(tmp_path / "visualkv_report.json")
    write_report(state.report, state.report_path)
    assert "evidence" not in json.loads(Path(state.report_path).read_text())
    *_, download, _line = evidence.compute(state, "average", 0.6, progress=lambda *a, **k: None)
    saved = json.loads(Path(state.report_path).read_text())
    assert saved["evidence"]["recall"] == state.session.evidence.recall
    assert download["value"] == state.report_path


def test_compare_table_gets_a_recall_column_only_when_asked(small_image):
    plain = {"blockwise-keydiff": _state(small_image).report}
    assert evidence.table_update(plain) == viz.compare_rows(plain)  # the table as it always was
    with_recall = {"blockwise-keydiff": _state(small_image, evidence=True).report}
    frame = evidence.table_update(with_recall)["value"]
    headers = list(frame.columns)
    assert headers[-2] == "evidence recall" and len(evidence.table_columns(True)["column_widths"]) == len(headers)
    row = frame.iloc[0].tolist()
    assert row[-2] == f"{with_recall['blockwise-keydiff']['evidence_recall']:.1%}"


def test_stop_ends_the_evidence_pass_and_keeps_the_chat(small_image):
    import threading

    import pytest

    from ui.gpu import compute_evidence
    from visualkv.errors import PrefillStopped

    state = _state(small_image)
    stop = threading.Event()
    stop.set()  # pressed before the pass reaches its first layer
    with pytest.raises(PrefillStopped):
        compute_evidence(state.session, stop=stop)
    assert state.session.evidence is None and len(state.session.turns) == 1
    compute_evidence(state.session)  # the chat is intact: the pass runs when asked again
    assert state.session.evidence is not None
