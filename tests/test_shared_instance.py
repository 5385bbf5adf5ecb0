"""A shared instance's bounds in process: the question's length, the turns of a chat, Stop inside a layer, one
computation per session and a few per visitor, every raw API value checked, the time limit's words.
tests/test_attack.py checks the same end to end against `app.py --public`."""

from __future__ import annotations

import asyncio
import math
import threading
from dataclasses import replace
from types import SimpleNamespace

import gradio as gr
import pytest

from tests.conftest import get_adapter
from visualkv.errors import ConfigError, PrefillStopped
from visualkv.runtime.question import CHARS_PER_TOKEN, question_tokens
from visualkv.runtime.session import ChatSession, SessionConfig
from visualkv.runtime.streaming import stream_turn

MODEL = "tiny-qwen2.5-vl"


@pytest.fixture(scope="module")
def shared_app():
    from ui.app import build_app
    from ui.sharing import ServeOptions

    return build_app(MODEL, serve=ServeOptions(public=True))


def _turns(demo):
    return next(fn.fn.__self__ for fn in demo.fns.values() if getattr(fn.fn, "__name__", "") == "chat")


# -- the question and the chat ----------------------------------------------------------------------------------


def test_a_question_too_long_to_read_is_refused_unread():
    def must_not_tokenize(*args, **kwargs):
        raise AssertionError("a 1 MB question must be refused before it is tokenized")

    with pytest.raises(ConfigError) as refused:
        question_tokens(must_not_tokenize, "x" * 1_000_000, 2_048, " on this shared instance")
    line = str(refused.value)
    assert line == (
        "the question is too long: at most 2,048 tokens on this shared instance, got 1,000,000 characters; shorten it"
    )
    assert question_tokens(get_adapter(MODEL).tokenizer, "What is shown?", 2_048) > 0


def test_questions_are_bounded_in_tokens_shared_and_locally(shared_app, monkeypatch):
    """Over the cap: one line naming it, before any compute (no session is made); under it the turn opens. The
    local cap is higher and holds too."""
    from ui.bounds import LOCAL, SHARED
    from ui.forms import DEFAULTS
    from ui.state import UserState

    turns = _turns(shared_app)
    word = "word "  # one token each in this tokenizer: a question of n words is n tokens (+/- one)
    assert SHARED.question_tokens < LOCAL.question_tokens
    opened = turns._open(UserState(model_name=MODEL), word * (SHARED.question_tokens - 8), [], DEFAULTS)
    assert opened.session is not None
    monkeypatch.setattr("ui.chat.ChatSession", lambda *a, **k: pytest.fail("compute began for a refused question"))
    for bounds, count in ((SHARED, SHARED.question_tokens + 8), (LOCAL, LOCAL.question_tokens + 8)):
        turns.context.bounds = bounds
        with pytest.raises(ConfigError) as refused:
            turns._open(UserState(model_name=MODEL), word * count, [], DEFAULTS)
        line = str(refused.value)
        assert line.startswith(f"the question is too long: at most {bounds.question_tokens:,} tokens{bounds.where}")
        assert "\n" not in line
    turns.context.bounds = SHARED
    assert LOCAL.question_tokens * CHARS_PER_TOKEN < 1_000_000  # a 1 MB question is refused unread, locally too


def test_a_chat_is_bounded_in_turns(shared_app):
    from ui.bounds import SHARED
    from ui.forms import DEFAULTS
    from ui.state import UserState

    turns = _turns(shared_app)
    state = UserState(model_name=MODEL)
    pair = [{"role": "user", "content": ["Q?"]}, {"role": "assistant", "content": "A."}]
    state.history = pair * (SHARED.turns - 1)
    state.session = ChatSession(get_adapter(MODEL), SessionConfig(method="full"))
    turns._open(state, "One more?", [], replace(DEFAULTS, method="full"))  # the last turn allowed
    state.history = pair * SHARED.turns
    with pytest.raises(ConfigError, match=f"^this chat has reached {SHARED.turns} turns.*click New chat"):
        turns._open(state, "One more?", [], replace(DEFAULTS, method="full"))


# -- Stop inside a layer -------------------------------------------------------------------------------------------


