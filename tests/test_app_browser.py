"""The app in a real browser: `python app.py` on an offline model, driven by Playwright + Debian's Chromium.

One app process serves every test of this module (in file order), in a 1440x900 window: a 4K image chat
with a live memory chart, the result in view (summary and before/after kept-token slider), a follow-up
turn, the bad files and bad control values a new user tries, Stop during a prefill, a video with the
frame timeline, Compare (and its Stop), LightKV's merge map, a text-only question, Load model, two users at once (with the queue
message), and Stop while a turn waits in the queue. Screenshots go to artifacts/; docs/screenshot.png comes from tests/test_app_browser_cards.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import time
import zlib
from pathlib import Path

import pytest

from tests.app_process import app_process

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parent.parent
ARTIFACTS = REPO / "artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
MODEL = "tiny-qwen2.5-vl"
TURN_TIMEOUT_MS = 120_000
VIEWPORT = {"width": 1440, "height": 900}
APP_LOG: list[Path] = []  # the server log of this module's app, for "no traceback" checks

if not Path(CHROMIUM).exists():
    pytest.skip(
        f"{CHROMIUM} is missing (install Debian's chromium package to run the browser test)", allow_module_level=True
    )

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (pip) is needed for the browser test")


# -- fixtures ------------------------------------------------------------------------------------


def run_app(tmp_path_factory, args: list[str]):
    """Generator: `app.py` with `args` on a free port; yields its URL, then stops it and keeps its log."""
    tmp = tmp_path_factory.mktemp("app")
    APP_LOG[:] = [tmp / "app.log"]
    with app_process(args, tmp) as (url, _, log_path):
        yield url
    shutil.copy(log_path, ARTIFACTS / "app.log")


@pytest.fixture(scope="module")
def app_url(tmp_path_factory):
    yield from run_app(tmp_path_factory, ["--model", MODEL])


@pytest.fixture(scope="module")
def browser():
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def page(browser, app_url):
    """The main user's page, shared by the tests in order."""
    context = browser.new_context(viewport=VIEWPORT, accept_downloads=True)
    pg = context.new_page()
    open_app(pg, app_url)
    yield pg
    context.close()


# -- helpers ---------------------------------------------------------------------------------------


def open_app(pg, url: str) -> None:
    pg.goto(url)
    pg.wait_for_selector("#vkv-input textarea", timeout=60_000)
    set_number(pg, "#vkv-budget", 256)
    pg.click("text=Generation and follow-ups")
    set_number(pg, "#vkv-max-new", 32)


def set_number(pg, elem: str, value) -> None:
    box = pg.locator(f"{elem} input[type=number]").first
    box.fill(str(value))
    box.press("Tab")


def open_accordion(pg, label: str, control: str) -> None:
    """Open the accordion `label` unless its `control` already shows: a click on an open one would close it, and
    a test run alone (`-k`) finds it closed where the full run left it open."""
    field = pg.locator(f"{control} input").first
    if not field.is_visible():
        pg.click(f"text={label}")
        field.wait_for(state="visible", timeout=10_000)


def dropdown_options(pg, elem: str) -> list[str]:
    pg.click(f"{elem} input")
    options = pg.locator('[data-testid="dropdown-option"]').evaluate_all(
        "els => els.map(e => e.getAttribute('aria-label'))"
    )
    pg.keyboard.press("Escape")
    # Escape closes the list but leaves the box focused, and only a focus event opens it again: a click on a
    # focused box does nothing. Leave it unfocused for the next `choose`.
    pg.locator(f"{elem} input").blur()
    return options


def choose(pg, elem: str, value: str) -> None:
    """Pick `value` in a gr.Dropdown through its option, and make sure it was picked.

    Typing the value and pressing Enter is a race: the box shows the typed text at once, but Enter takes the
    list's active option, which is still the previous value until Gradio has filtered the list (on a busy page
    it had not: a turn then ran with the previous method). Only after the box loses focus does it show the value
    really chosen."""
    box = pg.locator(f"{elem} input")
    option = pg.locator(f'{elem} li[data-testid="dropdown-option"][aria-label="{value}"]')
    for _ in range(3):
        try:
            # the list opens on focus only (a click on a box already focused, e.g. after Escape, leaves it shut)
            box.blur()
            box.click()
            # the option takes the pick on mousedown; a real click waits for the open list to hold still, which
            # it may not while the page scrolls it into view
            option.dispatch_event("mousedown", timeout=5_000)
            box.blur()
            pg.wait_for_function(
                "([e, v]) => document.querySelector(e + ' input').value === v", arg=[elem, value], timeout=5_000
            )
            return
        except sync_api.TimeoutError:
            continue
    raise AssertionError(f"{elem}: could not pick {value!r} (it shows {box.input_value()!r})")


def bot_messages(pg) -> list[str]:
    return pg.locator('#vkv-chat [data-testid="bot"]').all_inner_texts()


def user_messages(pg) -> list[str]:
    """Texts the user sent (an attached file is a separate, textless message element)."""
    return [t for t in pg.locator('#vkv-chat [data-testid="user"]').all_inner_texts() if t.strip()]


ERROR_JS = "(document.querySelector('#vkv-error [data-testid=\"markdown\"]') || {innerText: ''}).innerText.trim()"


def error_text(pg) -> str:
    """The app's error line (its Markdown text, without Gradio's status tracker)."""
    return pg.evaluate(f"() => {ERROR_JS}")


