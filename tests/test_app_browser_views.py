"""The app in a real browser, the video views and the small things a new user trips over.

One app process for this module (the fixtures and helpers of tests/test_app_browser.py), one page in file order:
the example videos play in the chat; a Sali-Cache video turn whose views leave every frame and caption in sight,
with legends a person can read; the lines under the chat (a labelled "done" line, plain-word notes, one submit
control, a Stop whose last word is the final line); the kept-token note per layer, opacity applied as typed, and
an example card clicked on a started chat. Screenshots go to artifacts/.
"""

from __future__ import annotations

import re

import pytest

from tests import test_app_browser as base
from tests.test_app_browser import (
    ERROR_JS,
    REPO,
    TURN_TIMEOUT_MS,
    attach,
    choose,
    dropdown_options,
    new_chat,
    open_accordion,
    open_tab,
    send,
    set_number,
    shot,
    slider_sources,
    watch,
    watched,
)

# the fixtures of tests/test_app_browser.py (module scope: this module gets an app process of its own)
app_url, browser, page = base.app_url, base.browser, base.page

pytestmark = pytest.mark.browser

EXAMPLE_VIDEO = REPO / "assets" / "example_video.webm"
NEEDLE_VIDEO = REPO / "assets" / "visualkv-demo" / "example_needle_video.webm"

PLAYS_JS = """async (v) => {
    // the chat's player: its length is known and the picture moves once it plays (a browser that cannot decode
    // the codec reports a NaN duration, an error, and a time that stays at 0)
    v.muted = true;
    const settled = (events, ms) => new Promise(done => {
        const timer = setTimeout(done, ms);
        for (const e of events) v.addEventListener(e, () => { clearTimeout(timer); done(); }, {once: true});
    });
    if (v.readyState < 1 && !v.error) await settled(['loadedmetadata', 'error'], 15000);
    const duration = v.duration;
    try { await v.play(); } catch (e) { return {duration, error: String(e), start: 0, later: 0}; }
    const start = v.currentTime;
    await new Promise(done => setTimeout(done, 1500));
    return {duration, start, later: v.currentTime, error: v.error ? v.error.code : null};
}"""

CONTENT_BOX_JS = """(img) => {
    // where an <img> with object-fit: contain really draws its picture (the rest of its box is empty)
    const r = img.getBoundingClientRect();
    const scale = Math.min(r.width / img.naturalWidth, r.height / img.naturalHeight);
    const w = img.naturalWidth * scale, h = img.naturalHeight * scale;
    const fit = getComputedStyle(img).objectFit;
    if (fit !== 'contain' && fit !== 'scale-down') return {left: r.left, top: r.top, right: r.right, bottom: r.bottom};
    const left = r.left + (r.width - w) / 2, top = r.top + (r.height - h) / 2;
    return {left, top, right: left + w, bottom: top + h};
}"""


HOLD_ANSWERS_JS = """() => {
    const fetch = window.fetch;
    window.__vkvHeld = {fetch, answered: 0};
    window.fetch = async (...args) => {
        const response = await fetch(...args);
        const url = String((args[0] && args[0].url) || args[0]);
        if (url.includes('/run/')) {
            await new Promise(done => setTimeout(done, 4000));
            window.__vkvHeld.answered += 1;
        }
        return response;
    };
}"""


def _overlap(a: dict, b: dict) -> bool:
    width = min(a["right"], b["right"]) - max(a["left"], b["left"])
    height = min(a["bottom"], b["bottom"]) - max(a["top"], b["top"])
    return width > 1 and height > 1


def _box(pg, selector: str) -> dict | None:
    return pg.evaluate(
        "(s) => { const e = document.querySelector(s); if (!e) return null; const r = e.getBoundingClientRect();"
        " return r.width && r.height ? {left: r.left, top: r.top, right: r.right, bottom: r.bottom} : null; }",
        selector,
    )


def _progress(pg) -> str:
    return pg.inner_text("#vkv-progress").strip()


# -- before any chat -------------------------------------------------------------------------------------