def test_stop_ends_a_text_pass_inside_a_layer():
    """Stop set as the first attention of SnapKV's proxy-query text pass finishes: that layer's MLP never runs."""
    from PIL import Image

    adapter = get_adapter(MODEL)
    stop, after = threading.Event(), []

    def attention_done(module, args, output):
        stop.set()

    def mlp_ran(module, args, output):
        if stop.is_set():
            after.append(module)

    handles = [layer.self_attn.register_forward_hook(attention_done) for layer in adapter.layers[:1]]
    handles += [layer.mlp.register_forward_hook(mlp_ran) for layer in adapter.layers]
    session = ChatSession(adapter, SessionConfig(method="blockwise-snapkv", budget=64))
    try:
        events = list(stream_turn(session, "What is shown? " * 50, Image.new("RGB", (96, 96)), stop=stop))
    finally:
        for handle in handles:
            handle.remove()
    assert stop.is_set() and events[-1][0] == "stopped", events[-1]
    assert after == [], f"{len(after)} MLP(s) ran after Stop"


def test_stop_ends_a_followups_replay_of_the_conversation_and_keeps_the_chat():
    """A follow-up that re-prefills replays the whole conversation in one text pass (as long as the chat's turns
    allow): Stop, set once its first attention ran, ends it before any later part of a layer, and the chat goes on
    as it was."""
    from PIL import Image

    adapter = get_adapter(MODEL)
    config = SessionConfig(method="blockwise-snapkv", budget=64, followup="reprefill", max_new_tokens=4)
    session = ChatSession(adapter, config)
    assert list(stream_turn(session, "What is shown?", Image.new("RGB", (96, 96))))[-1][0] == "done"
    stop, after, replays = threading.Event(), [], []
    extend = session.engine.extend

    def attention_done(module, args, output):
        stop.set()

    def mlp_ran(module, args, output):
        if stop.is_set():
            after.append(module)

    def replay(*args, should_stop=None):
        if should_stop is None:  # the answer's decoding (this chat re-prefills, so its question is the replay)
            return extend(*args)
        replays.append(args[0].shape[0])
        handles = [adapter.layers[0].self_attn.register_forward_hook(attention_done)]
        handles += [layer.mlp.register_forward_hook(mlp_ran) for layer in adapter.layers]
        try:
            return extend(*args, should_stop=should_stop)
        finally:
            for handle in handles:
                handle.remove()

    session.engine.extend = replay
    try:
        events = list(stream_turn(session, "And what else? " * 20, stop=stop))
    finally:
        session.engine.extend = extend
    assert replays and stop.is_set() and events[-1][0] == "stopped", events[-1]
    assert after == [], f"{len(after)} MLP(s) ran after Stop"
    assert len(session.turns) == 1
    assert list(stream_turn(session, "And what else?"))[-1][0] == "done"  # the chat goes on
    assert len(session.turns) == 2


def test_stop_inside_a_followups_question_pass_leaves_the_kept_cache_as_it_was():
    """A follow-up that keeps the cache runs its question through every layer in one pass: Stop, set once the first
    layer's attention ran, ends it before any later part of a layer, the entries it appended are dropped, and the
    next follow-up answers exactly as in a chat that was never stopped."""
    from PIL import Image

    adapter = get_adapter(MODEL)
    config = SessionConfig(method="blockwise-snapkv", budget=64, max_new_tokens=4)
    image = Image.new("RGB", (96, 96))
    stopped, twin = ChatSession(adapter, config), ChatSession(adapter, config)
    for session in (stopped, twin):
        assert list(stream_turn(session, "What is shown?", image))[-1][0] == "done"
    held = stopped.cache.entries_per_layer()
    stop, after = threading.Event(), []
    handles = [adapter.layers[0].self_attn.register_forward_hook(lambda *_: stop.set())]
    handles += [layer.mlp.register_forward_hook(lambda m, *_: after.append(m) if stop.is_set() else None)
                for layer in adapter.layers]  # fmt: skip
    try:
        events = list(stream_turn(stopped, "And what else? " * 20, stop=stop))
    finally:
        for handle in handles:
            handle.remove()
    assert events[-1][0] == "stopped" and after == [], (events[-1], len(after))
    assert stopped.cache.entries_per_layer() == held and len(stopped.turns) == 1
    records = [list(stream_turn(s, "And what else?"))[-1] for s in (stopped, twin)]
    assert [r[0] for r in records] == ["done", "done"]
    answers = [(r[1].token_ids, r[1].kv_bytes_after) for r in records]
    assert answers[0] == answers[1] and answers[0][0], answers
    assert len(stopped.turns) == 2


