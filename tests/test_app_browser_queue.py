"""The app in a real browser: the queue tells the truth, and Compare reads at a glance.

One `python app.py` process with a queue of one (`--max-queue 1`): one turn running and one waiting fill it.
While it is full, New chat, Stop and the settings still answer at once; a send Gradio refused leaves no trace
(an idle server later tells nobody to wait). Compare: Run in view at 1440x900, the default ticks suit the media,
the table fits its panel, every method's marks in the chart are in sight (post-snapkv's full-size peak
included), and New chat and Load model clear the results. Fixtures and helpers come from test_app_browser.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.app_process import app_process
from tests.test_app_browser import (
    APP_LOG,
    CHROMIUM,
    CHROMIUM_ARGS,
    ERROR_JS,
    MODEL,
    REPO,
    TURN_TIMEOUT_MS,
    VIEWPORT,
    attach,
    bot_messages,
    choose,
    in_viewport,
    open_app,
    open_tab,
    send,
    set_number,
    shot,
    small_png,
    watch,
    watched,
)

pytestmark = pytest.mark.browser
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (pip) is needed for the browser test")

AT_ONCE_MS = 5_000  # what "answers at once" means on a loaded 2-core machine
PROGRESS_JS = "(document.querySelector('#vkv-progress') || {innerText: ''}).innerText"
STATUS_JS = "(document.querySelector('#vkv-cmp-status') || {innerText: ''}).innerText"


@pytest.fixture(scope="module")
def app_url(tmp_path_factory):
    """The app with a queue of one waiting event."""
    tmp = tmp_path_factory.mktemp("queue_app")
    APP_LOG[:] = [tmp / "app.log"]
    with app_process(["--model", MODEL, "--max-queue", "1"], tmp) as (url, _, _):
        yield url


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


def _page(browser, url: str):
    pg = browser.new_context(viewport=VIEWPORT).new_page()
    open_app(pg, url)
    return pg


def _toasts(pg) -> str:
    return " ".join(pg.locator(".toast-body, .toast-wrap").all_inner_texts())


# -- the queue ---------------------------------------------------------------------------------------


def test_with_the_queue_full_new_chat_stop_and_settings_answer_at_once(browser, app_url, tmp_path):
    """A runs a long turn, B waits (the queue of one is full), C's send is refused. C's layer choice, method and
    New chat, and A's Stop, each answer within a few seconds; afterwards, an idle server tells a newcomer no
    position (the refused send left no record)."""
    a, b, c = (_page(browser, app_url) for _ in range(3))
    set_number(c, "#vkv-budget", 64)  # under the image's 235 tokens: each layer keeps its own, so each map differs
    send(c, "Which colour dominates?", small_png(tmp_path / "c.png", 448, 336, seed=7))  # C has a chat and views
    open_tab(c, "Kept tokens")
    c.locator("#vkv-heatmap img").first.wait_for(timeout=60_000)
    # A: the 4K image and a long answer (a random-weight model rarely ends one early)
    set_number(a, "#vkv-max-new", 4096)
    attach(a, REPO / "assets" / "example_4k.png")
    a.fill("#vkv-input textarea", "Where is the small red star?")
    a.click("#vkv-send")
    a.wait_for_function(f"() => /prefill block|done/.test({PROGRESS_JS})", timeout=TURN_TIMEOUT_MS)
    watch(b)
    attach(b, small_png(tmp_path / "b.png", 448, 336, seed=8))
    b.fill("#vkv-input textarea", "Question from B?")
    b.click("#vkv-send")
    b.wait_for_function("() => window.__vkv.progress.some(p => p.startsWith('waiting: position 2'))", timeout=10_000)
    c.fill("#vkv-input textarea", "A follow-up the full queue refuses?")
    c.click("#vkv-send")
    c.wait_for_function("() => /busy/i.test(document.body.innerText)", timeout=AT_ONCE_MS)  # Gradio's own refusal
    assert not a.inner_text("#vkv-progress").startswith("done"), "A's turn ended before the queue was tested"

    # a setting: the layer shown redraws the kept-token map
    before = c.locator("#vkv-heatmap img").evaluate_all("els => els.map(e => e.src)")
    choose(c, "#vkv-layer", "layer 0")
    c.wait_for_function(
        "(old) => JSON.stringify(Array.from(document.querySelectorAll('#vkv-heatmap img')).map(e => e.src))"
        " !== JSON.stringify(old)",
        arg=before,
        timeout=AT_ONCE_MS,
    )
    help_before = c.inner_text("#vkv-method-help")
    choose(c, "#vkv-method", "full")
    c.wait_for_function(
        "(old) => document.querySelector('#vkv-method-help').innerText !== old", arg=help_before, timeout=AT_ONCE_MS
    )
    # New chat empties C's chat
    c.click("#vkv-new")
    c.wait_for_function(
        "() => document.querySelectorAll('#vkv-chat [data-testid=\"bot\"]').length === 0", timeout=AT_ONCE_MS
    )
    assert not a.inner_text("#vkv-progress").startswith("done"), "A's turn ended while the queue was tested"
    # Stop ends A's turn: its answer says who stopped it
    a.click("#vkv-stop")
    a.wait_for_function(
        f"() => /stopped/.test({PROGRESS_JS}) || ({ERROR_JS}).includes('Stopped')", timeout=3 * AT_ONCE_MS
    )
    b.wait_for_function(f"() => {PROGRESS_JS}.startsWith('done')", timeout=TURN_TIMEOUT_MS)
    assert len(bot_messages(b)) == 1
    shot(b, "q1_queue_full_b_answered")

    # the server is idle: a newcomer is not told to wait behind the refused send
    newcomer = _page(browser, app_url)
    watch(newcomer)
    send(newcomer, "Which colour dominates?", small_png(tmp_path / "n.png", 448, 336, seed=9))
    said = watched(newcomer)["progress"]
    assert not [p for p in said if "waiting" in p], said
    for pg in (a, b, c, newcomer):
        pg.context.close()


# -- Compare -----------------------------------------------------------------------------------------

TABLE_FITS_JS = """() => {
    // what scrolls sideways, and the words of headers and numbers broken over two lines or cut by their cell
    const t = document.querySelector('#vkv-cmp-table');
    const scrolls = [...t.querySelectorAll('*')].filter(e => e.scrollWidth > e.clientWidth + 1
        && ['auto', 'scroll'].includes(getComputedStyle(e).overflowX)).map(e => e.className);
    const broken = [];
    const rows = [...t.querySelectorAll('.header-cell')].concat(
        [...t.querySelectorAll('.body-cell')].filter(c => c.previousElementSibling && c.nextElementSibling));
    for (const cell of rows.filter(c => c.getBoundingClientRect().height > 0)) {
        const box = cell.getBoundingClientRect();
        const walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
        for (let node = walker.nextNode(); node; node = walker.nextNode()) {
            for (const m of node.data.matchAll(/\\S+/g)) {
                const r = document.createRange();
                r.setStart(node, m.index);
                r.setEnd(node, m.index + m[0].length);
                const rects = [...r.getClientRects()].filter(q => q.width > 0);
                if (new Set(rects.map(q => Math.round(q.top))).size > 1
                    || rects.some(q => q.right > box.right + 0.5 || q.left < box.left - 0.5)) broken.push(m[0]);
            }
        }
    }
    return {scrolls, broken};
}"""

MARKS_JS = """() => {
    // every mark (a marker or a bar) of the comparison chart: its method and its box on the screen
    const marks = [];
    document.querySelectorAll('#vkv-cmp-plot .trace').forEach(trace => {
        const cd = trace.__data__;
        const name = cd && cd[0] && cd[0].trace ? cd[0].trace.name : '?';
        const bar = !!trace.closest('.barlayer');
        trace.querySelectorAll('.point').forEach(p => {
            const r = p.getBoundingClientRect();
            if (r.width > 0 || r.height > 0) marks.push({name, bar, x: r.x, y: r.y, w: r.width, h: r.height});
        });
    });
    return marks;
}"""


def _hidden_marks(marks: list[dict]) -> list[tuple[str, str]]:
    """Pairs of marks of different methods where one covers most of the other."""
    pairs = []
    for i, p in enumerate(marks):
        for q in marks[i + 1 :]:
            if p["name"] == q["name"]:
                continue
            w = min(p["x"] + p["w"], q["x"] + q["w"]) - max(p["x"], q["x"])
            h = min(p["y"] + p["h"], q["y"] + q["h"]) - max(p["y"], q["y"])
            smaller = min(max(p["w"], 1) * max(p["h"], 1), max(q["w"], 1) * max(q["h"], 1))
            if w > 0 and h > 0 and w * h > 0.5 * smaller:
                pairs.append((p["name"], q["name"]))
    return pairs


def _ticked(pg) -> list[str]:
    return pg.locator("#vkv-cmp-methods input[type=checkbox]:checked").evaluate_all(
        "els => els.map(e => e.closest('label').innerText.trim())"
    )


def _give_file(pg, path: Path) -> None:
    if pg.locator("#vkv-cmp-file button[aria-label='Clear']").count():
        pg.click("#vkv-cmp-file button[aria-label='Clear']")
    pg.set_input_files("#vkv-cmp-file input[type=file]", str(path))
    pg.wait_for_selector(f"#vkv-cmp-file a[download='{path.name}']", timeout=TURN_TIMEOUT_MS)


def _run_compare(pg) -> None:
    pg.click("#vkv-cmp-run")
    pg.wait_for_function(f"() => {STATUS_JS}.includes('done:')", timeout=TURN_TIMEOUT_MS)


def _settled_marks(pg) -> list:
    """The chart's marks once the page has drawn the last update: the status says "done" as soon as the last
    method ends, while plotly may still be redrawing the chart from an earlier update."""
    marks, deadline = pg.evaluate(MARKS_JS), time.monotonic() + 15
    while time.monotonic() < deadline:
        pg.wait_for_timeout(500)
        again = pg.evaluate(MARKS_JS)
        if again == marks:
            break
        marks = again
    return marks


def _results_empty(pg) -> bool:
    return pg.evaluate(
        f"""() => !{STATUS_JS}.trim()
            && !document.querySelectorAll('#vkv-cmp-table .body-cell').length
            && !Array.from(document.querySelectorAll('#vkv-cmp-plot .js-plotly-plot')).some(p => p.data && p.data.length)"""
    )


def test_compare_reads_at_a_glance(browser, app_url, tmp_path):
    from visualkv.bench.synthetic import write_video_file

    pg = _page(browser, app_url)
    set_number(pg, "#vkv-budget", 64)
    set_number(pg, "#vkv-block-size", 64)
    pg.evaluate("() => window.scrollTo(0, 0)")
    open_tab(pg, "Compare")
    assert in_viewport(pg, "#vkv-cmp-run"), "Compare's Run button is below the fold at 1440x900"
    # the default ticks follow the media: Sali-Cache (frame skipping) and EVS beside it for a video, not for an image
    _give_file(pg, Path(write_video_file(str(tmp_path / "clip.mp4"), n_frames=4, width=64, height=64)))
    pg.wait_for_function("() => document.querySelectorAll('#vkv-cmp-methods input:checked').length > 0")
    pg.wait_for_timeout(1000)
    assert {"salicache", "evs"} <= set(_ticked(pg)), _ticked(pg)
    _give_file(pg, small_png(tmp_path / "scene.png", 448, 336, seed=4))
    pg.wait_for_function(
        "() => !Array.from(document.querySelectorAll('#vkv-cmp-methods input:checked'))"
        ".some(e => e.closest('label').innerText.trim() === 'salicache')",
        timeout=AT_ONCE_MS,
    )
    assert {"full", "blockwise-snapkv", "post-snapkv"} <= set(_ticked(pg)) and "evs" not in _ticked(pg), _ticked(pg)
    pg.locator("#vkv-cmp-methods label:has-text('blockwise-keydiff')").first.click()  # a second block-wise method
    pg.locator("#vkv-cmp-q textarea").first.fill("Which colour dominates?")
    _run_compare(pg)
    pg.wait_for_selector("#vkv-cmp-plot .barlayer .point, #vkv-cmp-plot .scatterlayer .point", timeout=60_000)
    shot(pg, "q2_compare")
    fits = pg.evaluate(TABLE_FITS_JS)
    assert fits == {"scrolls": [], "broken": []}, fits  # no sideways scrolling, no header or number cut
    marks = _settled_marks(pg)
    assert _hidden_marks(marks) == [], _hidden_marks(marks)
    # post-snapkv's peak is drawn at full size: its full prefill, far above the block-wise methods'. full's peak
    # also holds its answer (up to 64 tokens after a ~210-token prompt here), so post-snapkv's is at least the
    # prompt's share of it (~0.77); drawing its final cache instead (~0.3) fails
    widest = {}
    for m in marks:
        widest[m["name"]] = max(widest.get(m["name"], 0), m["w"] if m["bar"] else 0)
    assert widest.get("post-snapkv", 0) > 0.6 * widest.get("full", 0) > 0, widest
    # and above the block-wise peak (budget + one block + text): drawing post-snapkv's final cache (budget + text +
    # answer) instead puts it below
    assert widest["post-snapkv"] > 1.2 * widest["blockwise-snapkv"], widest
    # New chat, then Load model, each clear the results
    pg.click("#vkv-new")
    pg.wait_for_function(f"() => !{STATUS_JS}.trim()", timeout=AT_ONCE_MS)
    assert _results_empty(pg)
    _run_compare(pg)
    pg.click("#vkv-load")
    pg.wait_for_function(f"() => {PROGRESS_JS}.startsWith('Loaded')", timeout=TURN_TIMEOUT_MS)
    pg.wait_for_function(f"() => !{STATUS_JS}.trim()", timeout=AT_ONCE_MS)
    assert _results_empty(pg)
    pg.context.close()
