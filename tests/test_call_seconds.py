"""The GPU seconds a call asks for (visualkv.runtime.calls): measured speeds, the evidence pass, the bounds.

Expected values are worked out by hand here from the documented rule: the setup (20 s), plus 1.5 times the plan's
work (prompt tokens x billions / prefill rate + answer tokens x billions / decode rate + blocks x 0.02 s), rounded
up, at most ZeroGPU's 300 s.
"""

from __future__ import annotations

import dataclasses
import math

from tests.conftest import get_adapter
from visualkv.report.telemetry import TurnRecord
from visualkv.runtime import streaming
from visualkv.runtime.calls import (
    MIN_CALL_SECONDS,
    ZERO_GPU_MAX_SECONDS,
    SpeedLog,
    TurnPlan,
    call_seconds,
    compare_plan,
    compare_seconds,
    turn_plan,
)
from visualkv.runtime.session import ChatSession, SessionConfig

#: 10k prompt tokens in 10 blocks, 100 answer tokens, a 7B model
PLAN = TurnPlan(prompt_tokens=10_000, blocks=10, answer_tokens=100, billions=7.0)
#: at the constants (7000 prefill, 100 decode tokens/s per billion): 20 + 1.5 (10 + 7 + 0.2) = 45.8
CONSTANT_SECONDS = 46


def _turn(prefill_seconds: float, decode_rate: float, answer_tokens: int = 100, **more) -> TurnRecord:
    ids = list(range(answer_tokens))
    return TurnRecord(
        prompt="q", prefill_seconds=prefill_seconds, decode_tokens_per_second=decode_rate, token_ids=ids, **more
    )


def _after(*turns: TurnRecord) -> int:
    log = SpeedLog()
    for turn in turns:
        log.record(PLAN, turn)
    return call_seconds(PLAN, log.speed())


SLOW, FAST = _turn(20.0, 5.0), _turn(2.0, 50.0)


def test_before_any_measurement_a_call_asks_the_constant_speeds_seconds():
    assert call_seconds(PLAN) == _after() == CONSTANT_SECONDS


def test_a_measured_slow_turn_makes_the_next_request_larger_and_a_fast_one_smaller():
    assert _after(SLOW) == 81 > CONSTANT_SECONDS  # 20 + 1.5 (20 + 100 / 5 + 0.2) = 80.3
    assert _after(FAST) == 27 < CONSTANT_SECONDS  # 20 + 1.5 (2 + 100 / 50 + 0.2) = 26.3


def test_one_fast_turn_does_not_shrink_the_request_after_a_slow_one():
    assert _after(SLOW, FAST) == _after(FAST, SLOW) == 81
    assert _after(SLOW, *[FAST] * 8) == 27  # the slow one has left the recent measurements


def test_a_request_stays_between_the_setup_and_zero_gpus_limit():
    assert call_seconds(PLAN, time_limit=0) == MIN_CALL_SECONDS  # a limit of 0 stops the turn at once
    assert _after(_turn(1_000.0, 0.5)) == ZERO_GPU_MAX_SECONDS
    assert _after(_turn(1e-6, 1e9)) == 21  # 20 + 1.5 (0 + 0 + 0.2) = 20.3
    assert call_seconds(TurnPlan(1, 0, 1, 0.5), SpeedLog().speed()) >= MIN_CALL_SECONDS


def test_a_followups_prefill_is_not_a_speed_and_a_reports_dict_is_one():
    log = SpeedLog()
    log.record(dataclasses.replace(PLAN, prompt_tokens=40), _turn(20.0, 5.0))  # a few tokens: overhead, not a rate
    assert log.prefill == () and log.decode == (35.0,)  # 5 tokens/s of a 7B model: 35 per billion
    log.record(PLAN, {"prefill_seconds": 20.0, "decode_tokens_per_second": 0.0})  # a compare report's turn
    assert log.prefill == (3_500.0,) and log.decode == (35.0,)


def test_only_answers_that_measure_a_rate_count_and_without_their_decoders_setup():
    log = SpeedLog()
    log.record(PLAN, _turn(20.0, 5.0, answer_tokens=4))  # an example card's few tokens: fixed costs
    log.record(PLAN, _turn(20.0, 5.0, stopped="stopped"))  # stopped: its time says nothing of a rate
    log.record(PLAN, _turn(20.0, 5.0, stopped="time_limit"))
    assert log.decode == ()
    # 33 tokens: 32 steps at 8 tokens/s is 4 s, of which 2 s built the decoder: 16 tokens/s, 112 per billion
    log.record(PLAN, _turn(20.0, 8.0, answer_tokens=33, decode_setup_seconds=2.0))
    assert log.decode == (112.0,)
    log.record(dataclasses.replace(PLAN, prompt_tokens=378), _turn(0.5, 8.0, answer_tokens=2))  # a small image
    assert log.prefill == (3_500.0,) * 4  # the four 10k-token prefills only


def _config(evidence: bool) -> SessionConfig:
    return SessionConfig(method="blockwise-keydiff", budget=40, block_size=64, max_new_tokens=4, evidence=evidence)


def test_a_turn_with_evidence_counts_the_uncompressed_pass(small_image):
    adapter = get_adapter("tiny-qwen2.5-vl")
    prepared = adapter.prepare(small_image, "What?")
    visual_blocks = math.ceil(prepared.layout.n_visual / adapter.default_block_size) + 2
    plain = turn_plan(ChatSession(adapter, _config(False)), "What?", small_image)
    first = turn_plan(ChatSession(adapter, _config(True)), "What?", small_image)
    assert (plain.evidence_tokens, plain.evidence_blocks) == (0, 0)
    assert first.evidence_tokens == prepared.seq_len + 4 and first.evidence_blocks == visual_blocks
    seven_b = {"billions": 7.0}  # the tiny model's seconds round to the setup's
    assert call_seconds(dataclasses.replace(first, **seven_b)) > call_seconds(dataclasses.replace(plain, **seven_b))
    session = ChatSession(adapter, _config(True))
    list(streaming.stream_turn(session, "What?", small_image))
    followup = turn_plan(session, "And?", None)
    question = adapter.followup_ids("And?").shape[0] + 1
    assert followup.evidence_tokens == session.sequence_length + question + 4


def test_a_comparison_with_the_evidence_column_counts_a_pass_per_method(small_image):
    adapter = get_adapter("tiny-qwen2.5-vl")
    plans = (compare_plan(adapter, _config(e), "What?", small_image) for e in (False, True))
    without, with_evidence = (dataclasses.replace(p, billions=7.0) for p in plans)  # seconds beyond the rounding
    assert with_evidence.evidence_tokens > 0 and without.evidence_tokens == 0
    assert compare_seconds(with_evidence, 3) > compare_seconds(without, 3)
    # by hand, at the constants: 20 + 3 x 1.5 x the work of one method's turn and its pass
    scale = 7.0
    tokens = with_evidence.prompt_tokens + with_evidence.evidence_tokens
    work = tokens * scale / 7_000 + 4 * scale / 100 + (with_evidence.blocks + with_evidence.evidence_blocks) * 0.02
    assert compare_seconds(with_evidence, 3) == math.ceil(20 + 3 * 1.5 * work)
