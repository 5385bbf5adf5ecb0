"""A new visitor's first minute, in a real browser at 1280x720 and at 1440x900 (one app process, a random-weight
model: the checks are about the page, not the answers).

On first load the example cards are in view and the settings speak plainly; the default budget (keep 10 % of
the visual tokens) compresses a 4K image and the summary says the figure it became; while a prefill runs the
chat, the progress line and the live memory chart are in view together, and a card clicked or a question sent
then is refused in one line (the turn goes on and answers: no frozen line, the question stays in the box). Stop
answers within 0.5 s and ends, each with a final line, a turn's prefill, an evidence pass and a comparison;
after Compare its table (one line per method, a row's whole answer on a click) and its chart are in view; the
Merges chart's tick labels are whole.
"""

from __future__ import annotations

import re

import pytest

from tests import test_app_browser as base

browser = base.browser  # the browser fixture of tests/test_app_browser.py
pytestmark = pytest.mark.browser

VIEWPORTS = [{"width": 1280, "height": 720}, {"width": 1440, "height": 900}]
IMAGE_4K = base.REPO / "assets" / "example_4k.png"
VIDEO = base.REPO / "assets" / "example_video.webm"  # 64 s
MODEL = "tiny-qwen2.5-vl"
#: what the page must show at most this long after Stop is clicked
ACK_SECONDS = 0.5


@pytest.fixture(scope="module")
def app_url(tmp_path_factory):
    yield from base.run_app(tmp_path_factory, ["--model", MODEL])


@pytest.fixture(scope="module", params=VIEWPORTS, ids=lambda v: f"{v['width']}x{v['height']}")
def page(request, browser, app_url):
    """A visitor's tab at one window size, shared by this module's tests in order."""
    context = browser.new_context(viewport=request.param)
    pg = context.new_page()
    pg.goto(app_url)
    pg.wait_for_selector("#vkv-examples .thumbnail-item", timeout=60_000)
    yield pg
    context.close()


def in_view(pg, elem: str) -> bool:
    """Whether the first `elem` lies wholly inside the window, as scrolled now."""
    box = pg.locator(elem).first.bounding_box()
    size = pg.viewport_size
    return (
        box is not None
        and box["height"] > 0
        and 0 <= box["y"]
        and box["y"] + box["height"] <= size["height"]
        and 0 <= box["x"]
        and box["x"] + box["width"] <= size["width"]
    )


def progress(pg) -> str:
    return pg.evaluate("() => { const e = document.querySelector('#vkv-progress'); return e ? e.innerText : ''; }")


def stop_ack_seconds(pg, stop: str, shows: str, where: str) -> float:
    """Click `stop` in the page and return the seconds until `where`'s text contains `shows` (measured in the
    page: the click and the change are both seen there, the test's own round trips aside)."""
    return pg.evaluate(
        """([stop, shows, where]) => new Promise((resolve) => {
            const seen = () => (document.querySelector(where) || {innerText: ''}).innerText.includes(shows);
            const t0 = performance.now();
            const observer = new MutationObserver(() => {
                if (seen()) { observer.disconnect(); resolve((performance.now() - t0) / 1000); }
            });
            observer.observe(document.body, {childList: true, subtree: true, characterData: true});
            document.querySelector(stop).click();
            if (seen()) { observer.disconnect(); resolve(0); }
            setTimeout(() => { observer.disconnect(); resolve(99); }, 10000);
        })""",
        [stop, shows, where],
    )


def test_first_load_shows_every_card_and_plain_words(page):
    cards = page.locator("#vkv-examples .thumbnail-item")
    assert cards.count() >= 8
    out = [k for k in range(cards.count()) if not in_view(page, f"#vkv-examples .thumbnail-item >> nth={k}")]
    assert not out, f"cards {out} are below the fold at {page.viewport_size}"
    base.shot(page, f"fm_first_load_{page.viewport_size['width']}")
    # the default budget is a share of the media, the method is said in plain words, jargon behind a toggle
    assert page.locator("#vkv-keep input[type=number]").first.input_value() == "10"
    assert page.locator("#vkv-budget input[type=number]").first.input_value() == "0"
    help_text = page.inner_text("#vkv-method-help")
    assert "keeps the parts your question looks at" in help_text and "KV head" not in help_text, help_text
    page.click("text=Methods and terms, explained")
    words = page.locator("#vkv-words").first
    words.locator("text=KV head").first.wait_for(timeout=10_000)
    for name in ("full", "blockwise-keydiff", "post-snapkv", "salicache", "lightkv", "blockwise-random"):
        assert f"{name}:" in words.inner_text()
    page.click("text=Methods and terms, explained")  # closed again: the page as it was