def attach(pg, path) -> None:
    pg.set_input_files("#vkv-input input[type=file]", str(path))
    pg.wait_for_selector("#vkv-input .thumbnail-item", timeout=60_000)


def send(pg, question: str, path=None, expect_error: bool = False) -> None:
    """Ask one question (optionally with a file) and wait until the turn is done or an error shows."""
    n_before = len(bot_messages(pg))
    stale = error_text(pg)
    toasts_before = pg.locator(".toast-body").count()
    if path is not None:
        attach(pg, path)
    pg.fill("#vkv-input textarea", question)
    pg.click("#vkv-send")
    if expect_error:
        pg.wait_for_function(
            f"(stale) => {{ const t = {ERROR_JS}; return t && t !== stale; }}", arg=stale, timeout=TURN_TIMEOUT_MS
        )
        return
    # done, a new error line or a Gradio error toast (a send refused before the turn ran): a turn that fails
    # says why at once instead of running into the time limit
    pg.wait_for_function(
        f"([n, stale, toasts]) => (document.querySelectorAll('#vkv-chat [data-testid=\"bot\"]').length === n + 1 && "
        f"document.querySelector('#vkv-progress').innerText.startsWith('done')) || "
        f"(({ERROR_JS}) && ({ERROR_JS}) !== stale) || document.querySelectorAll('.toast-body').length > toasts",
        arg=[n_before, stale, toasts_before],
        timeout=TURN_TIMEOUT_MS,
    )
    toasts = pg.locator(".toast-body").all_inner_texts()
    assert len(toasts) <= toasts_before, toasts
    assert not error_text(pg), error_text(pg)


WATCH_JS = """() => {
    window.__vkv = {points: [], answers: [], progress: []};
    if (window.__vkvObserver) window.__vkvObserver.disconnect();
    const record = () => {
        const plot = document.querySelector('#vkv-memory .js-plotly-plot');
        const held = plot && plot.data ? plot.data.find(t => t.name === 'KV cache (held)') : null;
        if (held) window.__vkv.points.push(held.x.length);
        const bots = document.querySelectorAll('#vkv-chat [data-testid="bot"]');
        if (bots.length) window.__vkv.answers.push(bots[bots.length - 1].innerText.length);
        const progress = document.querySelector('#vkv-progress');
        const said = progress ? progress.innerText.trim() : '';
        const last = window.__vkv.progress[window.__vkv.progress.length - 1];
        if (said && said !== last) window.__vkv.progress.push(said);
    };
    window.__vkvObserver = new MutationObserver(record);
    window.__vkvObserver.observe(document.body, {childList: true, subtree: true, characterData: true});
}"""


def watch(pg) -> None:
    """Record the memory chart's point count and the last answer's length after every DOM change
    (a MutationObserver, not a timer: a fast decode can stream its pieces between two timer ticks)."""
    pg.evaluate(WATCH_JS)


def watched(pg) -> dict[str, list]:
    return pg.evaluate("() => { window.__vkvObserver.disconnect(); return window.__vkv; }")


def plot_traces(pg, elem: str) -> dict[str, int]:
    """{trace name: number of points} of the Plotly chart inside `elem`, read from the DOM."""
    data = pg.evaluate(
        "(e) => Array.from(document.querySelectorAll(e + ' .js-plotly-plot'))"
        ".map(p => (p.data || []).map(t => [t.name, (t.x || []).length]))",
        elem,
    )
    assert data, f"no Plotly chart in {elem}"
    return dict(data[-1])


OVERLAP_JS = """(elem) => {
    // the chart's own texts (title, axis titles, annotations, legend) and the app's label over its corner
    const root = document.querySelector(elem);
    if (!root) return ['no ' + elem];
    const parts = [['label', root.querySelector('[data-testid="block-label"]')]];
    for (const sel of ['.gtitle', '.g-xtitle', '.g-x2title', '.g-ytitle', '.annotation', '.legend']) {
        root.querySelectorAll(sel).forEach((e, i) => parts.push([sel + i + ' ' + e.textContent.slice(0, 40), e]));
    }
    const boxes = parts.filter(([, e]) => e).map(([name, e]) => [name, e.getBoundingClientRect()])
        .filter(([, r]) => r.width > 0 && r.height > 0);
    const overlaps = [];
    for (let i = 0; i < boxes.length; i++) for (let j = i + 1; j < boxes.length; j++) {
        const [a, r] = boxes[i], [b, q] = boxes[j];
        const w = Math.min(r.right, q.right) - Math.max(r.left, q.left);
        const h = Math.min(r.bottom, q.bottom) - Math.max(r.top, q.top);
        if (w > 2 && h > 2) overlaps.push(a + ' / ' + b);
    }
    return overlaps;
}"""


def overlapping_texts(pg, elem: str) -> list[str]:
    """Pairs of texts that overlap in the Plotly chart inside `elem` (its title, axis titles, annotations,
    legend, and the app's label floating over the chart's top left corner): [] when all are legible."""
    return pg.evaluate(OVERLAP_JS, elem)


def new_chat(pg) -> None:
    """Click New chat and wait until the chat is empty."""
    pg.click("#vkv-new")
    pg.wait_for_function("() => document.querySelectorAll('#vkv-chat [data-testid=\"bot\"]').length === 0")


def open_tab(pg, name: str) -> None:
    pg.click(f"button[role=tab]:has-text('{name}')")


