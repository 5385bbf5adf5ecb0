"""A scripted attack on a shared instance, end to end over raw HTTP: `app.py --public` on 127.0.0.1.

One app process (a random-weight tiny model, a short turn time limit, a queue of two). The attacker speaks
Gradio's own protocol as a browser does (`queue/join`, the `queue/data` event stream, `run/predict` for the
at-once events, `call/<name>` for the API), with made-up session ids. Checked:
- a 1 MB question ends (refused, one line) within the time limit + 1 s, and the next visitor's turn starts in time;
- one session re-joining every 0.25 s cannot keep another visitor's turn from running within one time limit;
- every position a visitor is shown is Gradio's rank of its event plus the one running, never more than the
  computations that exist, and a refused send is shown none;
- every bad value (NaN, ±Infinity, a string, a choice not in the list, a number out of range) sent to every input
  of every endpoint gets the app's one line naming the field, and the server log holds no traceback.
Measured times are printed (`-s`).
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.app_process import app_process

httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.slow

MODEL = "tiny-qwen2.5-vl"
TIME_LIMIT = 5.0  # --turn-time-limit: a long answer of the tiny model runs into it
MAX_QUEUE = 2
CLIENT_SESSIONS = 4  # --max-client-sessions: every visitor here has the same address
LONG_ANSWER = 512  # max new tokens: a turn that runs until the time limit stops it
SLACK = 1.0  # what "within the limit" allows on top, on a loaded machine
EMPTY_QUESTION = {"text": "", "files": []}
ASKED = {"text": "What?", "files": []}  # the chat's question beside a bad value elsewhere: only that one is refused
POSITION = re.compile(r"position (\d+) in the queue \((\d+) computation")


def _post(url: str, body: dict, timeout: float = 60):
    """POST `body` as JSON as any script may write it: NaN and ±Infinity included (httpx's own encoder refuses)."""
    return httpx.post(url, content=json.dumps(body), headers={"content-type": "application/json"}, timeout=timeout)


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """The shared app; yields (base URL of its API, its log file)."""
    args = ["--public", "--model", MODEL, "--max-queue", str(MAX_QUEUE), "--turn-time-limit", str(TIME_LIMIT)]
    args += ["--max-client-sessions", str(CLIENT_SESSIONS)]
    with app_process(args, tmp_path_factory.mktemp("attack")) as (url, _, log_path):
        yield Api(f"{url}/gradio_api"), log_path


class Api:
    """The app's endpoints as its config describes them: each event's id and its inputs' default values."""

    def __init__(self, base: str) -> None:
        self.base = base
        config = httpx.get(base.removesuffix("/gradio_api") + "/config", timeout=60).json()
        values = {c["id"]: c.get("props", {}).get("value") for c in config["components"]}
        self.fns = {d["api_name"]: d for d in config["dependencies"] if d.get("api_name")}
        self.states = {c["id"] for c in config["components"] if c.get("type") == "state"}
        self.defaults = {name: [values.get(i) for i in d["inputs"]] for name, d in self.fns.items()}
        self.info = httpx.get(base + "/info", timeout=60).json()["named_endpoints"]

    def api_inputs(self, name: str) -> list[int]:
        """The component ids of `name`'s API parameters (its inputs less the session states)."""
        return [i for i in self.fns[name]["inputs"] if i not in self.states]

    def turn_data(self, question: str, max_new: int = 8) -> list:
        """The chat event's inputs: the question, the form's defaults, `max_new` answer tokens."""
        data = list(self.defaults["chat"])
        data[0] = {"text": question, "files": []}
        data[self.input_index("chat", "max new tokens")] = max_new
        return data

    def input_index(self, name: str, label: str) -> int:
        params = [p for p in self.info["/" + name]["parameters"]]
        api_index = next(i for i, p in enumerate(params) if p["label"] == label)
        return api_index + 1  # the chat's state, not an API parameter, comes second

    def call_any(self, name: str, data: list) -> tuple[str, str]:
        """`call` for a queued event; an at-once one as the page sends it (`run/predict`, the states as None)."""
        fn = self.fns[name]
        if fn["queue"] is not False:
            return self.call(name, data)
        values = iter(data)
        full = [None if i in self.states else next(values) for i in fn["inputs"]]
        body = {"data": full, "fn_index": fn["id"], "session_hash": uuid.uuid4().hex[:11]}
        r = _post(f"{self.base}/run/predict", body)
        return ("error" if r.status_code != 200 or "error" in r.json() else "complete"), r.text

    def call(self, name: str, data: list, timeout: float = 120) -> tuple[str, str]:
        """`call/<name>` (the documented API): ("complete" or "error", its data) or ("http <code>", detail)."""
        r = _post(f"{self.base}/call/{name}", {"data": data}, timeout)
        if r.status_code != 200:
            return f"http {r.status_code}", r.text
        event_id, kind = r.json()["event_id"], ""
        with httpx.stream("GET", f"{self.base}/call/{name}/{event_id}", timeout=timeout) as stream:
            for line in stream.iter_lines():
                if line.startswith("event: "):
                    kind = line[7:]
                elif line.startswith("data: ") and kind in ("complete", "error"):
                    return kind, line[6:]
        return "closed", ""


class Visitor:
    """One browser session, speaking the page's protocol: at-once events and queued ones with their stream."""

    def __init__(self, api: Api) -> None:
        self.api, self.session = api, uuid.uuid4().hex[:11]
        self.messages: list[tuple[float, dict]] = []  # (when, message) from the queue's event stream
        self._stream: threading.Thread | None = None  # opened after a join, as the page does (Gradio keeps the
        # session's messages until then); it closes once the session has nothing pending

    def _listen(self) -> None:
        url = f"{self.api.base}/queue/data?session_hash={self.session}"
        try:
            with httpx.stream("GET", url, timeout=None) as stream:
                for line in stream.iter_lines():
                    if line.startswith("data: "):
                        self.messages.append((time.monotonic(), json.loads(line[6:])))
        except httpx.HTTPError:
            pass

    def at_once(self, name: str, data: list):
        fn = self.api.fns[name]
        body = {"data": data, "fn_index": fn["id"], "session_hash": self.session, "trigger_id": None}
        return _post(f"{self.api.base}/run/predict", body).json()

    def join(self, name: str, data: list) -> tuple[int, str]:
        fn = self.api.fns[name]
        body = {"data": data, "fn_index": fn["id"], "session_hash": self.session, "trigger_id": None}
        r = _post(f"{self.api.base}/queue/join", body)
        if r.status_code == 200 and (self._stream is None or not self._stream.is_alive()):
            self._stream = threading.Thread(target=self._listen, daemon=True)
            self._stream.start()
        return r.status_code, r.json().get("event_id") or r.json().get("detail", "")

    def send(self, question: str, max_new: int = 8) -> dict:
        """What the page does on Send: the at-once call that starts its queue watch, the turn's join, then one
        tick of the watch. Returns the position that tick showed (or None), the join's status and event id (or
        refusal), and when it was sent and the tick answered."""
        data = self.api.turn_data(question, max_new)
        out: dict = {"sent": time.monotonic()}
        self.at_once("queued", [data[0], None])
        out["status"], out["event"] = self.join("chat", data)
        out["shown"] = self.at_once("where", [])
        out["answered"] = time.monotonic()
        return out

    def seen(self, event_id: str, msg: str) -> list[tuple[float, dict]]:
        return [(t, m) for t, m in self.messages if m.get("event_id") == event_id and m.get("msg") == msg]

    def wait_for(self, event_id: str, msg: str, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if found := self.seen(event_id, msg):
                return found[0][0]
            time.sleep(0.05)
        raise AssertionError(f"no {msg} for {event_id} within {timeout} s")


def shown_position(answer: dict) -> tuple[int, int] | None:
    """(position, computations ahead) in the waiting line the at-once event returned, or None."""
    text = json.dumps(answer.get("data"))
    found = POSITION.search(text)
    return (int(found.group(1)), int(found.group(2))) if found else None


def test_attack(app):
    api, log = app
    times = {}
    warm = Visitor(api)
    warm.wait_for(warm.send("Warm up?")["event"], "process_completed", 120)  # first calls load kernels
    times["1 MB question"], times["next visitor waited"] = _huge_question(api)
    times["positions checked"] = _positions(api)
    times["victim waited"] = _victim(api)
    times["bad values refused"] = _bad_values(api)
    print("\nattack:", json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in times.items()}))
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]