# -- the queue's gate ------------------------------------------------------------------------------------------------


def _event(session: str, host: str = "1.2.3.4"):
    return SimpleNamespace(session_hash=session, request=SimpleNamespace(client=SimpleNamespace(host=host), headers={}))


def test_one_computation_per_session_and_a_few_per_visitor():
    from ui.gate import ONE_PER_SESSION, QueueGate

    held: list = []
    gate = QueueGate(SimpleNamespace(held=lambda: held), max_client_sessions=2, where=" on this shared instance")
    assert gate.refusal("a", "1.2.3.4") is None
    held.append(_event("a"))
    assert gate.refusal("a", "1.2.3.4") == ONE_PER_SESSION  # refused, not replacing the waiting one
    assert gate.refusal("b", "1.2.3.4") is None
    held.append(_event("b"))
    line = gate.refusal("c", "1.2.3.4")
    assert line.startswith("this address already has 2 computation(s) waiting or running") and "shared" in line
    assert gate.refusal("c", "5.6.7.8") is None  # another visitor
    assert QueueGate(SimpleNamespace(held=lambda: held)).refusal("c", "1.2.3.4") is None  # locally: no bound


def test_the_gate_answers_before_gradio_queues(shared_app):
    """Installed on the app's queue: a refused push never reaches Gradio's own push."""
    from ui.gate import ONE_PER_SESSION, QueueGate
    from ui.queue import COMPUTE_ID

    reached = []

    async def push(body, request, username):
        reached.append(body.session_hash)
        return True, "id", "success"

    chat_id = next(i for i, fn in shared_app.fns.items() if fn.concurrency_id == COMPUTE_ID)
    demo = SimpleNamespace(fns=shared_app.fns, _queue=SimpleNamespace(push=push))
    held = [_event("busy")]
    QueueGate(SimpleNamespace(held=lambda: held), max_client_sessions=2).install(demo)
    request = SimpleNamespace(client=SimpleNamespace(host="1.2.3.4"), headers={})
    refused = asyncio.run(demo._queue.push(SimpleNamespace(fn_index=chat_id, session_hash="busy"), request, None))
    accepted = asyncio.run(demo._queue.push(SimpleNamespace(fn_index=chat_id, session_hash="new"), request, None))
    assert refused == (False, ONE_PER_SESSION, "error") and accepted[0] and reached == ["new"]


def test_client_sessions_default_follows_the_mode():
    from app import SHARED_CLIENT_SESSIONS, client_sessions

    assert client_sessions(None, public=True) == SHARED_CLIENT_SESSIONS
    assert client_sessions(None, public=False) is None
    assert client_sessions(0, public=True) is None and client_sessions(5, public=False) == 5


# -- every raw value -------------------------------------------------------------------------------------------------

#: the settings form's bounded number fields and the overlay opacity: a finite number typed there is checked by its
#: callback (the form's range in the page's error field; the opacity clamped)
TYPED_NUMBERS = {
    "vkv-budget", "vkv-keep", "vkv-block-size", "vkv-max-new", "vkv-temperature", "vkv-vision-ahead", "vkv-fps", "vkv-max-frames",
    "vkv-opacity",
}  # fmt: skip
BAD = [math.nan, math.inf, -math.inf, "abc", -1e12, {"a": 1}, "not-a-choice", [1, 2]]