def test_prefill_in_view_a_card_refused_and_stop_within_half_a_second(page):
    # the 64 s video at 4 frames a second, in blocks of one frame pair: ~120 blocks of ~300 tokens, several
    # times the 4K image's prefill, so the turn still reads its media when Stop is clicked even on a fast
    # machine; the chart's drawing is waited for after Stop, in the same layout
    base.set_number(page, "#vkv-block-size", 256)
    base.open_accordion(page, "Video sampling", "#vkv-fps")
    base.set_number(page, "#vkv-fps", 4)
    base.set_number(page, "#vkv-max-frames", 256)
    page.click("text=Video sampling")  # closed again: the settings column as a visitor finds it
    base.attach(page, VIDEO)
    page.fill("#vkv-input textarea", "What moves in this video?")
    page.click("#vkv-send")
    page.wait_for_function(
        "() => /prefill block \\d+\\//.test(document.querySelector('#vkv-progress').innerText)",
        timeout=base.TURN_TIMEOUT_MS,
    )
    page.evaluate("() => window.scrollTo(0, 0)")
    for elem in ("#vkv-chat", "#vkv-progress", "#vkv-memory"):
        assert in_view(page, elem), (elem, page.locator(elem).first.bounding_box(), page.viewport_size)
    # a card clicked now is refused in one line; the turn goes on
    page.locator("#vkv-examples .thumbnail-item").first.click()
    page.wait_for_function(
        "() => document.querySelector('#vkv-notice').innerText.includes('not loaded')", timeout=10_000
    )
    assert page.input_value("#vkv-input textarea") == ""  # the card did not replace anything
    assert "prefill block" in progress(page)
    seconds = stop_ack_seconds(page, "#vkv-stop", "stopping", "#vkv-progress")
    assert seconds <= ACK_SECONDS, seconds
    page.wait_for_function(f"() => {base.ERROR_JS}.includes('Stopped')", timeout=base.TURN_TIMEOUT_MS)
    assert "stopping" not in progress(page) and base.bot_messages(page) == []
    # the live chart the prefill drew, in view beside the chat (the final line replaced the progress bar)
    base.open_tab(page, "Memory")
    page.locator("#vkv-memory .js-plotly-plot").first.wait_for(timeout=30_000)
    page.evaluate("() => window.scrollTo(0, 0)")
    for elem in ("#vkv-chat", "#vkv-memory .js-plotly-plot"):
        assert in_view(page, elem), (elem, page.locator(elem).first.bounding_box(), page.viewport_size)
    base.shot(page, f"fm_prefill_{page.viewport_size['width']}")
    page.locator("#vkv-input .delete-button").first.click()  # the stopped turn gave its video back
    page.wait_for_function("() => document.querySelectorAll('#vkv-input .thumbnail-item').length === 0")


def test_the_default_budget_compresses_and_a_send_meanwhile_is_refused_in_one_line(page):
    """The 4K image with the default budget, in blocks of one strip (~70: the turn still runs when the second
    question is sent, even on a fast machine). That send is refused in one line in view, the question stays in
    the box, and the first turn answers; its summary says the figure the default budget became."""
    base.attach(page, IMAGE_4K)
    page.fill("#vkv-input textarea", "Where is the small red star?")
    page.click("#vkv-send")
    page.wait_for_function(
        "() => /prefill block \\d+\\//.test(document.querySelector('#vkv-progress').innerText)",
        timeout=base.TURN_TIMEOUT_MS,
    )
    page.fill("#vkv-input textarea", "And what is in the top left corner?")
    page.click("#vkv-send")
    page.wait_for_function(
        # at once on an idle machine; a loaded one may take seconds to answer beside the running turn
        "() => document.querySelector('#vkv-notice').innerText.includes('was not sent')",
        timeout=30_000,
    )
    notice = page.inner_text("#vkv-notice").strip()
    assert "\n" not in notice and "still waiting or running" in notice, notice
    page.evaluate("() => window.scrollTo(0, 0)")
    assert in_view(page, "#vkv-notice"), (page.locator("#vkv-notice").first.bounding_box(), page.viewport_size)
    assert "prefill block" in progress(page)  # refused while the first turn runs, not answered after it
    page.wait_for_function(
        "() => document.querySelector('#vkv-progress').innerText.startsWith('done')", timeout=base.TURN_TIMEOUT_MS
    )
    # the first turn answered; the second question was neither run nor lost, and its line ended with the turn
    assert len(base.bot_messages(page)) == 1 and base.bot_messages(page)[0].strip()
    assert [m.strip() for m in base.user_messages(page)] == ["Where is the small red star?"]
    assert page.input_value("#vkv-input textarea") == "And what is in the top left corner?"
    page.wait_for_function("() => document.querySelector('#vkv-notice').innerText.trim() === ''", timeout=10_000)
    summary = page.inner_text("#vkv-summary")
    assert "keep 10 % = budget" in summary and "× less at peak" in summary, summary
    visual = int(summary.split(" visual tokens")[0].replace(",", ""))
    budget = int(summary.split("= budget ")[1].split(" ")[0].replace(",", ""))
    assert abs(budget - visual / 10) <= 1, (budget, visual)
    page.fill("#vkv-input textarea", "")
    base.set_number(page, "#vkv-block-size", 0)