def test_before_a_chat_no_follow_up_note_and_one_submit_control(page):
    """The follow-up note means nothing before a chat exists; the input has one way to send (the Send button,
    or Enter), not a second arrow inside the box."""
    assert page.inner_text("#vkv-followup").strip() == ""
    assert page.locator("#vkv-input button.submit-button").count() == 0
    assert page.locator("#vkv-send").is_visible()
    # the prefill plans and the follow-up modes say what they do, not only their code names
    open_accordion(page, "Generation and follow-ups", "#vkv-max-new")
    plans = dropdown_options(page, "#vkv-prefill")
    assert plans and "bulk" not in plans and any("(bulk)" in p for p in plans), plans
    assert "reprefill" not in page.inner_text("#vkv-settings")


# -- videos play -------------------------------------------------------------------------------------------


# the example cards' videos and the generic one, which comes last: the video views below read its turn
BUNDLED_VIDEOS = sorted((REPO / "assets").rglob("*.webm"), key=lambda v: (v == EXAMPLE_VIDEO, str(v)))


@pytest.mark.parametrize("video", BUNDLED_VIDEOS, ids=[v.stem for v in BUNDLED_VIDEOS])
def test_example_videos_play_in_the_chat(page, video):
    """Every bundled video plays in the chat: a finite length, and its time moves after play()."""
    assert len(BUNDLED_VIDEOS) >= 3 and EXAMPLE_VIDEO in BUNDLED_VIDEOS and NEEDLE_VIDEO in BUNDLED_VIDEOS
    new_chat(page)
    choose(page, "#vkv-method", "salicache")
    open_accordion(page, "Video sampling", "#vkv-fps")
    set_number(page, "#vkv-fps", 0.5)
    set_number(page, "#vkv-max-frames", 32)
    send(page, "What moves in this video?", video)
    player = page.locator("#vkv-chat video").last
    player.wait_for(timeout=30_000)
    played = page.evaluate(PLAYS_JS, player.element_handle())
    assert played["duration"] and played["duration"] > 0 and played["duration"] != float("inf"), played
    assert played["later"] > played["start"], played
    assert played.get("error") is None, played


# -- the video views (the example video's Sali-Cache turn above) ----------------------------------------------


def test_before_after_label_and_toolbar_leave_the_frames_uncovered(page):
    open_tab(page, "Kept tokens")
    page.locator("#vkv-heatmap img").nth(1).wait_for(timeout=60_000)
    page.wait_for_function("() => document.querySelector('#vkv-heatmap img').naturalWidth > 0", timeout=30_000)
    picture = page.evaluate(CONTENT_BOX_JS, page.locator("#vkv-heatmap img").first.element_handle())
    label = _box(page, '#vkv-heatmap [data-testid="block-label"]')
    toolbar = _box(page, "#vkv-heatmap .icon-button-wrapper")
    assert label and toolbar, (label, toolbar)
    assert not _overlap(picture, label), (picture, label)
    assert not _overlap(picture, toolbar), (picture, toolbar)
    shot(page, "v01_kept_tokens_video")


def test_saliency_legends_are_readable_and_captions_whole(page):
    open_tab(page, "Saliency")
    page.locator("#vkv-tiers img").first.wait_for(timeout=60_000)
    for legend, words in (("#vkv-saliency-legend", "saliency"), ("#vkv-tier-legend", "INT8")):
        box = page.locator(f"{legend} .vkv-legend")
        assert box.count() == 1 and words in box.inner_text(), legend
        sizes = box.evaluate(
            "e => Array.from(e.querySelectorAll('*')).concat([e]).filter(x => x.innerText)"
            ".map(x => parseFloat(getComputedStyle(x).fontSize))"
        )
        assert min(sizes) >= 11, (legend, sizes)
    _assert_captions_whole(page, "#vkv-saliency", "mean saliency")
    _assert_captions_whole(page, "#vkv-tiers", "FP16")
    shot(page, "v02_saliency")


