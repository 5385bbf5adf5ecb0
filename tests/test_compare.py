"""Compare and time limits: `streaming.stream_compare` and the app's Compare handler stop where a chat turn
stops (Stop, New chat, the shared instance's turn time limit) and say which of them did; a chat turn ended
by the time limit says so too, instead of "stopped by you".

Timers are replaced by ones the test fires itself (`ManualTimer`), so each case is deterministic.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import ClassVar

import gradio as gr
import pytest
from gradio.context import LocalContext
from gradio.queueing import Event
from PIL import Image

from ui import queue as queue_module
from ui.callbacks import Callbacks
from ui.queue import COMPUTE_ID
from ui.state import ModelCache, UserState
from ui.status import WITHDRAWN_COMPARE, WITHDRAWN_TURN, progress_html
from visualkv.bench.synthetic import image_media, synthetic_image
from visualkv.models.registry import load_model
from visualkv.report.telemetry import TIME_LIMIT_STOP
from visualkv.runtime import streaming
from visualkv.runtime.session import ChatSession, SessionConfig
from visualkv.runtime.streaming import TIME_LIMIT_STOPPED, compare_methods, stream_compare, stream_turn

PROMPT = "Where is the red square?"
BUDGET = 24
MODEL = "tiny-qwen2.5-vl"


@pytest.fixture(scope="module")
def adapter():
    return load_model(MODEL)


@pytest.fixture(scope="module")
def image():
    return image_media(448, 336, seed=1)  # 192 visual tokens: 6 blocks of 32


def _config(method: str = "full", **kw) -> SessionConfig:
    """A base for a comparison (budget for the methods that take one) or a chat's config."""
    return SessionConfig(method=method, budget=BUDGET, max_new_tokens=kw.pop("max_new_tokens", 3), **kw)


class ManualTimer:
    """Stands in for `threading.Timer` in visualkv.runtime.streaming: fires when the test says (or at start)."""

    made: ClassVar[list[ManualTimer]] = []
    fire_at_start: ClassVar[bool] = False

    def __init__(self, seconds, function) -> None:
        self.seconds, self.function, self.cancelled = seconds, function, False
        ManualTimer.made.append(self)

    def start(self) -> None:
        if ManualTimer.fire_at_start:
            self.function()

    def cancel(self) -> None:
        self.cancelled = True

    def fire(self) -> None:
        self.function()


@pytest.fixture
def timers(monkeypatch):
    ManualTimer.made, ManualTimer.fire_at_start = [], False
    monkeypatch.setattr(streaming.threading, "Timer", ManualTimer)
    return ManualTimer


# -- stream_turn: the time limit names itself ------------------------------------------------------


def test_time_limit_during_the_prefill_says_so(adapter, image, timers):
    timers.fire_at_start = True  # the limit has passed before the first block
    session = ChatSession(adapter, _config(block_size=32, prefill="blockwise"))
    events = list(stream_turn(session, PROMPT, image, threading.Event(), time_limit=300))
    assert events == [("stopped", TIME_LIMIT_STOPPED)] and session.turns == []


def test_time_limit_during_the_answer_is_recorded_as_such(adapter, image, timers):
    session = ChatSession(adapter, _config(max_new_tokens=200))
    stop = threading.Event()
    events = []
    for kind, payload in stream_turn(session, PROMPT, image, stop, time_limit=300):
        events.append((kind, payload))
        if kind == "text" and len(events) < 50:
            timers.made[-1].fire()
    record = events[-1][1]
    assert events[-1][0] == "done" and record.stopped == TIME_LIMIT_STOP and len(record.token_ids) < 200
    assert session.report()["turns"][0]["stopped"] == TIME_LIMIT_STOP  # in the JSON report too


def test_a_users_stop_is_not_called_the_time_limit(adapter, image, timers):
    session = ChatSession(adapter, _config(max_new_tokens=200))
    stop = threading.Event()
    for kind, payload in stream_turn(session, PROMPT, image, stop, time_limit=300):
        if kind == "text":
            stop.set()
    assert kind == "done" and payload.stopped == "stopped" and timers.made[-1].cancelled