def test_stop_ends_an_evidence_pass(page):
    base.open_tab(page, "Evidence")
    seconds = stop_ack_seconds(page, "#vkv-evidence-run", "evidence pass", "#vkv-progress")
    assert seconds <= ACK_SECONDS, seconds  # the pass says it runs at once
    page.wait_for_function(  # it runs (Gradio's progress over the image), not only waits
        "() => document.querySelector('#vkv-evidence').innerText.includes('uncompressed pass')",
        timeout=base.TURN_TIMEOUT_MS,
    )
    seconds = stop_ack_seconds(page, "#vkv-stop", "stopping", "#vkv-progress")
    assert seconds <= ACK_SECONDS, seconds
    page.wait_for_function(
        "() => document.querySelector('#vkv-progress').innerText.includes('Stopped the evidence pass')",
        timeout=base.TURN_TIMEOUT_MS,
    )


def test_stop_beside_the_chat_ends_a_comparison(page):
    base.open_tab(page, "Compare")
    page.click("#vkv-cmp-run")
    page.wait_for_function(  # the first method reads the chat's 4K image
        "() => /^1\\/\\d+ ·/.test(document.querySelector('#vkv-cmp-status').innerText)", timeout=base.TURN_TIMEOUT_MS
    )
    seconds = stop_ack_seconds(page, "#vkv-stop", "stopping", "#vkv-cmp-status")
    assert seconds <= ACK_SECONDS, seconds
    page.wait_for_function(
        "() => document.querySelector('#vkv-cmp-status').innerText.startsWith('Stopped')", timeout=base.TURN_TIMEOUT_MS
    )