def numbers_panel(pg, must_contain: str) -> str:
    """Text of the Numbers tab once it shows `must_contain` (the views of the last turn render in a
    follow-up event; tabs render their content only while open). Leaves that tab open."""
    open_tab(pg, "Numbers")
    pg.wait_for_function(
        "(t) => { const e = document.querySelector('#vkv-numbers'); return e && e.innerText.includes(t); }",
        arg=must_contain,
        timeout=60_000,
    )
    return pg.inner_text("#vkv-numbers")


def in_viewport(pg, elem: str) -> bool:
    """Whether the element's bounding box lies wholly inside the window (as scrolled now)."""
    box = pg.locator(elem).first.bounding_box()
    return (
        box is not None
        and box["height"] > 0
        and box["y"] >= 0
        and box["x"] >= 0
        and box["y"] + box["height"] <= VIEWPORT["height"]
        and box["x"] + box["width"] <= VIEWPORT["width"]
    )


def server_log() -> str:
    return APP_LOG[0].read_text() if APP_LOG else ""


def slider_sources(pg) -> list[str]:
    """The two images of the before/after slider (left: the media, right: the keep map)."""
    return pg.locator("#vkv-heatmap img").evaluate_all("els => els.map(e => e.src)")


def shot(pg, name: str) -> None:
    pg.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def small_png(path: Path, width: int, height: int, seed: int) -> Path:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(path)
    return path


def png_header_only(path: Path, width: int, height: int) -> Path:
    """A PNG whose header claims width x height with almost no data (a cheap oversized image)."""

    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    )
    return path


# -- tests -------------------------------------------------------------------------------------------


def test_offline_start_is_said_on_the_page(page):
    note = page.inner_text("#vkv-model-note")
    assert "offline" in note and MODEL in note
    # the demo scenes lead the examples, and the panel says what the demo model can answer
    from visualkv.bench.demo_examples import load_demo_examples

    first = load_demo_examples()[0].featured()[0].question
    assert page.locator(f"button:has-text('{first}')").count() >= 1
    assert "What visualkv-demo can answer" in page.inner_text("#vkv-demo-help")
    # the example cards say what each file is
    assert page.locator("button:has-text('4K image 3840×2160')").count() >= 1
    assert page.locator("button:has-text('video')").count() >= 1


def test_example_cards_show_thumbnails_and_a_click_loads_the_video(page):
    """Every example card is a picture (a video's poster frame), and clicking a video card attaches the video."""
    cards = page.locator("#vkv-examples .thumbnail-item")
    cards.first.wait_for(timeout=30_000)
    n = cards.count()
    assert n >= 2 and page.locator("#vkv-examples .thumbnail-item img").count() == n  # an <img> on every card
    video_card = page.locator("#vkv-examples .thumbnail-item:has-text('video 16 s')").first
    img = video_card.locator("img")
    img.scroll_into_view_if_needed()
    page.wait_for_function("(e) => e.complete && e.naturalWidth > 0", arg=img.element_handle(), timeout=30_000)
    assert page.evaluate("(e) => e.naturalWidth", img.element_handle()) >= 160  # a real picture, not an icon
    video_card.click()
    page.wait_for_selector("#vkv-input .thumbnail-item", timeout=30_000)
    assert page.input_value("#vkv-input textarea") == "When did the star appear?"
    assert page.locator("#vkv-input .thumbnail-item .feather-video").count() == 1  # the video is attached
    page.click("#vkv-new")  # leave the input empty for the next test
    page.wait_for_function("() => document.querySelectorAll('#vkv-input .thumbnail-item').length === 0", timeout=10_000)


def test_image_chat_live_memory_and_heatmap(page):
    watch(page)
    send(page, "Where is the small red star?", REPO / "assets" / "example_4k.png")
    seen = watched(page)
    answers = bot_messages(page)
    assert len(answers) == 1 and answers[0].strip()
    open_tab(page, "Memory")  # the page opened it while the image was read, and Kept tokens after
    page.locator("#vkv-memory .js-plotly-plot").first.wait_for(timeout=30_000)
    traces = plot_traces(page, "#vkv-memory")
    n_blocks = traces["KV cache (held)"]
    assert n_blocks > 2, traces  # a 4K image under budget 256 is prefilled block by block
    # the chart grew block by block while the prefill ran, and the answer arrived in pieces
    assert len({n for n in seen["points"] if 0 < n < n_blocks}) >= 2, seen["points"]
    assert len({n for n in seen["answers"] if n > 0}) >= 2, seen["answers"]
    assert traces["budget"] == 2 and traces["full cache"] == 2, traces
    assert traces["process RSS"] == n_blocks
    assert overlapping_texts(page, "#vkv-memory") == []
    progress = page.inner_text("#vkv-progress")
    assert progress.startswith("done") and "TTFT" in progress
    # while blocks arrived, the progress said how long the rest of the prefill should take
    assert any("s left" in said for said in seen["progress"] if said.startswith("prefill block")), seen["progress"]
    numbers = numbers_panel(page, "blockwise-snapkv")
    assert "peak KV" in numbers and "visual tokens" in numbers
    open_tab(page, "Kept tokens")
    heat = page.locator("#vkv-heatmap img").first
    heat.wait_for(timeout=60_000)
    width, height = page.evaluate("(img) => [img.naturalWidth, img.naturalHeight]", heat.element_handle())
    assert 0 < width <= 960 and 0 < height <= 960  # 3840x2160 downscaled for display
    shot(page, "01_image_chat")