def _assert_captions_whole(pg, gallery: str, must_contain: str) -> None:
    """Every caption of the gallery is shown whole (no "…", not clipped) at a readable size."""
    captions = pg.locator(f"{gallery} .caption-label")
    assert captions.count() >= 2, gallery
    found = captions.evaluate_all(
        "els => els.map(e => [e.innerText, e.scrollWidth <= e.clientWidth + 1, parseFloat(getComputedStyle(e).fontSize)])"
    )
    assert any(must_contain in text for text, _, _ in found), found
    assert all(whole and "…" not in text and size >= 11 for text, whole, size in found), found


def test_frames_tab_numbers_add_up_and_the_memory_chart_reads_plainly(page):
    open_tab(page, "Frames")
    page.wait_for_selector("#vkv-timeline .js-plotly-plot", timeout=60_000)
    title = page.locator("#vkv-timeline .gtitle").text_content()
    said = re.search(r"(\d+) frames sampled: (\d+) skipped as nearly unchanged, (\d+) kept", title)
    assert said, title
    sampled, skipped, kept = map(int, said.groups())
    assert sampled == skipped + kept and skipped > 0, title
    read = re.search(r"the vision encoder read the (\d+) kept frames as (\d+) inputs of (\d+) frames", title)
    assert read and int(read[1]) == kept and int(read[2]) * int(read[3]) == kept, title
    page.locator("#vkv-thumbs img").first.wait_for(timeout=60_000)
    _assert_captions_whole(page, "#vkv-thumbs", "kept")
    # the memory chart: the video's progress line clear of Plotly's toolbar (shown while the pointer is on it)
    open_tab(page, "Memory")
    page.hover("#vkv-memory .js-plotly-plot")
    page.wait_for_selector("#vkv-memory .modebar", timeout=10_000)
    line = page.locator("#vkv-memory .annotation", has_text="of 1:04 read")
    assert line.count() == 1
    line_box = line.evaluate(
        "e => { const r = e.getBoundingClientRect(); "
        "return {left: r.left, top: r.top, right: r.right, bottom: r.bottom}; }"
    )
    toolbar = _box(page, "#vkv-memory .modebar")
    assert toolbar and not _overlap(line_box, toolbar), (line_box, toolbar)
    # the log axis: plain numbers that grow upwards
    ticks = page.locator("#vkv-memory .y2tick text").evaluate_all(
        "els => els.map(e => [e.getBoundingClientRect().top, e.textContent])"
    )
    labels = [text for _, text in sorted(ticks, reverse=True)]  # bottom to top
    assert len(labels) >= 2 and all(re.fullmatch(r"[\d,]+(\.\d+)?", t) for t in labels), labels
    values = [float(t.replace(",", "")) for t in labels]
    assert values == sorted(values) and len(set(values)) == len(values), labels
    shot(page, "v03_frames")


# -- the lines under the chat ---------------------------------------------------------------------------------


def test_done_line_labels_every_value_and_the_follow_up_note_is_plain(page):
    done = _progress(page)
    assert re.fullmatch(
        r"done · time to first token \(TTFT\) \d+\.\d\d s · answer: \d+ tokens?"
        r"( at \d+\.\d tokens/s.*| \(too short to time\)) · KV cache \d+\.\d\d MiB.*",
        done,
    ), done
    assert "n/a" not in done
    note = page.inner_text("#vkv-followup")
    assert note.strip() and not re.search(r"query-|reprefill|agnostic", note), note


def test_kept_tokens_note_names_the_layer_and_a_typed_opacity_applies_at_once(page):
    open_tab(page, "Kept tokens")
    assert "on average over all layers" in page.inner_text("#vkv-heat-note")
    choose(page, "#vkv-layer", "layer 0")
    page.wait_for_function(
        "() => document.querySelector('#vkv-heat-note').innerText.includes('in layer 0')", timeout=60_000
    )
    assert "average" not in page.inner_text("#vkv-heat-note")
    page.wait_for_function(
        "() => { const i = document.querySelectorAll('#vkv-heatmap img'); return i.length === 2 && i[1].src; }"
    )
    shown = slider_sources(page)[1]
    box = page.locator("#vkv-opacity input[type=number]").first
    box.click()
    box.press("Control+a")
    box.press_sequentially("0.15", delay=50)  # typed, still focused: no blur, no Enter
    page.wait_for_function(
        "(a) => Array.from(document.querySelectorAll('#vkv-heatmap img'))[1].src !== a", arg=shown, timeout=30_000
    )
    assert page.evaluate("() => document.activeElement.type") == "number"  # applied while the box has focus
    box.blur()
    choose(page, "#vkv-layer", "average")