# -- stream_compare --------------------------------------------------------------------------------


def test_compare_streams_each_method_in_order(adapter, image):
    base = _config(block_size=64, prefill="blockwise")
    events = list(stream_compare(adapter, image, PROMPT, ["blockwise-keydiff", "full"], base))
    kinds = [k for k, _ in events]
    assert kinds[-1] == "done" and kinds.count("result") == 2 and "stopped" not in kinds
    starts = [p for k, p in events if k == "method"]
    assert starts == [("full", 0, 2), ("blockwise-keydiff", 1, 2)]  # the reference first
    for name, _, _ in starts:  # each method's blocks come after its start and before its result
        begin = events.index(("method", next(s for s in starts if s[0] == name)))
        result = next(i for i, (k, p) in enumerate(events) if k == "result" and p[0] == name)
        between = events[begin + 1 : result]
        assert between and all(k == "block" and p[0] == name for k, p in between)
    reports = dict(p for k, p in events if k == "result")
    assert all(isinstance(r, dict) and r["method"] == name for name, r in reports.items())
    assert [name for name, _ in compare_methods(adapter, image, PROMPT, ["blockwise-keydiff", "full"], base)] == [
        "full",
        "blockwise-keydiff",
    ]


def test_stop_between_methods_runs_no_more(adapter, image):
    stop = threading.Event()
    seen = []
    for kind, payload in stream_compare(
        adapter, image, PROMPT, ["full", "blockwise-keydiff", "lightkv"], _config(), None, stop
    ):
        seen.append((kind, payload))
        if kind == "result":
            stop.set()
    assert [k for k, _ in seen if k == "result"] == ["result"]
    assert seen[-1] == ("stopped", ("stopped after 1 of 3 methods", False))


def test_stop_while_a_method_reads_the_media_drops_that_method(adapter, image):
    stop = threading.Event()
    base = _config(block_size=32, prefill="blockwise")
    seen = []
    for kind, payload in stream_compare(adapter, image, PROMPT, ["full", "blockwise-snapkv"], base, None, stop):
        seen.append((kind, payload))
        if kind == "block" and payload[0] == "blockwise-snapkv":
            stop.set()
    results = [p[0] for k, p in seen if k == "result"]
    assert results == ["full"]  # the stopped method has no row: nothing of its turn was kept
    assert seen[-1] == ("stopped", ("stopped after 1 of 2 methods", False))