def test_result_in_view_at_1440x900(page):
    """After a turn, the chat, the one-line summary and the kept-token view fit in the window unscrolled."""
    open_tab(page, "Kept tokens")
    page.evaluate("() => window.scrollTo(0, 0)")
    page.locator("#vkv-heatmap img").nth(1).wait_for(timeout=60_000)
    summary = page.inner_text("#vkv-summary")
    assert "visual tokens" in summary and "vs full" in summary and "× less" in summary and "TTFT" in summary
    for elem in ("#vkv-chat", "#vkv-summary", "#vkv-heatmap", "#vkv-input"):
        assert in_viewport(page, elem), (elem, page.locator(elem).first.bounding_box())
    shot(page, "01b_result_in_view")


def test_before_after_slider_with_opacity_and_layers(page):
    open_tab(page, "Kept tokens")
    before, after = slider_sources(page)
    assert before != after  # the media alone, and the media under the keep map
    page.locator("#vkv-opacity input[type=number]").first.fill("0.2")
    page.locator("#vkv-opacity input[type=number]").first.press("Enter")
    page.locator("#vkv-opacity input[type=range]").first.dispatch_event("pointerup")
    page.wait_for_function(
        "(a) => Array.from(document.querySelectorAll('#vkv-heatmap img'))[1].src !== a", arg=after, timeout=60_000
    )
    faint = slider_sources(page)
    assert faint[0] == before  # opacity changes the keep map side only
    choose(page, "#vkv-layer", "layer 0")
    page.wait_for_function(
        "(a) => Array.from(document.querySelectorAll('#vkv-heatmap img'))[1].src !== a", arg=faint[1], timeout=60_000
    )
    choose(page, "#vkv-layer", "average")
    # an opacity typed outside 0..1 is clamped, not refused with an error badge
    shown = slider_sources(page)[1]
    page.locator("#vkv-opacity input[type=number]").first.fill("5")
    page.locator("#vkv-opacity input[type=number]").first.press("Tab")
    page.wait_for_function(
        "(a) => Array.from(document.querySelectorAll('#vkv-heatmap img'))[1].src !== a", arg=shown, timeout=60_000
    )
    assert page.locator(".toast-body").count() == 0


def test_followup_note_follows_the_method_the_chat_runs(page):
    choose(page, "#vkv-method", "full")
    page.wait_for_function("() => document.querySelector('#vkv-followup').innerText.includes('blockwise-snapkv')")
    note = page.inner_text("#vkv-followup")
    assert "This chat runs blockwise-snapkv" in note and "first" in note, note  # SnapKV's caveat, not full's
    assert page.locator("#vkv-budget input[type=number]").first.is_disabled()
    # a budget the method ignores looks switched off: not the background of an editable field
    colours = page.evaluate(
        "() => ['#vkv-budget', '#vkv-block-size'].map(e => getComputedStyle("
        "document.querySelector(e + ' input[type=number]')).backgroundImage)"
    )
    assert colours[0] != colours[1], colours
    choose(page, "#vkv-method", "blockwise-snapkv")
    page.wait_for_function("() => !document.querySelector('#vkv-followup').innerText.includes('This chat runs')")


def test_followup_turn_and_report_download(page):
    send(page, "And what does the yellow label say?")
    assert len(bot_messages(page)) == 2
    assert len(user_messages(page)) == 2
    with page.expect_download() as dl:
        page.click("#vkv-download")
    report = json.loads(Path(dl.value.path()).read_text())
    assert report["method"] == "blockwise-snapkv" and report["budget"] == 256
    assert [t["prompt"] for t in report["turns"]] == [
        "Where is the small red star?",
        "And what does the yellow label say?",
    ]
    assert report["media"]["width"] == 3840
    assert report["media"]["name"] == "example_4k.png" and "path" not in report["media"]  # no server folder
    headers = page.evaluate(
        "() => { const e = document.querySelector('#vkv-numbers'); return e ? "
        "Array.from(e.querySelectorAll('th')).map(t => t.innerText.trim()) : []; }"
    )
    assert headers and all(headers), headers  # the Numbers table has a real header row
    shot(page, "02_followup")


def test_bad_inputs_show_errors_and_keep_chat_and_model(page, tmp_path):
    history = bot_messages(page)
    model_note = page.inner_text("#vkv-model-note")
    corrupt = tmp_path / "broken.png"
    corrupt.write_bytes(b"\x89PNG\r\n\x1a\n" + os.urandom(300))
    pdf = tmp_path / "paper.pdf"
    pdf.write_bytes(b"%PDF-1.4\n1 0 obj << /Type /Catalog >> endobj\ntrailer << /Root 1 0 R >>\n%%EOF\n")
    huge = png_header_only(tmp_path / "huge.png", 20000, 20000)
    cases = [
        ("empty message", "", None),
        ("corrupt file", "what is this?", corrupt),
        ("PDF", "summarise this", pdf),
        ("oversized image", "what is this?", huge),
    ]
    for label, question, path in cases:
        send(page, question, path, expect_error=True)
        message = error_text(page)
        assert len(message) > 10, (label, message)
        assert "MediaLimits" not in message, message  # a web user cannot raise a library limit
        assert bot_messages(page) == history, label
        assert page.locator("#vkv-error").is_visible(), label  # the one line is on screen
        if path is not None:  # the refused file is cleared from the input; the question stays
            page.wait_for_function(
                "() => document.querySelectorAll('#vkv-input .thumbnail-item').length === 0", timeout=10_000
            )
            assert page.input_value("#vkv-input textarea") == question, label
        shot(page, f"03_error_{label.replace(' ', '_')}")
    page.locator("#vkv-model-id textarea, #vkv-model-id input").first.fill("no-such-org/no-such-model")
    page.click("#vkv-load")
    page.wait_for_function(f"() => {ERROR_JS}.includes('no-such-org')", timeout=60_000)
    assert ".;" not in error_text(page), error_text(page)
    assert page.inner_text("#vkv-model-note") == model_note
    assert bot_messages(page) == history
    shot(page, "03_error_unknown_model")
    page.locator("#vkv-model-id textarea, #vkv-model-id input").first.fill("")
    send(page, "Is the model still there?")  # the chat and its model still work
    assert len(bot_messages(page)) == len(history) + 1