def test_a_card_on_a_started_chat_starts_a_new_chat_and_says_so(page):
    assert page.locator('#vkv-chat [data-testid="bot"]').count() >= 1  # the video chat above
    card = page.locator("#vkv-examples .thumbnail-item").first
    card.scroll_into_view_if_needed()
    card.click()
    page.wait_for_function(
        "() => document.querySelectorAll('#vkv-chat [data-testid=\"bot\"]').length === 0", timeout=10_000
    )
    page.wait_for_selector("#vkv-input .thumbnail-item", timeout=30_000)
    assert page.input_value("#vkv-input textarea").strip()  # the example's question
    assert "New chat started for this example" in _progress(page)
    new_chat(page)


def test_stop_leaves_the_final_line_and_only_words(page):
    """Stop during a prefill: its server answer is held back until the turn has ended (as a loaded network
    does); the last line must still be the turn's own, with no "stopping…" left under "Stopped", and no symbol
    a font may lack (U+23F9, U+23F1)."""
    # the example video's 256 frames block by block: a prefill of several seconds on this model
    choose(page, "#vkv-method", "blockwise-snapkv")
    open_accordion(page, "Video sampling", "#vkv-fps")
    set_number(page, "#vkv-fps", 4)
    set_number(page, "#vkv-max-frames", 256)
    attach(page, EXAMPLE_VIDEO)
    page.fill("#vkv-input textarea", "What moves in this video?")
    watch(page)
    page.click("#vkv-send")
    page.wait_for_function(
        "() => /prefill block \\d+\\/\\d+ \\(video frames,/.test(document.querySelector('#vkv-progress').innerText)",
        timeout=TURN_TIMEOUT_MS,
    )
    # from now on the page reads the answers of its direct (unqueued) calls, Stop's among them, 4 s late: the
    # server has handled the call at once, but its answer reaches the page after the turn's own last line
    page.evaluate(HOLD_ANSWERS_JS)
    page.click("#vkv-stop")
    # the prefill stopped ("Stopped while reading…"), or on a loaded machine the Stop reached the answer ("done ·
    # … · stopped"): either way the turn's own last line must stay
    ended = (
        f"() => {ERROR_JS}.includes('Stopped') || document.querySelector('#vkv-progress').innerText.startsWith('done')"
    )
    page.wait_for_function(ended, timeout=TURN_TIMEOUT_MS)
    page.wait_for_function("() => window.__vkvHeld.answered > 0", timeout=30_000)  # the held answer came
    page.wait_for_timeout(500)
    page.evaluate("() => { window.fetch = window.__vkvHeld.fetch; }")
    seen = watched(page)
    # what a block holds in words ("video frames"), not the engine's code names (bulk, rows, tile, frame)
    blocks = [p for p in seen["progress"] if p.startswith("prefill block")]
    assert blocks and any("(video frames," in p for p in blocks), blocks
    assert not any(re.search(r"\((bulk|rows|tile|frame), ", p) for p in blocks), blocks
    assert "stopping" not in _progress(page), (_progress(page), seen["progress"])
    text = page.inner_text("body")
    assert "⏹" not in text and "⏱" not in text
    shot(page, "v04_stopped")
    if page.locator("#vkv-input .delete-button").count():  # the stopped turn's file, back in the box
        page.locator("#vkv-input .delete-button").first.click()
    set_number(page, "#vkv-fps", 1)
    set_number(page, "#vkv-max-frames", 32)


def test_method_help_speaks_plainly(page):
    choose(page, "#vkv-method", "lightkv")
    page.wait_for_function("() => document.querySelector('#vkv-method-help').innerText.includes('lightkv')")
    assert "λ" not in page.inner_text("#vkv-method-help")
    choose(page, "#vkv-method", "blockwise-snapkv")