def test_the_time_limit_bounds_the_whole_comparison(adapter, image, timers, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(streaming.time, "monotonic", lambda: clock[0])
    seen = []
    events = stream_compare(adapter, image, PROMPT, ["full", "blockwise-keydiff"], _config(), time_limit=60)
    for kind, payload in events:
        seen.append((kind, payload))
        if kind == "result":
            clock[0] += 45  # the first method took 45 of the 60 s
    # each method's turn got what was left of the limit, not a limit of its own
    assert [t.seconds for t in timers.made] == [60, 15]
    assert seen[-1] == ("done", None)

    clock[0], seen = 1000.0, []
    for kind, payload in stream_compare(
        adapter, image, PROMPT, ["full", "blockwise-keydiff"], _config(), time_limit=60
    ):
        seen.append((kind, payload))
        if kind == "result":
            clock[0] += 61  # past the limit: the second method never starts
    assert [p[0] for k, p in seen if k == "method"] == ["full"]
    assert seen[-1] == ("stopped", ("the time limit stopped the comparison after 1 of 2 methods", True))


def test_a_time_limit_inside_a_method_stops_the_comparison_there(adapter, image, timers):
    base = _config(block_size=32, prefill="blockwise")
    seen = []
    for kind, payload in stream_compare(adapter, image, PROMPT, ["full", "blockwise-snapkv"], base, time_limit=300):
        seen.append((kind, payload))
        if kind == "block" and payload[0] == "blockwise-snapkv":
            timers.made[-1].fire()
    assert [p[0] for k, p in seen if k == "result"] == ["full"]
    assert seen[-1] == ("stopped", ("the time limit stopped the comparison after 1 of 2 methods", True))


def test_an_answer_cut_short_is_marked_in_the_table(adapter, image):
    from visualkv.report import viz

    stop = threading.Event()
    results = {}
    base = _config(max_new_tokens=200)
    for kind, payload in stream_compare(adapter, image, PROMPT, ["full"], base, None, stop):
        if kind == "block":
            continue
        if kind == "result":
            results[payload[0]] = payload[1]
    assert results["full"]["turns"][0]["stopped"] in ("eos", "max_new_tokens")
    results["full"]["turns"][0]["stopped"] = "stopped"
    row = viz.compare_rows(results)[0]
    agreement, answer = viz.COMPARE_HEADERS.index("agreement with full"), viz.COMPARE_HEADERS.index("answer")
    assert row[agreement] == "stopped" and "(stopped after" in row[answer]


# -- the app's handlers ----------------------------------------------------------------------------


def _who(name: str) -> SimpleNamespace:
    """A request from the browser session `name`."""
    return SimpleNamespace(session_hash=name)


def _app(turn_time_limit=None) -> Callbacks:
    return Callbacks.create(ModelCache(device="cpu"), MODEL, turn_time_limit=turn_time_limit)


def _compare(h, state, path, methods, max_new=3, session="alice"):
    #         state, methods, question, file, evidence column, method, budget, keep %, block size, max new,
    #         temperature, followup, prefill, blocks per vision-tower call, fps, max frames
    return h.comparisons.compare(
        SimpleNamespace(session_hash=session),
        state,
        methods,
        PROMPT,
        path,
        False,
        "full",
        BUDGET,
        10,
        32,
        max_new,
        0.0,
        "reuse",
        "blockwise",
        1,
        1.0,
        8,
    )


@pytest.fixture(scope="module")
def png(tmp_path_factory):
    path = tmp_path_factory.mktemp("compare") / "scene.png"
    Image.fromarray(synthetic_image(448, 336, seed=1)).save(path)
    return str(path)


@pytest.mark.parametrize("button", ["compare", "chat"])
def test_compares_stop_button_and_the_chats_both_stop_it(png, button):
    """Compare's own Stop and the chat's Stop (which stops whatever the session runs) both end a comparison
    after the method that runs, keeping the finished rows."""
    h, state = _app(), UserState(model_name=MODEL)
    statuses, tables = [], []
    for table, _fig, status, _state in _compare(h, state, png, ["full", "blockwise-keydiff", "lightkv"]):
        statuses.append(status)
        if isinstance(table, list):
            tables.append(table)
        if status == "1/3 done":
            assert not state.stop.is_set()
            if button == "chat":
                h.turns.stop(_who("alice"), state)
            else:
                h.comparisons.stop_compare(_who("alice"), state)
            assert state.stop.is_set()
    assert statuses[-1] == "Stopped after 1 of 3 methods; the table keeps the finished ones", statuses
    assert [row[0] for row in tables[-1]] == ["full"]
    assert any("· full: prefill block" in s for s in statuses), statuses  # progress inside a method
    state.stop.clear()
    h.comparisons.stop_compare(_who("alice"), state)
    assert not state.stop.is_set() and h.queue.active == {}  # nothing left running to stop


def test_a_compare_as_a_sessions_first_event_can_be_stopped(png):
    """Before any chat the page's state is None: the comparison hands the state it runs under to the page,
    so the page's Stop reaches it."""
    h = _app()
    page_state, statuses = None, []
    for _table, _fig, status, state in _compare(h, None, png, ["full", "blockwise-keydiff", "lightkv"]):
        statuses.append(status)
        if isinstance(state, UserState):
            page_state = state  # what Gradio keeps for the page's next events
        if status == "1/3 done":
            h.comparisons.stop_compare(_who("alice"), page_state)
    assert statuses[-1].startswith("Stopped after 1 of 3 methods"), statuses


def test_compare_under_the_time_limit_says_so(png, timers):
    timers.fire_at_start = True
    h, state = _app(turn_time_limit=120), UserState(model_name=MODEL)
    statuses = [out[2] for out in _compare(h, state, png, ["full", "blockwise-keydiff"])]
    assert statuses[-1].startswith("The time limit stopped the comparison after 0 of 2 methods (120 s"), statuses


def test_new_chat_stops_a_running_compare_and_it_writes_nothing_more(png):
    """New chat emptied Compare's results: the comparison it stopped must not fill them again."""
    h, state = _app(), UserState(model_name=MODEL)
    statuses = []
    for _table, _fig, status, _state in _compare(h, state, png, ["full", "blockwise-keydiff"]):
        statuses.append(status)
        if status == "1/2 done":
            state.new_chat()
    assert statuses[-1] == "1/2 done", statuses
    assert state.stop.is_set() is False and h.queue.active == {}  # ended: nothing of it runs


def test_compare_with_nothing_ticked_is_one_line(png):
    h, state = _app(), UserState(model_name=MODEL)
    (out,) = list(_compare(h, state, png, []))
    assert "tick at least one method" in out[2] and h.queue.active == {}


def _chat(h, state, text, files=(), max_new=3, method="full", vision_ahead=1):
    request = SimpleNamespace(session_hash="alice")
    message = {"text": text, "files": list(files)}
    return h.turns.chat(
        request, message, state, method, BUDGET, 10, 32, max_new, 0.0, "reuse", "blockwise", vision_ahead, 1.0, 8
    )


def test_the_summary_tells_the_media_warnings(tmp_path):
    """An animated GIF is read from its first frame only: the app's summary says so (it was silent)."""
    first, second = (Image.new("RGB", (112, 112), colour) for colour in ("red", "blue"))
    first.save(tmp_path / "wave.gif", save_all=True, append_images=[second], duration=100)
    h, state = _app(), UserState(model_name=MODEL)
    summary = list(_chat(h, state, PROMPT, [str(tmp_path / "wave.gif")]))[-1][7]
    assert "⚠️ 'wave.gif' is an animated GIF (2 frames): only the first frame is read" in summary, summary
    assert str(tmp_path) not in summary  # the file's name, not the server's folder
    plain = tmp_path / "still.png"
    first.save(plain)
    h, state = _app(), UserState(model_name=MODEL)
    assert "⚠️" not in list(_chat(h, state, PROMPT, [str(plain)]))[-1][7]


def test_chat_turn_stopped_by_the_time_limit_while_reading_says_so(png, timers):
    timers.fire_at_start = True
    h, state = _app(turn_time_limit=90), UserState(model_name=MODEL)
    outs = list(_chat(h, state, PROMPT, [png]))
    error_line = outs[-1][3]
    assert "turn time limit (90 s) stopped the turn while it read the media" in error_line, error_line
    assert outs[-1][1] == {"text": PROMPT, "files": [png]}  # the question goes back into the input


def test_chat_answer_cut_by_the_time_limit_is_not_called_yours(png, timers):
    h, state = _app(turn_time_limit=90), UserState(model_name=MODEL)
    last = None
    for out in _chat(h, state, PROMPT, [png], max_new=200):
        history = out[0]
        if isinstance(history, list) and history and history[-1]["content"] and timers.made:
            timers.made[-1].fire()
        last = out
    answer = state.history[-1]["content"]
    assert "(stopped by this instance's turn time limit of 90 s after" in answer, answer
    assert "stopped by you" not in answer and last is not None


# -- the queue line: positions read from Gradio's own queue of the compute group ----------------------


class GradioQueue:
    """A real Gradio queue (gradio.queueing) with the app's three kinds of computation in its compute group,
    which a test fills and runs by hand, as Gradio's server would."""

    def __init__(self, h: Callbacks, max_size: int = 16) -> None:
        with gr.Blocks() as self.demo:
            button = gr.Button()
            listeners = {
                kind: button.click(lambda: None, None, None, concurrency_id=COMPUTE_ID, concurrency_limit=1)
                for kind in ("turn", "compare", "load")
            }
        self.demo.queue(max_size=max_size)
        self.queue = self.demo._queue
        self.queue.active_jobs = [None]
        self.fns = {kind: self.demo.fns[listener["id"]] for kind, listener in listeners.items()}
        for kind, listener in listeners.items():
            h.queue.register(kind, listener)
            self.queue.create_event_queue_for_fn(self.fns[kind])
        h.queue.attach(self.demo)
        self.waiting = self.queue.event_queue_per_concurrency_id[COMPUTE_ID].queue

    def send(self, session: str, kind: str) -> Event:
        """An event Gradio accepted: it waits at the end of the queue."""
        event = Event(session, self.fns[kind], request=None, username=None)
        self.waiting.append(event)
        return event

    def start(self, event: Event) -> None:
        """The event reaches the front and its handler runs (Gradio moves it from the queue to a job)."""
        self.waiting.remove(event)
        self.queue.active_jobs[0] = [event]

    def finish(self) -> None:
        self.queue.active_jobs[0] = None


@pytest.fixture
def gradio():
    h = _app()
    return h, GradioQueue(h)


def _said(h, who: str, kind: str = "turn") -> str:
    """What a tick of the page's watch of `who`'s computation of `kind` shows ("" for nothing)."""
    if kind == "turn":
        said, _ = h.turns.where(_who(who))
    else:
        said, _ = h.comparisons.compare_where(_who(who))
    return "" if said == gr.skip() else str(said)


def _as_event(event: Event):
    """Runs the following handler as Gradio runs the handler of `event` (its id in Gradio's context)."""
    return LocalContext.event_id.set(event._id)


def test_positions_are_gradios_rank_for_turns_comparisons_and_loads_alike(gradio):
    """Each line is read once the sender's own event is in Gradio's queue: its rank plus the one running."""
    h, q = gradio
    q.start(q.send("ann", "load"))  # a model load runs
    q.send("bob", "compare")
    said = _said(h, "bob", "compare")
    assert "waiting: position 2" in said and "1 computation(s) ahead" in said, said
    q.send("carol", "turn")
    said = _said(h, "carol")
    assert said.count("waiting: position 3") == 1 and "2 computation(s) ahead" in said, said
    q.send("dan", "compare")
    said = _said(h, "dan", "compare")
    assert "waiting: position 4" in said and "3 computation(s) ahead" in said, said
    q.finish()
    q.start(q.waiting[0])  # the load ended; Bob's comparison runs
    q.send("erin", "turn")
    said = _said(h, "erin")
    assert "waiting: position 4" in said and "3 computation(s) ahead" in said, said  # Bob, Carol, Dan
    assert _said(h, "bob", "compare") == ""  # running: its own progress shows, no position


def test_a_refused_send_shows_no_position_and_counts_for_nobody(monkeypatch):
    monkeypatch.setattr(queue_module, "JOIN_SECONDS", 0.0)  # a send not in Gradio's queue by now was refused
    h = _app()
    q = GradioQueue(h, max_size=1)
    q.start(q.send("ann", "turn"))
    q.send("bob", "turn")  # the queue of one is full
    for _ in range(20):  # Gradio refuses each of these sends: the at-once call says nothing
        assert _said(h, "mallory") == "" and _said(h, "mallory", "compare") == ""
    said = _said(h, "bob")
    assert "waiting: position 2" in said and "1 computation(s) ahead" in said, said  # Ann alone is ahead
    q.finish()
    q.start(q.waiting[0])
    q.finish()  # an idle server: nobody is told to wait
    assert _said(h, "newcomer") == ""


def test_the_pages_watch_ticks_until_the_turn_runs_or_is_not_in_the_queue(gradio, monkeypatch):
    """The send starts the page's watch; its ticks go on while the turn joins and waits, and end once it runs, or
    when it is not in Gradio's queue a moment after the send (refused)."""
    h, q = gradio
    q.start(q.send("ann", "turn"))
    watch, notice = h.turns.queued(_who("zoe"), {"text": "a question"}, None)
    assert watch.active is True and notice == gr.skip()
    said, again = h.turns.where(_who("zoe"))
    assert said == gr.skip() and again.active is True  # not joined yet: no line, the watch goes on
    zoe = q.send("zoe", "turn")
    said, again = h.turns.where(_who("zoe"))
    assert "waiting: position 2" in str(said) and again.active is True
    q.finish()
    q.start(zoe)
    said, again = h.turns.where(_who("zoe"))
    assert said == gr.skip() and again.active is False  # it runs: its own progress shows
    monkeypatch.setattr(queue_module, "JOIN_SECONDS", 0.0)
    h.turns.queued(_who("mallory"), {"text": "a question"}, None)
    said, again = h.turns.where(_who("mallory"))
    assert said == gr.skip() and again.active is False  # refused: nothing shown, the watch ends


def test_a_send_while_the_chats_turn_waits_or_runs_is_refused_in_the_notice(gradio):
    """The page does not send a turn while the chat's previous one is pending: the send says so in one line and
    starts no watch; another chat's send is unaffected."""
    from ui.status import SEND_REFUSED

    h, q = gradio
    ann = q.send("ann", "turn")
    q.start(ann)
    q.send("bob", "turn")
    for who in ("ann", "bob"):  # ann's turn runs, bob's waits
        watch, notice = h.turns.queued(_who(who), {"text": "another question"}, None)
        assert watch == gr.skip() and notice == SEND_REFUSED and "\n" not in notice, who
    watch, notice = h.turns.queued(_who("carol"), {"text": "a question"}, None)
    assert watch.active is True and notice == gr.skip()


def test_a_cancelled_turn_no_longer_counts(gradio):
    """New chat cancels a waiting turn: Gradio takes it out of its queue, and with it out of every position."""
    h, q = gradio
    q.start(q.send("ann", "turn"))
    cancelled = q.send("alice", "turn")
    q.send("bob", "turn")
    assert "position 3" in _said(h, "bob")
    q.waiting.remove(cancelled)
    assert "position 2" in _said(h, "bob")


def test_stop_while_a_turn_waits_withdraws_it(gradio, png):
    h, q = gradio
    state = UserState(model_name=MODEL)
    q.start(q.send("bob", "turn"))
    alices = [q.send("alice", "turn"), q.send("alice", "turn")]  # sent with Enter and with Send
    assert h.turns.stop(_who("alice"), state) == progress_html(0, 1, WITHDRAWN_TURN)
    for event in alices:  # when each comes up, it does not run
        q.start(event)
        token = _as_event(event)
        outs = list(_chat(h, state, PROMPT, [png]))
        LocalContext.event_id.reset(token)
        assert len(outs) == 1 and WITHDRAWN_TURN in outs[0][4] and state.history == []
        assert outs[0][1] == gr.skip()  # the question stays in the input box
    resent = q.send("alice", "turn")  # her next send runs
    q.start(resent)
    token = _as_event(resent)
    outs = list(_chat(h, state, PROMPT, [png]))
    LocalContext.event_id.reset(token)
    assert len(state.history) == 2 and outs[-1][4].count("done") == 1


def test_stop_while_a_comparison_waits_withdraws_it(gradio, png):
    h, q = gradio
    state = UserState(model_name=MODEL)
    q.start(q.send("bob", "turn"))
    waiting = q.send("alice", "compare")
    assert h.turns.stop(_who("alice"), state) == gr.skip()  # the chat's Stop: no turn of hers waits
    assert h.comparisons.stop_compare(_who("alice"), state) == WITHDRAWN_COMPARE
    q.start(waiting)
    token = _as_event(waiting)
    assert [out[2] for out in _compare(h, state, png, ["full"])] == [WITHDRAWN_COMPARE]
    LocalContext.event_id.reset(token)
    statuses = [out[2] for out in _compare(h, state, png, ["full"])]  # her next comparison runs
    assert statuses[-1].startswith("done: 1 methods"), statuses
    assert h.comparisons.stop_compare(_who("alice"), state) == gr.skip()  # nothing waits or runs: nothing to stop


def test_without_gradio_nothing_is_waiting_and_nothing_is_withdrawn(png):
    """Handlers called outside Gradio (no queue attached, no event): no line, every computation runs."""
    h, state = _app(), UserState(model_name=MODEL)
    assert h.turns.stop(_who("alice"), state) == gr.skip()
    outs = list(_chat(h, state, PROMPT, [png]))
    assert len(state.history) == 2 and outs[-1][4].count("done") == 1


def test_new_chat_and_load_model_clear_compares_results():
    h, state = _app(), UserState(model_name=MODEL)
    outs = h.turns.new_chat(state, "full", "reuse")
    assert outs[-4:] == ([], None, "", "")  # Compare's table, chart, status and whole-answer line
    outs = h.loading.load_model(_who("alice"), MODEL, "", state, progress=lambda *a, **k: None)
    assert "Loaded" in outs[4] and outs[-4:] == ([], None, "", "")
    failed = h.loading.load_model(_who("alice"), "no/such-model-here", "", state, progress=lambda *a, **k: None)
    assert all(out == gr.skip() for out in failed[-4:])  # a failed load keeps them


def test_compares_default_ticks_suit_the_media(tmp_path, png):
    from visualkv.bench.synthetic import write_video_file

    h = _app()
    h.comparisons.method_names = [
        "full",
        "blockwise-keydiff",
        "blockwise-snapkv",
        "post-snapkv",
        "salicache",
        "lightkv",
        "evs",
    ]
    image_ticks = ["full", "blockwise-snapkv", "post-snapkv", "lightkv"]
    video_ticks = [*image_ticks[:3], "salicache", "lightkv", "evs"]  # EVS beside Sali-Cache, in menu order
    video = write_video_file(str(tmp_path / "clip.mp4"), n_frames=4, width=64, height=64)
    assert h.comparisons.ticks_for_media(None, video, image_ticks) == video_ticks
    assert h.comparisons.ticks_for_media(None, png, video_ticks) == image_ticks
    chat_on_video = UserState(model_name=MODEL, media_path=video)
    assert {"salicache", "evs"} <= set(h.comparisons.ticks_for_media(chat_on_video, None, image_ticks))
    assert h.comparisons.ticks_for_media(None, video, ["full", "lightkv"]) == gr.skip()  # the user's own ticks stay


def test_blocks_per_vision_tower_call_reaches_the_chat_and_a_bad_value_is_one_line(png):
    """The app's 'blocks per vision-tower call' field is the CLI's --vision-ahead: it reaches the chat's config
    (and so the engine and the report), and 0 or a fraction is refused in one line before anything runs."""
    h, state = _app(), UserState(model_name=MODEL)
    outs = list(_chat(h, state, PROMPT, [png], method="blockwise-keydiff", vision_ahead=4))
    assert outs[-1][3] == "", outs[-1][3]
    assert state.session.config.vision_ahead == 4
    for bad in (0, 2.5, None):
        h, state = _app(), UserState(model_name=MODEL)
        (out,) = list(_chat(h, state, PROMPT, [png], method="blockwise-keydiff", vision_ahead=bad))
        assert "blocks per vision-tower call" in out[3] and "\n" not in out[3], out[3]
        assert state.session is None and out[2] is state


def test_a_clicked_compare_row_shows_its_method_and_whole_answer():
    """The table shows one line of each answer; a click on any cell of a row shows that row's whole answer,
    literally (Markdown characters escaped)."""
    from ui.compare import whole_answer

    row = ["lightkv", "19%", "83.9%", 0.122, 0.122, 0.346, "a *long* answer " * 20]
    line = whole_answer(gr.SelectData(None, {"index": [2, 1], "value": "19%", "row_value": row}))
    assert line.startswith("**lightkv**: ") and line.count("long") == 20 and "*long*" not in line, line
    assert whole_answer(gr.SelectData(None, {"index": [0, 0], "value": "", "row_value": None})) == ""