BAD_VALUES = [
    ("#vkv-budget", "-5", "budget"),
    ("#vkv-budget", "", "budget"),
    ("#vkv-keep", "0", "keep %"),
    ("#vkv-keep", "101", "keep %"),
    ("#vkv-max-new", "1e999", "max new tokens"),  # too large for the browser to read: not silently another value
    ("#vkv-block-size", "-3", "block size"),
    ("#vkv-block-size", "", "block size"),
    ("#vkv-max-new", "0", "max new tokens"),
    ("#vkv-max-new", "", "max new tokens"),
    ("#vkv-temperature", "-1", "temperature"),
    ("#vkv-vision-ahead", "0", "blocks per vision-tower call"),
]


def test_every_bad_control_value_is_one_line_and_loses_nothing(page):
    history = bot_messages(page)
    model_note = page.inner_text("#vkv-model-note")
    log_before = server_log()
    for elem, value, name in BAD_VALUES:
        good = page.locator(f"{elem} input[type=number]").first.input_value()
        set_number(page, elem, value)
        send(page, "Is the model still there?", expect_error=True)
        message = error_text(page)
        assert name in message and "\n" not in message, (elem, value, message)
        assert bot_messages(page) == history, (elem, value)  # the chat panel still shows the history
        assert page.locator("#vkv-chat .error, .toast-body").count() == 0, (elem, value)  # no red Error badge
        assert page.inner_text("#vkv-model-note") == model_note
        set_number(page, elem, good)
        page.fill("#vkv-input textarea", "")
    assert "Traceback" not in server_log()[len(log_before) :]
    shot(page, "03_bad_values")


def test_a_refused_file_leaves_the_input_and_the_question_stays(page, tmp_path):
    corrupt = tmp_path / "broken.png"
    corrupt.write_bytes(b"\x89PNG\r\n\x1a\n" + os.urandom(300))
    send(page, "what is this?", corrupt, expect_error=True)
    page.wait_for_function("() => document.querySelectorAll('#vkv-input .thumbnail-item').length === 0", timeout=10_000)
    assert page.input_value("#vkv-input textarea") == "what is this?"
    page.fill("#vkv-input textarea", "")


def stop_a_prefill(page) -> None:
    """Send the 4K question and press Stop as soon as its first prefill block is shown; the page says
    "stopping…" itself at once. On a loaded machine the page can lag the engine by the whole ~3 s prefill (Plotly
    loads while the first block is drawn): the click then lands on the answered turn, which stops nothing. That
    attempt proves nothing about Stop, so it is made again, in a new chat (three attempts at most)."""
    for attempt in range(3):
        new_chat(page)  # a file starts a chat: the earlier tests' (or attempt's) chat would refuse it
        set_number(page, "#vkv-block-size", 256)
        attach(page, REPO / "assets" / "example_4k.png")
        page.fill("#vkv-input textarea", "Where is the small red star?")
        watch(page)
        page.click("#vkv-send")
        page.wait_for_function(
            "() => /prefill block \\d+\\//.test(document.querySelector('#vkv-progress').innerText)",
            timeout=TURN_TIMEOUT_MS,
        )
        page.click("#vkv-stop")
        t_stop = time.monotonic()
        # every progress text the observer saw: a block update already on its way may replace "stopping…" at
        # once on a loaded machine, so polling the current text could miss it. The browser says it itself,
        # without waiting for the server (which a loaded 2-core CI answered too late).
        try:
            page.wait_for_function("() => window.__vkv.progress.some(p => p.includes('stopping'))", timeout=5_000)
        except sync_api.TimeoutError:
            answered = page.inner_text("#vkv-progress").startswith("done") and bot_messages(page)
            if answered and attempt < 2:
                continue  # the turn was over before the click: press Stop earlier, in a new turn
            raise AssertionError(f"Stop did not say 'stopping…': progress seen {watched(page)['progress']}")
        assert time.monotonic() - t_stop < 3  # said at once
        return


def test_stop_during_prefill_stops_it_and_keeps_the_chat(page, tmp_path):
    # the 4K image in blocks of one strip: ~70 blocks, ~3 s on this model, stopped at its first block shown
    stop_a_prefill(page)
    page.wait_for_function(f"() => {ERROR_JS}.includes('Stopped')", timeout=TURN_TIMEOUT_MS)
    seen = watched(page)
    # the block labels ("prefill block k/N …", "stopping… (after block k/N …"), in the order the engine
    # finished the blocks (the chart may not have drawn yet on a loaded machine: Plotly loads lazily)
    blocks = [tuple(map(int, m)) for m in re.findall(r"block (\d+)/(\d+)", "\n".join(seen["progress"]))]
    total = blocks[0][1]
    assert max(done for done, _ in blocks) < total  # the prefill ended early, at a block boundary
    assert bot_messages(page) == [] and max(seen["answers"] or [0]) == 0  # no answer, not even one letter
    assert page.input_value("#vkv-input textarea") == "Where is the small red star?"  # the question is back
    # the chat is usable: ask about a small image instead
    page.locator("#vkv-input .delete-button").first.click()
    set_number(page, "#vkv-block-size", 0)
    send(page, "Which colour dominates?", small_png(tmp_path / "small.png", 448, 336, seed=5))
    assert len(bot_messages(page)) == 1
    # Stop with nothing running changes nothing: the finished turn's line stays
    done_line = page.inner_text("#vkv-progress")
    page.click("#vkv-stop")
    time.sleep(1.0)
    assert page.inner_text("#vkv-progress") == done_line and done_line.startswith("done")
    shot(page, "03_stopped")


