"""What a first visitor meets, below the browser: the default budget (keep % of the visual tokens), the one-line
refusals of bad numbers, the plain words for every method, evidence recall put in context from the committed
needle results, and Stop reaching an evidence pass."""

from __future__ import annotations

import json
import re
import threading
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from ui import evidence, text
from ui.forms import DEFAULTS
from visualkv.errors import ConfigError, PrefillStopped
from visualkv.methods import method_names, method_traits
from visualkv.report.tables import summary_line

NEEDLE = Path(__file__).resolve().parent.parent / "docs" / "results" / "evidence_needle.json"


def test_the_default_budget_is_a_tenth_of_the_visual_tokens_and_a_fixed_one_replaces_it():
    cfg = DEFAULTS.session_config([])
    assert cfg.keep == pytest.approx(0.1) and cfg.budget is None
    assert cfg.resolved(10_549).budget == 1055 and cfg.resolved(7).budget == 1  # at least one entry
    fixed = replace(DEFAULTS, budget=256).session_config([])
    assert fixed.budget == 256 and fixed.keep is None


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("keep", 0, "keep % must be above 0"),
        ("keep", 101, "keep % must be above 0 and at most 100"),
        ("keep", None, "keep % is empty or not a number"),
        ("budget", -5, "budget M must be a whole number"),
        ("max_new", None, "max new tokens is empty or not a number (too large, e.g. 1e999?)"),
        ("temperature", float("inf"), "temperature must be"),
    ],
)
def test_a_bad_number_is_one_line_naming_its_field(field, value, words):
    with pytest.raises(ConfigError) as refused:
        replace(DEFAULTS, **{field: value}).session_config([])
    assert words in str(refused.value) and "\n" not in str(refused.value), str(refused.value)


def test_a_bad_keep_is_refused_beside_a_fixed_budget_too():
    """A fixed budget M makes keep % unused, yet a bad value typed there is said, not silently ignored."""
    with pytest.raises(ConfigError, match="^keep % must be above 0"):
        replace(DEFAULTS, budget=256, keep=0).session_config([])


def test_the_summary_says_the_figure_a_keep_share_became():
    report = {"visual_tokens": 10549, "budget": 1055, "keep": 0.1, "peak_kv_bytes": 1, "full_kv_bytes": 9}
    assert summary_line(report).startswith("10549 visual tokens, keep 10 % = budget 1,055 per layer and KV head")
    assert ", budget 256 per layer" in summary_line({**report, "budget": 256, "keep": None})
    assert summary_line({**report, "budget": None}).startswith("10549 visual tokens ·")  # a method without one


def test_every_method_has_a_plain_line_and_the_jargon_is_behind_a_toggle():
    for name in method_names():
        plain = text.plain_description(name)
        assert plain and plain != method_traits(name).description, name
        assert not re.search(r"KV|FP|INT8|query-aware|prefill", plain), (name, plain)
        line = text.method_line(name)
        assert line.index(plain) < line.index("<details>"), line  # plain first, the class's words on demand
    listed = text.methods_in_plain_words(method_names())
    assert all(f"**{name}**" in listed for name in method_names())
    for word in ("KV head", "block", "tiers"):
        assert word in text.GLOSSARY


def test_evidence_recall_is_put_in_context_from_the_committed_needle_results():
    data = json.loads(NEEDLE.read_text())
    ranged = [b for b in data["accuracy_by_recall"] if b["bucket"].startswith("[")]
    assert len(ranged) >= 3
    for bucket in ranged:
        low, high = (float(x) for x in bucket["bucket"].strip("[)").split(","))
        sentence = evidence.needle_context((low + high) / 2)
        assert f"in {bucket['bucket']} were right {bucket['accuracy']:.0%}" in sentence, sentence
        assert f"({bucket['n']} answers)" in sentence and data["model"] in sentence


class _Session:
    """A chat with a finished turn whose evidence pass runs until Stop (checked as the engine checks it)."""

    media = object()

    def __init__(self, state, active: dict) -> None:
        self.state, self.active, self.seen = state, active, None

    def compute_evidence(self, on_block=None, stop: threading.Event | None = None):
        self.seen = self.active.get(id(self.state))  # what the chat's Stop finds running
        self.state.stop.set()  # the chat's Stop, pressed while the pass runs
        if stop is not None and stop.is_set():
            raise PrefillStopped()


def test_the_chat_s_stop_finds_and_ends_an_evidence_pass_with_a_final_line():
    state, active = SimpleNamespace(report={"turns": []}, report_path=None), {}
    state.session = session = _Session(state, active)
    note, image, _, _, line = evidence.compute(state, "average", 0.6, progress=lambda *a, **k: None, active=active)
    assert session.seen == "evidence" and id(state) not in active  # named while it ran, gone after
    assert note == evidence.EVIDENCE_STOPPED and image is None
    assert evidence.EVIDENCE_STOPPED in line