def _huge_question(api: Api) -> tuple[float, float]:
    """A 1 MB question ends, refused in one line, within the limit + 1 s; the next visitor's turn then starts in
    time too."""
    attacker, victim = Visitor(api), Visitor(api)
    sent = attacker.send("x" * 1_000_000)
    assert sent["status"] == 200, sent
    done = attacker.wait_for(sent["event"], "process_completed", TIME_LIMIT + SLACK)
    took = done - sent["sent"]
    output = json.dumps(attacker.seen(sent["event"], "process_completed")[0][1])
    assert "the question is too long: at most 2,048 tokens on this shared instance" in output, output[:500]
    asked = victim.send("What is shown?")
    started = victim.wait_for(asked["event"], "process_starts", TIME_LIMIT + SLACK)
    victim.wait_for(asked["event"], "process_completed", 60)
    assert took <= TIME_LIMIT + SLACK
    return took, started - asked["sent"]


def _positions(api: Api) -> int:
    """A running turn, then eight forged sessions sending at once. Each position shown must be the queue's state
    at some moment between the send and the answer, as Gradio's own messages tell it: the event's rank among
    those not yet started, plus one running; none for an event that runs, for a refused send always none.
    No position exceeds the computations that exist."""
    runner = Visitor(api)
    running = runner.send("A long answer?", LONG_ANSWER)
    runner.wait_for(running["event"], "process_starts", 30)
    flood = [Visitor(api) for _ in range(8)]
    sends: list[dict] = [{} for _ in flood]
    threads = [
        threading.Thread(target=lambda v=v, i=i: sends[i].update(v.send("Me first?"))) for i, v in enumerate(flood)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    accepted = [(v, s) for v, s in zip(flood, sends) if s["status"] == 200]
    refused = [s for s in sends if s["status"] != 200]
    assert 0 < len(accepted) <= MAX_QUEUE and len(refused) == len(flood) - len(accepted), sends
    for visitor, sent in accepted:
        visitor.wait_for(sent["event"], "process_completed", 60)
    runner.wait_for(running["event"], "process_completed", 60)
    timeline = Timeline([(runner, running), *accepted])
    exist = 1 + len(accepted)  # the running turn and the accepted ones
    for visitor, sent in accepted:
        shown = shown_position(sent["shown"])
        truths = timeline.positions(sent["event"], sent["sent"], sent["answered"])
        assert shown in truths, (sent["shown"], truths)
        assert shown is None or shown[0] <= exist
    for sent in refused:
        assert shown_position(sent["shown"]) is None, sent["shown"]
        assert "\n" not in sent["event"], sent["event"]
    return len(sends)


class Timeline:
    """The queue's states as Gradio's messages tell them: each event's rank when it joined, its start, its end."""

    def __init__(self, events: list[tuple[Visitor, dict]]) -> None:
        self.rank, self.start, self.end = {}, {}, {}
        for visitor, sent in events:
            event = sent["event"]
            estimations = visitor.seen(event, "estimation")
            self.rank[event] = estimations[0][1]["rank"] if estimations else -1
            self.start[event] = visitor.seen(event, "process_starts")[0][0]
            self.end[event] = visitor.seen(event, "process_completed")[0][0]

    def position(self, event: str, t: float) -> tuple[int, int] | None:
        """(position, computations ahead) of `event` at `t`; None once it started."""
        if self.start[event] <= t:
            return None
        waiting = sum(1 for e, r in self.rank.items() if r < self.rank[event] and self.start[e] > t)
        running = sum(1 for e in self.rank if self.start[e] <= t < self.end[e])
        return waiting + running + 1, waiting + running

    def positions(self, event: str, since: float, until: float) -> set:
        """Every state of `event` from `since` to `until`."""
        moments = [since, until, *(t for t in (*self.start.values(), *self.end.values()) if since < t < until)]
        return {self.position(event, t) for t in moments} | {self.position(event, t + 1e-6) for t in moments}


def _victim(api: Api) -> float:
    """One session re-joins every 0.25 s with long turns; another visitor's turn runs within one time limit."""
    attacker, victim = Visitor(api), Visitor(api)
    data = api.turn_data("Again?", LONG_ANSWER)
    first = attacker.join("chat", data)
    assert first[0] == 200, first
    attacker.wait_for(first[1], "process_starts", 30)
    stop = threading.Event()
    refusals: list[str] = []

    def rejoin() -> None:
        while not stop.is_set():
            status, detail = attacker.join("chat", data)
            if status != 200:
                refusals.append(detail)
            time.sleep(0.25)

    thread = threading.Thread(target=rejoin, daemon=True)
    thread.start()
    try:
        time.sleep(1.0)
        asked = victim.send("My turn?")
        assert asked["status"] == 200, asked
        started = victim.wait_for(asked["event"], "process_starts", TIME_LIMIT + SLACK + 5)
        victim.wait_for(asked["event"], "process_completed", 60)
    finally:
        stop.set()
        thread.join()
    waited = started - asked["sent"]
    assert refusals and all("one computation at a time per chat" in r for r in refusals), refusals[:3]
    assert waited <= TIME_LIMIT + SLACK, f"the victim waited {waited:.2f} s"
    time.sleep(TIME_LIMIT + 2)  # the attacker's last turn ends
    return waited


def _bad_values(api: Api) -> int:
    """Bad values: each kind to each endpoint, and one to each input (an input several endpoints share, e.g. the
    settings form, gets its own to one of them). Queued events over `call/<name>`, the at-once ones as the page
    sends them (`run/predict`). Each gets one line naming the field: the event's error, or for a number one can
    type in the form, the turn's own error line."""
    calls: list[tuple] = []
    covered: set[int] = set()
    for name, endpoint in api.info.items():
        calls += _planned(name.lstrip("/"), endpoint["parameters"], api.api_inputs(name.lstrip("/")), covered)
    with ThreadPoolExecutor(MAX_QUEUE) as pool:  # no more at once than the queue holds
        answers = list(pool.map(lambda c: api.call_any(c[0], c[2]), calls))
    for (name, label, _, bad), (kind, detail) in zip(calls, answers):
        line = _refusal_line(kind, detail)
        assert line and "\n" not in line, (name, label, bad, kind, detail[:300])
        named = label in line or (label.startswith("parameter_") and "question" in line)
        assert named, (name, label, bad, line)
    return len(calls)


def _refusal_line(kind: str, detail: str) -> str:
    """The one line refusing a call: the event's error (the app's check before Gradio reads the values), or the
    error line the event shows, as the page does (a form field's range is the turn's own first check)."""
    if kind == "error":
        return json.loads(detail).get("error") or ""
    if kind != "complete":
        return ""
    shown = [v for v in json.loads(detail) if isinstance(v, str) and v.startswith("⚠️")]
    return shown[0] if len(shown) == 1 else ""


def _planned(name: str, params: list[dict], inputs: list[int], covered: set[int]) -> list[tuple]:
    """(endpoint, label, data, bad value) for one endpoint: a bad value to each input not `covered` yet (kinds
    taking turns), then each kind its inputs take that is still missing."""
    calls: list[tuple] = []
    sent: set[str] = set()

    def send(index: int, bad) -> None:
        sent.add(repr(bad))
        data = [ASKED if p.get("parameter_default") == EMPTY_QUESTION else p.get("parameter_default") for p in params]
        data[index] = bad
        calls.append((name, params[index]["label"], data, bad))

    for index, (param, component) in enumerate(zip(params, inputs)):
        if component not in covered:
            covered.add(component)
            kinds = _bad_kinds(param)
            send(index, next((k for k in kinds if repr(k) not in sent), kinds[index % len(kinds)]))
    for index, param in enumerate(params):
        for bad in _bad_kinds(param):
            if repr(bad) not in sent:
                send(index, bad)
    return calls


def _bad_kinds(param: dict) -> list:
    """The bad values for one input, by what it takes (its API type). The overlay opacity takes any finite number
    (its callback clamps it to 0..1, as typed on the page)."""
    kind = json.dumps(param.get("type", {}))
    if '"number"' in kind or '"integer"' in kind:
        out_of_range = [] if param.get("label") == "overlay opacity" else [-1e12]
        return [float("nan"), float("inf"), -float("inf"), "abc", *out_of_range]
    if '"enum"' in kind:
        return ["not-a-choice", float("nan")]
    if '"boolean"' in kind:
        return ["abc", float("nan")]
    if '"string"' in kind and "FileData" not in kind:
        return [float("inf"), {"a": 1}]
    return [float("nan")]