def test_video_frame_timeline(page):
    new_chat(page)
    video_method = "salicache" if "salicache" in dropdown_options(page, "#vkv-method") else "blockwise-keydiff"
    choose(page, "#vkv-method", video_method)
    open_accordion(page, "Video sampling", "#vkv-fps")
    set_number(page, "#vkv-fps", 0.25)
    set_number(page, "#vkv-max-frames", 16)
    watch(page)
    send(page, "What moves in this video?", REPO / "assets" / "example_video.webm")
    # while blocks arrived, the progress said how far into the 64 s video the prefill had read
    seen = watched(page)
    assert any(" of 1:04 read" in p for p in seen["progress"] if p.startswith("prefill block")), seen["progress"]
    numbers = numbers_panel(page, "video frames sampled")
    assert video_method in numbers
    open_tab(page, "Frames")
    page.wait_for_selector("#vkv-timeline .js-plotly-plot", timeout=60_000)
    traces = plot_traces(page, "#vkv-timeline")
    if "motion" in traces:  # Sali-Cache: motion per sampled frame and its skip threshold
        assert traces["motion"] == 16 and traces["threshold"] == 2, traces
    else:  # every sampled frame is on the timeline, kept or skipped
        assert traces["kept"] + traces["skipped"] == 16, traces
    page.locator("#vkv-thumbs img").first.wait_for(timeout=60_000)
    shot(page, "04_video_timeline")
    assert overlapping_texts(page, "#vkv-timeline") == []
    assert overlapping_texts(page, "#vkv-memory") == []
    # the sampled frames: a zoomable gallery with one caption per frame (time, kept or skipped)
    captions = page.locator("#vkv-thumbs .caption-label").all_inner_texts()
    assert len(captions) == 16 and all(re.fullmatch(r"\d+\.\d s · (kept|skipped)", c) for c in captions), captions
    if video_method == "salicache":  # saliency and tiers: one large image per frame, in a zoomable gallery
        open_tab(page, "Saliency")
        page.locator("#vkv-tiers img").first.wait_for(timeout=60_000)
        assert page.locator("#vkv-tiers img").count() >= 2 and page.locator("#vkv-saliency img").count() >= 2
        page.wait_for_function("() => document.querySelector('#vkv-tiers img').naturalWidth > 0", timeout=30_000)
        width = page.evaluate("() => document.querySelector('#vkv-tiers img').naturalWidth")
        assert width >= 360  # each frame large enough to read (the old strip had ~240 px tiles)
        shot(page, "04b_saliency_tiers")


