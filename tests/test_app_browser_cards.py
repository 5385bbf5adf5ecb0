"""The app as a first visitor of a shared instance (a Space) finds it, in a real browser: its own start model and
settings untouched, every example card clicked and sent, each answered right (the scene's key,
assets/visualkv-demo/examples.json) and compressed by the default budget (its summary shows the saving); the settings' shared maxima shown and enforced in one line. After the
largest image's card answers, the window a visitor sees is the README's screenshot: with VISUALKV_SCREENSHOT=1
it replaces docs/screenshot.png (else it goes to artifacts/, so a test run leaves the tree clean).

An app process of its own, started with --public and without --model (the other browser modules run a
random-weight model locally)."""

from __future__ import annotations

import os

import pytest
from PIL import Image

from tests import test_app_browser as base
from tests.test_app_browser import (
    ARTIFACTS,
    REPO,
    VIEWPORT,
    bot_messages,
    error_text,
    in_viewport,
    new_chat,
    open_tab,
    run_app,
    send,
    set_number,
    shot,
)

browser = base.browser  # the browser fixture of tests/test_app_browser.py

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def app_url(tmp_path_factory):
    yield from run_app(tmp_path_factory, ["--public"])  # no --model: the app's own start model, as on a Space


def _open_page(context, url: str):
    """A new tab on the app, its settings as the app set them (no test defaults applied)."""
    pg = context.new_page()
    pg.goto(url)
    pg.wait_for_selector("#vkv-input textarea", timeout=60_000)
    return pg


def test_every_example_card_answers_right_with_the_defaults(browser, app_url):
    from ui.examples import chat_examples
    from visualkv.bench.demo_examples import load_demo_examples
    from visualkv.bench.scenes import answer_matches

    demo = load_demo_examples()
    keys = {(q.question, e.path): q.answer for e in demo for q in e.questions}
    shown = [(card["text"], card["files"][0]) for card in chat_examples(demo)]
    context = browser.new_context(viewport=VIEWPORT)
    pg = _open_page(context, app_url)
    assert "visualkv-demo" in pg.inner_text("#vkv-model-note")  # the start model is the demo model
    cards = pg.locator("#vkv-examples .thumbnail-item")
    cards.first.wait_for(timeout=30_000)
    assert cards.count() == len(shown) >= 8
    answers, saved, largest = [], [], _largest_image(shown)
    for index, (question, path) in enumerate(shown):
        cards.nth(index).scroll_into_view_if_needed()
        cards.nth(index).click()
        pg.wait_for_selector("#vkv-input .thumbnail-item", timeout=30_000)
        assert pg.input_value("#vkv-input textarea") == question  # the card put its own question in the input
        send(pg, question)  # the card's file stays attached
        answers.append((question, path.rsplit("/", 1)[-1], keys[question, path], bot_messages(pg)[-1].strip()))
        summary = pg.inner_text("#vkv-summary")  # the default budget compressed this card, and says so
        saved.append((path.rsplit("/", 1)[-1], summary))
        if path == largest:
            _front_door_screenshot(pg)
            largest = None  # once, after the image's first question
        if index == len(shown) - 1:
            shot(pg, "cards_last_answer")
        new_chat(pg)
    wrong = [a for a in answers if not answer_matches(a[3], a[2])]
    assert not wrong, wrong
    # the default (keep 10 %) and the figure it became on this card, and a saving at peak
    uncompressed = [
        (name, line) for name, line in saved if "keep 10 % = budget " not in line or "× less at peak" not in line
    ]
    assert not uncompressed, uncompressed
    context.close()


def _largest_image(shown: list[tuple[str, str]]) -> str:
    def pixels(path: str) -> int:
        with Image.open(path) as img:
            return img.size[0] * img.size[1]

    return max((path for _, path in shown if not path.endswith(".webm")), key=pixels)


def _front_door_screenshot(pg) -> None:
    """The answer, its one-line summary and the kept tokens fit the 1440x900 window unscrolled: the screenshot."""
    open_tab(pg, "Kept tokens")
    pg.evaluate("() => window.scrollTo(0, 0)")
    pg.locator("#vkv-heatmap img").nth(1).wait_for(timeout=60_000)
    visual = pg.inner_text("#vkv-summary").split(" visual tokens")[0]  # this turn's count, e.g. "10549"
    assert visual.isdigit(), pg.inner_text("#vkv-summary")
    # the kept-token view is this turn's, not the last card's
    pg.wait_for_function(
        "(n) => document.querySelector('#vkv-heat-note').innerText.startsWith(n + ' visual tokens')",
        arg=visual,
        timeout=30_000,
    )
    for elem in ("#vkv-chat", "#vkv-summary", "#vkv-heatmap", "#vkv-input"):
        assert in_viewport(pg, elem), (elem, pg.locator(elem).first.bounding_box())
    from visualkv.bench.provenance import save_json, start

    target = REPO / "docs" if os.environ.get("VISUALKV_SCREENSHOT") == "1" else ARTIFACTS
    target.mkdir(exist_ok=True)
    prov = start()  # before the picture is written: the commit it was taken on, not the tree with it changed
    prov["command"] = "VISUALKV_SCREENSHOT=1 python -m pytest tests/test_app_browser_cards.py"
    pg.screenshot(path=str(target / "screenshot.png"))
    # beside it: the machine, load and commit it was taken on, and the timings it shows
    shown = {"progress": pg.inner_text("#vkv-progress"), "summary": pg.inner_text("#vkv-summary")}
    save_json(shown, str(target / "screenshot.json"), prov)


def test_a_shared_instance_shows_and_enforces_its_maxima(browser, app_url):
    """Past a shared maximum (max new tokens here) the turn is refused in one line that says whose limit it is;
    the field's help shows the maximum in force."""
    from ui.bounds import SHARED

    context = browser.new_context(viewport=VIEWPORT)
    pg = _open_page(context, app_url)
    pg.click("text=Generation and follow-ups")
    pg.wait_for_selector("#vkv-max-new input[type=number]", timeout=10_000)
    assert f"1 to {SHARED.max_new:,}" in pg.inner_text("#vkv-max-new")
    set_number(pg, "#vkv-max-new", SHARED.max_new + 1)
    send(pg, "Is there a star?", expect_error=True)
    message = error_text(pg)
    assert "max new tokens must be" in message and "on this shared instance" in message, message
    assert "\n" not in message and bot_messages(pg) == []
    context.close()