def test_after_compare_its_table_and_chart_are_in_view(page, tmp_path):
    """On a small picture (every method quick): the table wholly in view, the chart under it starting in view (at
    1440x900 with its first panel; at 1280x720 its title), the method choice after them."""
    base.open_tab(page, "Compare")
    path = base.small_png(tmp_path / "compare.png", 448, 336, seed=3)
    if page.locator("#vkv-cmp-file button[aria-label='Clear']").count():
        page.click("#vkv-cmp-file button[aria-label='Clear']")
    page.set_input_files("#vkv-cmp-file input[type=file]", str(path))
    page.wait_for_selector("#vkv-cmp-file a[download='compare.png']", timeout=base.TURN_TIMEOUT_MS)
    page.locator("#vkv-cmp-q textarea, #vkv-cmp-q input").first.fill("Which colour dominates?")
    page.click("#vkv-cmp-run")
    page.wait_for_function(
        "() => /^(done|⚠)/.test(document.querySelector('#vkv-cmp-status').innerText)", timeout=base.TURN_TIMEOUT_MS
    )
    assert page.inner_text("#vkv-cmp-status").startswith("done"), page.inner_text("#vkv-cmp-status")
    page.evaluate("() => window.scrollTo(0, 0)")
    page.locator("#vkv-cmp-plot .js-plotly-plot").first.wait_for(timeout=30_000)
    assert in_view(page, "#vkv-cmp-table"), (page.locator("#vkv-cmp-table").first.bounding_box(), page.viewport_size)
    # every row in view, not only the first: each answer takes one line (a random model's answers are long)
    rows = page.locator("#vkv-cmp-table .body-cell:first-child")
    ticked = page.locator("#vkv-cmp-methods input[type=checkbox]:checked").count()
    assert rows.count() == ticked >= 4, (rows.count(), ticked)
    table = page.locator("#vkv-cmp-table").first.bounding_box()
    for k in range(rows.count()):
        cell = rows.nth(k).bounding_box()
        inside = table["y"] <= cell["y"] and cell["y"] + cell["height"] <= table["y"] + table["height"]
        assert inside and in_view(page, f"#vkv-cmp-table .body-cell:first-child >> nth={k}"), (k, cell, table)
    chart = page.locator("#vkv-cmp-plot").first.bounding_box()
    shown = 250 if page.viewport_size["height"] >= 900 else 60
    assert chart["y"] + min(chart["height"], shown) <= page.viewport_size["height"], (chart, page.viewport_size)
    base.shot(page, f"fm_compare_{page.viewport_size['width']}")
    # the whole answer on demand: a click on a row shows its method and answer under the table
    assert "click a row" in page.inner_text("#vkv-cmp-status")
    answer_cell = page.locator("#vkv-cmp-table .body-cell:last-child").nth(1)
    whole = answer_cell.evaluate("e => e.textContent")
    assert answer_cell.evaluate("e => e.querySelector('.wrap').scrollWidth > e.querySelector('.wrap').clientWidth")
    answer_cell.click()
    method = rows.nth(1).inner_text().strip()
    page.wait_for_function(
        "(m) => document.querySelector('#vkv-cmp-answer').innerText.startsWith(m + ':')", arg=method, timeout=10_000
    )
    shown_answer = page.inner_text("#vkv-cmp-answer").split(":", 1)[1]
    assert re.sub(r"\W", "", shown_answer) == re.sub(r"\W", "", whole), (shown_answer, whole)
    base.open_tab(page, "Kept tokens")


def test_the_merges_charts_tick_labels_are_whole(page, tmp_path):
    """LightKV's tokens-per-layer chart: every tick label and axis title lies inside the chart and clear of the
    app's label over its corner (an element screenshot of it goes to artifacts/)."""
    base.new_chat(page)
    base.choose(page, "#vkv-method", "lightkv")
    base.send(page, "Which colour dominates?", base.small_png(tmp_path / "merge.png", 448, 336, seed=5))
    base.open_tab(page, "Merges")
    page.locator("#vkv-layer-tokens .js-plotly-plot .xtick text").first.wait_for(timeout=60_000)
    page.locator("#vkv-layer-tokens").first.scroll_into_view_if_needed()
    texts = page.evaluate(TEXTS_JS, "#vkv-layer-tokens")
    assert len([t for t in texts if t["kind"] == "tick"]) >= 5, texts  # x, y and y2 ticks were found
    cut = [t for t in texts if not t["inside"] or t["under_label"]]
    assert not cut, cut
    page.locator("#vkv-layer-tokens").first.screenshot(
        path=str(base.ARTIFACTS / f"fm_merges_{page.viewport_size['width']}.png")
    )
    base.choose(page, "#vkv-method", "blockwise-snapkv")


TEXTS_JS = """(elem) => {
    // each tick label and axis title of the Plotly chart in `elem`: wholly inside the chart's drawing, and not
    // under the app's label floating over its top left corner
    const root = document.querySelector(elem);
    const chart = root.querySelector('.main-svg').getBoundingClientRect();
    const label = root.querySelector('[data-testid="block-label"]');
    const over = label ? label.getBoundingClientRect() : null;
    const found = [];
    for (const [kind, sel] of [['tick', '.xtick text, .ytick text, .y2tick text'],
                               ['title', '.g-xtitle text, .g-ytitle text, .g-y2title text']]) {
        root.querySelectorAll(sel).forEach(e => {
            const r = e.getBoundingClientRect();
            if (r.width === 0) return;
            const inside = r.left >= chart.left - 0.5 && r.right <= chart.right + 0.5
                && r.top >= chart.top - 0.5 && r.bottom <= chart.bottom + 0.5;
            const under = !!over && r.left < over.right && r.right > over.left && r.top < over.bottom
                && r.bottom > over.top;
            found.push({kind, text: e.textContent, inside, under_label: under});
        });
    }
    return found;
}"""