def test_every_input_of_every_event_refuses_every_bad_value_in_one_line(shared_app):
    """Each bad value in each input of each event: the app's one line naming the field; the defaults pass."""
    values = shared_app.api_values
    typed = {b._id for b in shared_app.blocks.values() if getattr(b, "elem_id", None) in TYPED_NUMBERS}
    assert len(typed) == len(TYPED_NUMBERS)
    checked = 0
    for fn in shared_app.fns.values():
        defaults = [getattr(c, "value", None) for c in fn.inputs]
        if fn.api_name in ("chat", "chat_1"):
            defaults[0] = {"text": "What?", "files": []}
        assert values.refusal(fn, defaults) is None, (fn.api_name, values.refusal(fn, defaults))
        for index, component in enumerate(fn.inputs):
            if component.stateful:
                continue
            for bad in BAD:
                if isinstance(component, (gr.Textbox, gr.HTML, gr.Markdown)) and isinstance(bad, str):
                    continue  # any text is text; a method's text setting is checked by its method
                if bad == -1e12 and component._id in typed:
                    # a finite number the page can send: clamped by its callback (the overlay opacity), or
                    # refused by the turn's own first check in the page's error field (the form's ranges)
                    assert values.refusal(fn, [*defaults[:index], bad, *defaults[index + 1 :]]) is None
                    continue
                data = list(defaults)
                data[index] = bad
                line = values.refusal(fn, data)
                checked += 1
                assert line and "\n" not in line, (fn.api_name, component.label, bad, line)
                unnamed = "the question" if isinstance(component, gr.MultimodalTextbox) else type(component).__name__
                name = component.label or unnamed
                assert name in line, (fn.api_name, bad, line)
    assert checked > 500
    assert values.refusal(next(iter(shared_app.fns.values())), [1, 2, 3]).startswith("this endpoint takes")


def test_the_question_passes_as_the_page_sends_it_and_as_gradio_reads_it(shared_app):
    """After a turn empties the box, the page sends the question with Gradio's `__type__` marker (Gradio's data
    model drops unknown keys): it passes. What Gradio's model cannot read (no text, files not a list) is refused
    in one line instead of Gradio's validation traceback."""
    from gradio.components.multimodal_textbox import MultimodalData

    values = shared_app.api_values
    for fn in (fn for fn in shared_app.fns.values() if fn.api_name in ("chat", "queued")):
        data = [getattr(c, "value", None) for c in fn.inputs]
        sent = {"__type__": "update", "files": [], "text": "And what does the label say?"}
        MultimodalData.model_validate(sent)  # Gradio itself takes it
        assert values.refusal(fn, [sent, *data[1:]]) is None, fn.api_name
        for unreadable in ({"files": []}, {"text": None, "files": []}, {"text": "a", "files": None}):
            with pytest.raises(ValueError):
                MultimodalData.model_validate(unreadable)
            line = values.refusal(fn, [unreadable, *data[1:]])
            assert line and "the question" in line and "\n" not in line, (fn.api_name, unreadable, line)


def test_a_refused_value_is_a_gradio_error_without_traceback(shared_app):
    fn = next(fn for fn in shared_app.fns.values() if fn.api_name == "layer_changed")
    with pytest.raises(gr.Error) as refused:
        asyncio.run(shared_app.preprocess_data(fn, [None, "not-a-layer", 0.5], None))
    assert refused.value.print_exception is False and str(refused.value.message).startswith("layer must be one of")


# -- words -----------------------------------------------------------------------------------------------------------


def test_an_evidence_pass_ended_by_the_time_limit_says_so(monkeypatch):
    from ui import evidence

    def slow_pass(session, on_block=None, stop=None):
        stop.wait(10)
        raise PrefillStopped()

    monkeypatch.setattr(evidence, "compute_evidence", slow_pass)
    state = SimpleNamespace(session=SimpleNamespace(media=object()), report={}, stop=None)
    note, *_ = evidence.compute(state, "average", 0.5, progress=lambda *a, **k: None, time_limit=0.2)
    assert note == evidence.time_limit_line(0.2) and "time limit (0.2 s)" in note


def test_docs_list_the_question_and_turn_bounds():
    """docs/APP.md's rows for the question's tokens and a chat's turns are ui/bounds.py's values."""
    from pathlib import Path

    from ui.bounds import LOCAL, SHARED

    doc = (Path(__file__).resolve().parent.parent / "docs" / "APP.md").read_text()
    for label, name in (("question tokens", "question_tokens"), ("turns per chat", "turns")):
        row = f"| {label} | {getattr(LOCAL, name):,} | {getattr(SHARED, name):,} |"
        assert row in doc, row


def test_the_overlay_opacity_is_clamped_not_refused_yet_must_be_finite(shared_app):
    """The page lets one type any opacity (its callback clamps it to 0..1); only non-numbers are refused."""
    fn = next(fn for fn in shared_app.fns.values() if fn.api_name == "layer_changed")
    assert shared_app.api_values.refusal(fn, [None, "average", 5.0]) is None
    assert "overlay opacity" in shared_app.api_values.refusal(fn, [None, "average", math.nan])