def _long_video(path: Path, seconds: int = 900) -> Path:
    """A 15-minute 64x64 video at 1 fps: 30 s stretches that pan, then 30 s that stand still."""
    import cv2
    import numpy as np

    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 1.0, (64, 64))
    rng = np.random.default_rng(0)
    frame = np.full((64, 64, 3), 120, np.uint8)
    for t in range(seconds):
        if (t // 30) % 2 == 0:
            frame = np.roll(frame, 3, axis=1)
            frame[:, :3] = rng.integers(0, 255, (64, 3, 3))
        writer.write(frame)
    writer.release()
    return path


def test_long_video_timeline_is_binned_zoomable_and_progress_is_in_time(page, tmp_path):
    """Hundreds of sampled frames: the timeline shows bins with a range slider, the progress the video time."""
    new_chat(page)
    # 900 frames: past the 512-frame cap of methods that hold every frame, so a bounded one, composed with
    # Sali-Cache's frame skipping (the timeline then has motion scores and skipped spans)
    choose(page, "#vkv-method", "blockwise-keydiff+salicache")
    open_accordion(page, "Video sampling", "#vkv-fps")
    set_number(page, "#vkv-fps", 1)
    set_number(page, "#vkv-max-frames", 900)
    watch(page)
    send(page, "What moves in this video?", _long_video(tmp_path / "long.mp4"))
    seen = watched(page)
    assert any(" of 15:00 read" in p for p in seen["progress"] if p.startswith("prefill block")), seen["progress"]
    open_tab(page, "Frames")
    page.wait_for_function(
        "() => { const p = document.querySelector('#vkv-timeline .js-plotly-plot');"
        " return p && p.data && p.data.some(t => (t.name || '').includes('per')); }",
        timeout=60_000,
    )
    traces = plot_traces(page, "#vkv-timeline")
    numbers = numbers_panel(page, "video frames sampled")
    sampled = int(re.search(r"video frames sampled / skipped\D*(\d+)", numbers).group(1))
    open_tab(page, "Frames")
    assert sampled > 200, sampled  # many frames, so the timeline shows bins
    binned = {name: n for name, n in traces.items() if "per" in name}
    assert binned and all(n <= 201 for n in binned.values()) and len(traces) <= 6, traces
    assert page.locator("#vkv-timeline .rangeslider-container").count() >= 1  # zoom on the time axis
    page.locator("#vkv-thumbs img").first.wait_for(timeout=60_000)
    shot(page, "04c_long_video_timeline")
    assert overlapping_texts(page, "#vkv-timeline") == []
    assert overlapping_texts(page, "#vkv-memory") == []
    set_number(page, "#vkv-max-frames", 16)


def test_compare_tab(page, tmp_path):
    img = small_png(tmp_path / "compare.png", 448, 336, seed=4)
    open_tab(page, "Compare")
    page.set_input_files("#vkv-cmp-file input[type=file]", str(img))
    # the file's download link appears once the upload is stored on the server (the name itself is
    # drawn as two spans, "compare" and ".png", so a text selector would miss it)
    page.wait_for_selector("#vkv-cmp-file a[download='compare.png']", timeout=TURN_TIMEOUT_MS)
    checked = page.locator("#vkv-cmp-methods input[type=checkbox]:checked").count()
    assert checked >= 3
    page.locator("#vkv-cmp-q textarea, #vkv-cmp-q input").first.fill("Which colour dominates?")
    page.click("#vkv-cmp-run")
    page.wait_for_function(
        "() => (document.querySelector('#vkv-cmp-status') || {innerText: ''}).innerText.includes('done:')",
        timeout=TURN_TIMEOUT_MS,
    )
    table = page.locator("#vkv-cmp-table").inner_text()
    assert "full" in table and "100%" in table, table  # full agrees with itself
    # agreement and memory are read without scrolling the table sideways (the answers come last)
    visible = page.evaluate(
        """() => { const t = document.querySelector('#vkv-cmp-table'); const box = t.getBoundingClientRect();
        return Array.from(t.querySelectorAll('th')).filter(h => h.getBoundingClientRect().right <= box.right + 1)
            .map(h => h.innerText.trim().replace(/\\s+/g, ' ')); }"""
    )
    assert {"method", "agreement with full", "peak vs full"} <= set(visible), visible
    traces = plot_traces(page, "#vkv-cmp-plot")
    assert "full" in traces and len(traces) == checked, (traces, table)
    assert overlapping_texts(page, "#vkv-cmp-plot") == []
    shot(page, "06_compare")


def test_compare_stop_ends_it_at_once_and_keeps_the_finished_rows(page):
    """Compare on the 4K image in blocks of one strip (~70 blocks a method): its own Stop ends the running
    method at a block boundary; the status says so and no later method runs."""
    set_number(page, "#vkv-block-size", 256)
    page.click("#vkv-cmp-file button[aria-label='Clear']")  # the previous test's file
    page.set_input_files("#vkv-cmp-file input[type=file]", str(REPO / "assets" / "example_4k.png"))
    page.wait_for_selector("#vkv-cmp-file a[download='example_4k.png']", timeout=TURN_TIMEOUT_MS)
    checked = page.locator("#vkv-cmp-methods input[type=checkbox]:checked").count()
    page.click("#vkv-cmp-run")
    status_js = "(document.querySelector('#vkv-cmp-status') || {innerText: ''}).innerText"
    page.wait_for_function(f"() => /· [a-z+-]+: prefill block \\d+\\//.test({status_js})", timeout=TURN_TIMEOUT_MS)
    page.click("#vkv-cmp-stop")
    # said at once, by the browser (or the comparison already answered): the server's own line comes after
    page.wait_for_function(f"() => /stopping|Stopped after/.test({status_js})", timeout=5_000)
    page.wait_for_function(f"() => {status_js}.includes('Stopped after')", timeout=TURN_TIMEOUT_MS)
    status = page.inner_text("#vkv-cmp-status")
    finished = int(re.search(r"Stopped after (\d+) of (\d+) methods", status).group(1))
    assert finished < checked, status
    # the table's rows come in the same update as that line; the table may render a moment after the text
    rows_js = "document.querySelectorAll('#vkv-cmp-table tbody tr').length"
    if finished:
        page.wait_for_function(f"() => {rows_js} >= {finished}", timeout=TURN_TIMEOUT_MS)
    rows = page.locator("#vkv-cmp-table tbody tr").count() if finished else 0
    assert rows == finished, (rows, status)
    shot(page, "06a_compare_stopped")
    set_number(page, "#vkv-block-size", 0)


def test_lightkv_merges_tab(page, tmp_path):
    """LightKV's turn: the merge map (with its legend) and the tokens-per-layer chart, legible."""
    new_chat(page)
    choose(page, "#vkv-method", "lightkv")
    send(page, "Which colour dominates?", small_png(tmp_path / "merge.png", 448, 336, seed=5))
    numbers_panel(page, "lightkv")
    open_tab(page, "Merges")
    page.locator("#vkv-merge img").first.wait_for(timeout=60_000)
    page.wait_for_selector("#vkv-layer-tokens .js-plotly-plot", timeout=60_000)
    traces = plot_traces(page, "#vkv-layer-tokens")
    assert set(traces) == {"tokens held", "KV MiB"}, traces
    assert overlapping_texts(page, "#vkv-layer-tokens") == []
    shot(page, "06b_merges")
    choose(page, "#vkv-method", "blockwise-snapkv")  # the method the following tests expect


def test_text_only_question_says_no_image_was_given(page):
    new_chat(page)
    send(page, "What is the capital of France?")
    assert "No image or video" in page.inner_text("#vkv-summary")


def test_load_model_clears_every_result_view(page, tmp_path):
    new_chat(page)
    send(page, "Which colour dominates?", small_png(tmp_path / "load.png", 448, 336, seed=6))
    numbers_panel(page, "visual tokens")
    open_tab(page, "Kept tokens")
    page.locator("#vkv-heatmap img").first.wait_for(timeout=60_000)
    page.click("#vkv-load")  # the same model again: a new chat, and nothing of the old one on show
    page.wait_for_function(
        "() => document.querySelector('#vkv-progress').innerText.startsWith('Loaded')", timeout=TURN_TIMEOUT_MS
    )
    page.wait_for_function("() => document.querySelectorAll('#vkv-heatmap img').length === 0", timeout=10_000)
    assert bot_messages(page) == [] and page.inner_text("#vkv-summary").strip() == ""
    assert not page.evaluate(
        "() => { const p = document.querySelector('#vkv-memory .js-plotly-plot');"
        " return !!(p && p.data && p.data.length); }"
    )
    assert "No turn yet" in numbers_panel(page, "No turn yet")
    shot(page, "07_loaded")


def test_two_users_at_once_keep_separate_chats(browser, app_url, tmp_path):
    a_img = small_png(tmp_path / "a.png", 448, 448, seed=1)
    b_img = small_png(tmp_path / "b.png", 896, 448, seed=2)
    pages = []
    for _ in range(2):
        ctx = browser.new_context(viewport=VIEWPORT, accept_downloads=True)
        pg = ctx.new_page()
        open_app(pg, app_url)
        pages.append(pg)
    a, b = pages
    set_number(a, "#vkv-max-new", 256)  # A's turn outlasts a tick of B's queue watch (a random model rarely stops)
    for pg, img, q in ((a, a_img, "Question from user A?"), (b, b_img, "Question from user B?")):
        attach(pg, img)
        pg.fill("#vkv-input textarea", q)
    watch(b)
    a.click("#vkv-send")
    b.click("#vkv-send")  # both turns are queued at once; the server runs them one after the other
    for pg in pages:
        pg.wait_for_function(
            "() => document.querySelector('#vkv-progress').innerText.startsWith('done')", timeout=TURN_TIMEOUT_MS
        )
        numbers_panel(pg, "visual tokens")
    # B was told where it waits (no ticking counter that could run past an estimate)
    waiting = [p for p in watched(b)["progress"] if p.startswith("waiting")]
    assert waiting and "position 2" in waiting[0], watched(b)
    assert user_messages(a)[-1].strip().endswith("user A?") and len(user_messages(a)) == 1
    assert user_messages(b)[-1].strip().endswith("user B?") and len(user_messages(b)) == 1
    reports = []
    for pg in pages:
        with pg.expect_download() as dl:
            pg.click("#vkv-download")
        reports.append(json.loads(Path(dl.value.path()).read_text()))
    assert [r["turns"][0]["prompt"] for r in reports] == ["Question from user A?", "Question from user B?"]
    assert [r["media"]["width"] for r in reports] == [448, 896]
    assert reports[0]["visual_tokens"] < reports[1]["visual_tokens"]
    shot(a, "05_user_a")
    shot(b, "05_user_b")
    for pg in pages:
        pg.context.close()


def test_stop_while_waiting_in_the_queue_withdraws_the_turn(browser, app_url, tmp_path):
    pages = []
    for _ in range(2):
        ctx = browser.new_context(viewport=VIEWPORT)
        pg = ctx.new_page()
        open_app(pg, app_url)
        pages.append(pg)
    a, b = pages
    attach(b, small_png(tmp_path / "b.png", 448, 336, seed=3))  # B is ready first: A's turn must still run
    b.fill("#vkv-input textarea", "Question B never asked?")
    # A's turn holds the model for a while: the 4K image in ~70 blocks of one strip
    set_number(a, "#vkv-block-size", 256)
    attach(a, REPO / "assets" / "example_4k.png")
    a.fill("#vkv-input textarea", "Where is the small red star?")
    a.click("#vkv-send")
    a.wait_for_function(
        "() => /prefill block \\d+\\//.test(document.querySelector('#vkv-progress').innerText)",
        timeout=TURN_TIMEOUT_MS,
    )
    watch(b)
    b.click("#vkv-send")
    b.wait_for_function("() => window.__vkv.progress.some(p => p.startsWith('waiting: position 2'))")
    b.click("#vkv-stop")
    b.wait_for_function(
        "() => document.querySelector('#vkv-progress').innerText.includes('Stopped while it waited')", timeout=5_000
    )
    assert not a.inner_text("#vkv-progress").startswith("done")  # B stopped while A's turn still ran
    a.wait_for_function(
        "() => document.querySelector('#vkv-progress').innerText.startsWith('done')", timeout=TURN_TIMEOUT_MS
    )
    time.sleep(2.0)  # B's withdrawn turn has come up by now: it must not have run
    assert "Stopped while it waited" in b.inner_text("#vkv-progress")
    assert bot_messages(b) == [] and user_messages(b) == []
    assert b.input_value("#vkv-input textarea") == "Question B never asked?"  # nothing lost
    b.click("#vkv-send")  # the same question, sent again, runs
    b.wait_for_function(
        "() => document.querySelector('#vkv-progress').innerText.startsWith('done')", timeout=TURN_TIMEOUT_MS
    )
    assert len(bot_messages(b)) == 1 and user_messages(b)[-1].strip().endswith("never asked?")
    for pg in pages:
        pg.context.close()
