"""The Evidence view in a real browser: opt-in, says what it costs, shows progress, draws the map with the layer
selector of Kept tokens, puts the recall in the turn's summary, and Compare's optional recall column.

One app process for this module (the fixtures and helpers of tests/test_app_browser.py), one page in file order.
Screenshots go to artifacts/.
"""

from __future__ import annotations

import json

import pytest

from tests import test_app_browser as base
from tests.test_app_browser import choose, open_tab, send, shot, small_png

app_url, browser, page = base.app_url, base.browser, base.page

pytestmark = pytest.mark.browser

PROGRESS_JS = """() => {
    // every text the Evidence image's block shows while the pass runs (Gradio's progress overlay)
    window.__vkvEvidence = [];
    const record = () => {
        const box = document.querySelector('#vkv-evidence');
        const said = box ? box.innerText.trim() : '';
        if (said) window.__vkvEvidence.push(said);
    };
    window.__vkvEvidenceObserver = new MutationObserver(record);
    window.__vkvEvidenceObserver.observe(document.body, {childList: true, subtree: true, characterData: true});
}"""


def _note(pg) -> str:
    return pg.inner_text("#vkv-evidence-note")


def test_evidence_is_opt_in_and_says_it_costs_a_second_pass(page, tmp_path):
    open_tab(page, "Evidence")
    assert "second pass" in _note(page)
    send(page, "What is in the picture?", small_png(tmp_path / "evidence.png", 448, 336, seed=3))
    open_tab(page, "Evidence")
    page.wait_for_function("() => document.querySelector('#vkv-evidence-note').innerText.includes('second pass')")
    assert "evidence recall" not in page.inner_text("#vkv-summary")  # nothing computed unasked
    assert page.locator("#vkv-evidence img").count() == 0


def test_compute_shows_progress_the_map_and_the_recall_in_the_summary(page):
    open_tab(page, "Evidence")
    page.evaluate(PROGRESS_JS)
    page.click("#vkv-evidence-run")
    page.wait_for_function(
        "() => document.querySelector('#vkv-evidence-note').innerText.includes('evidence recall')", timeout=120_000
    )
    page.wait_for_function(
        "() => { const i = document.querySelector('#vkv-evidence img'); return i && i.naturalWidth > 0; }",
        timeout=60_000,
    )
    said = page.evaluate("() => { window.__vkvEvidenceObserver.disconnect(); return window.__vkvEvidence; }")
    assert any("Computing evidence" in s for s in said), said
    recall = _note(page).split("evidence recall ")[1].split("%")[0]
    page.wait_for_function(
        "(r) => document.querySelector('#vkv-summary').innerText.includes('evidence recall ' + r + '%')",
        arg=recall,
        timeout=30_000,
    )
    shot(page, "e01_evidence_view")


def test_the_recall_is_put_in_context_by_the_needle_benchmark(page):
    """After the pass, one sentence says how often the needle benchmark's answers with a recall in this range were
    right: its figures are those of the committed results file for the recall shown."""
    results = json.loads((base.REPO / "docs" / "results" / "evidence_needle.json").read_text())
    open_tab(page, "Evidence")
    note = _note(page)
    recall = float(note.split("evidence recall ")[1].split("%")[0]) / 100
    entries = []  # the benchmark's ranges that hold the recall shown (rounded to 0.1 %: one, or two at an edge)
    for entry in results["accuracy_by_recall"]:
        label = entry["bucket"]
        if label.startswith("["):
            low, high = (float(x) for x in label.strip("[)").split(","))
            if low - 0.0005 <= recall < high + 0.0005:
                entries.append(entry)
        elif recall >= 0.9995:
            entries.append(entry)
    assert entries, (recall, results["accuracy_by_recall"])
    sentence = next(line for line in note.splitlines() if line.startswith("In the needle benchmark"))
    assert results["model"] in sentence and "\n" not in sentence, sentence
    said = [e for e in entries if f"right {round(e['accuracy'] * 100)}% of the time ({e['n']} answers)" in sentence]
    assert said and said[0]["bucket"] in sentence, (sentence, entries)


def test_the_layer_selector_is_shared_with_kept_tokens(page):
    open_tab(page, "Kept tokens")
    choose(page, "#vkv-layer", "layer 1")
    open_tab(page, "Evidence")
    page.wait_for_function(
        "() => document.querySelector('#vkv-evidence-note').innerText.includes('in layer 1')", timeout=60_000
    )
    open_tab(page, "Kept tokens")
    choose(page, "#vkv-layer", "average")


def test_compare_adds_a_recall_column_when_ticked(page):
    open_tab(page, "Compare")
    page.check("#vkv-cmp-evidence input")
    page.click("#vkv-cmp-run")
    page.wait_for_function(
        "() => document.querySelector('#vkv-cmp-status').innerText.startsWith('done')", timeout=300_000
    )
    headers = page.inner_text("#vkv-cmp-table thead")
    assert "evidence recall" in headers.replace("\n", " "), headers
    cells = page.evaluate(
        "() => Array.from(document.querySelectorAll('#vkv-cmp-table .body-cell')).map(c => c.innerText.trim())"
    )
    assert len(cells) >= 2 * 8, cells  # a row per method, the recall column among its 8 cells
    first = cells.index("full")
    assert cells[first + 6] == "100.0%", cells  # full's recall: nothing lost
    shot(page, "e02_compare_recall")
