"""Evidence recall (visualkv.runtime.evidence): exact cases, monotonicity, the report, and an independent
reference from the model's own eager attention weights."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import get_adapter
from visualkv.models.registry import _adapter
from visualkv.models.synthetic.tiny import build_tiny
from visualkv.runtime.memory_guard import MemoryGuard, MemoryGuardError
from visualkv.runtime.session import ChatSession, SessionConfig

PROMPT = "What is in the picture?"


def _ask(adapter, media, method="full", budget=None, followup=None, guard=None, **config):
    session = ChatSession(
        adapter, SessionConfig(method=method, budget=budget, evidence=True, **{"max_new_tokens": 4, **config}), guard
    )
    session.ask(PROMPT, media)
    if followup:
        session.ask(followup)
    return session


@pytest.mark.parametrize("followup", [None, "And the colours?"])
def test_full_gives_exactly_one(adapter, small_image, small_video, followup):
    for media in (small_image, small_video):
        session = _ask(adapter, media, followup=followup)
        assert session.evidence.recall == 1.0
        assert session.evidence.recall_per_layer == [1.0] * adapter.num_layers
        shares = session.evidence.map_per_layer
        assert shares.shape == (adapter.num_layers, session.prepared.layout.n_visual)
        assert np.allclose(shares.sum(axis=1), 1.0, atol=1e-4)


def test_budget_at_or_above_the_visual_tokens_gives_one(adapter, small_image):
    n_visual = _ask(adapter, small_image, max_new_tokens=1).prepared.layout.n_visual
    for method in ("blockwise-keydiff", "blockwise-snapkv", "blockwise-random"):
        for budget in (n_visual, n_visual + 50):
            assert _ask(adapter, small_image, method, budget, block_size=64).evidence.recall == 1.0
    assert _ask(adapter, small_image, "blockwise-keydiff", n_visual - 8, block_size=64).evidence.recall < 1.0


def test_same_figure_whatever_the_block_size_when_nothing_is_evicted(small_image):
    adapter = get_adapter("tiny-smolvlm2")  # its blocks hold whole tiles: answers equal whatever the block size
    n_visual = _ask(adapter, small_image, max_new_tokens=1).prepared.layout.n_visual
    runs = [
        _ask(adapter, small_image, "blockwise-keydiff", n_visual, block_size=b, prefill="blockwise")
        for b in (16, 64, 1024)
    ]
    assert [r.evidence.recall for r in runs] == [1.0, 1.0, 1.0]
    assert all(r.turns[-1].token_ids == runs[0].turns[-1].token_ids for r in runs)
    for run in runs[1:]:
        assert np.allclose(run.evidence.map_per_layer, runs[0].evidence.map_per_layer, atol=1e-6)


def test_recall_drops_monotonically_as_a_fixed_ranking_keeps_fewer(adapter, small_image):
    """blockwise-random with one seed ranks tokens by fixed priorities: a smaller budget keeps a subset. One
    answer token: the query is the last prompt token whatever the answer, so the map is the same for every run."""
    n_visual = _ask(adapter, small_image, max_new_tokens=1).prepared.layout.n_visual
    budgets = [n_visual, 3 * n_visual // 4, n_visual // 2, n_visual // 4, 8, 1]
    recalls = [
        _ask(adapter, small_image, "blockwise-random", b, max_new_tokens=1, block_size=48).evidence.recall
        for b in budgets
    ]
    assert recalls[0] == 1.0
    assert all(a > b for a, b in itertools.pairwise(recalls)), recalls
    assert recalls[-1] < 0.1


def test_report_carries_recall_per_layer_and_map(small_image):
    adapter = get_adapter("tiny-qwen2.5-vl")
    session = _ask(adapter, small_image, "blockwise-keydiff", 24)
    report = json.loads(json.dumps(session.report()))
    evidence = report["evidence"]
    assert report["evidence_recall"] == evidence["recall"] == pytest.approx(session.evidence.recall, abs=1e-6)
    assert 0 < report["evidence_recall"] < 1
    assert len(evidence["recall_per_layer"]) == adapter.num_layers
    assert evidence["map_shape"] == [adapter.num_layers, report["visual_tokens"]]
    assert len(evidence["map"]) == report["visual_tokens"] and len(evidence["map_per_layer"]) == adapter.num_layers
    assert report["turns"][-1]["evidence_recall"] == pytest.approx(session.evidence.recall, abs=1e-9)
    plain = ChatSession(adapter, SessionConfig(method="full", max_new_tokens=2))
    plain.ask(PROMPT, small_image)
    assert plain.report()["evidence_recall"] is None and "evidence" not in plain.report()


def _eager_reference(adapter, media, answer: list[int], queries: int) -> np.ndarray:
    """(layers, kv heads, visual tokens) attention mass of the queries producing the answer's tokens, from
    transformers' own forward with eager attention (output_attentions), teacher-forced, written here by hand."""
    proc = adapter.processor
    text = proc.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    enc = proc(text=[text], images=[Image.fromarray(media.frames[0])], return_tensors="pt")
    forced = torch.tensor([answer[: queries - 1]], dtype=torch.long)
    inputs = dict(enc)  # the answer appended to every per-token input: its ids, mask 1, token type 0 (text)
    for name, fill in (("input_ids", None), ("attention_mask", 1), ("mm_token_type_ids", 0)):
        if name in inputs:
            extra = forced if fill is None else torch.full_like(forced, fill)
            inputs[name] = torch.cat([inputs[name], extra.to(inputs[name].dtype)], dim=1)
    with torch.no_grad():
        out = adapter.model(**inputs, output_attentions=True)
    visual = torch.nonzero(enc["input_ids"][0] == adapter.model.config.image_token_id).flatten()
    group = adapter.query_group
    rows = []
    for attention in out.attentions:  # (1, heads, T, T)
        last = attention[0, :, -queries:, :][:, :, visual].sum(1)  # (heads, visual)
        rows.append(last.view(-1, group, visual.numel()).sum(1))  # per KV head
    return torch.stack(rows).double().numpy()


def test_matches_a_hand_written_reference_from_eager_attention_weights(small_image):
    eager = _adapter(*build_tiny("tiny-qwen2.5-vl", seed=0, attn_implementation="eager"), "tiny-qwen2.5-vl")
    session = _ask(eager, small_image, "blockwise-keydiff", 40, max_new_tokens=6)
    answer = session.turns[-1].token_ids
    queries = min(16, len(answer))
    assert session.evidence.queries == queries >= 2  # the answer's own tokens are queries too
    mass = _eager_reference(eager, small_image, answer, queries)  # (layers, kv heads, visual)
    visual_seq = session.prepared.layout.seq_index.tolist()
    kept_total = lost_total = 0.0
    for layer_idx, layer in enumerate(session.cache.layers):
        per_token = mass[layer_idx].sum(0)
        assert np.allclose(session.evidence.map_per_layer[layer_idx], per_token / per_token.sum(), atol=1e-5)
        share = per_token.sum() / (queries * eager.text_config.num_attention_heads)
        assert session.evidence.visual_share_per_layer[layer_idx] == pytest.approx(share, abs=1e-5)
        for head in range(mass.shape[1]):
            held = set(layer.token_index[0, head].tolist())
            for vid, seq in enumerate(visual_seq):
                if seq in held:
                    kept_total += mass[layer_idx, head, vid]
                else:
                    lost_total += mass[layer_idx, head, vid]
    assert lost_total > 0
    assert session.evidence.recall == pytest.approx(kept_total / (kept_total + lost_total), abs=1e-5)
    assert eager.text_config._attn_implementation == "eager"  # the model as its owner left it
    assert not [name for name, m in eager.model.named_modules() if "forward" in vars(m)]


def test_salicache_pruned_tokens_are_lost_and_quantized_tiers_kept(small_video):
    adapter = get_adapter("tiny-qwen2.5-vl")
    session = _ask(adapter, small_video, "salicache", method_options={"flow_threshold": 0.0})
    held_seq = session.prepared.keep.nonzero().flatten()  # tokens that entered the LLM (pruned ones did not)
    layer = session.cache.layers[0]
    assert layer.quant, "some visual tokens are stored packed (INT8 / INT4)"
    kept = np.isin(session.prepared.layout.seq_index, held_seq.numpy())
    assert 0 < kept.sum() < kept.size
    for layer_idx, recall in enumerate(session.evidence.recall_per_layer):
        assert recall == pytest.approx(float(session.evidence.map_per_layer[layer_idx][kept].sum()), abs=1e-4)


def test_lightkv_counts_merged_tokens_for_their_members(small_image):
    adapter = get_adapter("tiny-qwen2.5-vl")
    session = _ask(adapter, small_image, "lightkv")
    last = session.cache.layers[-1].token_index[0, 0].tolist()
    assert len(set(last) & set(session.prepared.layout.seq_index.tolist())) < session.prepared.layout.n_visual
    assert session.evidence.recall == 1.0  # every merged token's mass lives on in the token that absorbed it


def test_memory_guard_counts_the_uncompressed_pass(small_image):
    adapter = get_adapter("tiny-qwen2.5-vl")
    session = _ask(adapter, small_image, "blockwise-keydiff", 24)  # fits: the default guard measures free memory
    assert session.evidence is not None
    session.guard = MemoryGuard(free_bytes=lambda: 1)
    with pytest.raises(MemoryGuardError, match="evidence recall needs"):
        session.compute_evidence()
    assert len(session.turns) == 1 and session.cache is not None  # the chat is kept


def test_a_refused_or_stopped_evidence_pass_keeps_the_answer(small_image, monkeypatch):
    """`evidence=True` asks for a second pass after the answer; when it cannot run, the answer stands."""
    config = SessionConfig(method="blockwise-keydiff", budget=24, max_new_tokens=3)
    plain = ChatSession(get_adapter("tiny-qwen2.5-vl"), config).ask(PROMPT, small_image)
    session = ChatSession(get_adapter("tiny-qwen2.5-vl"), SessionConfig(**{**config.__dict__, "evidence": True}))

    def refuse(*args, **kwargs):
        raise MemoryGuardError("evidence recall needs 9 GiB, 1 GiB free")

    monkeypatch.setattr(session.guard, "check_evidence", refuse)
    record = session.ask(PROMPT, small_image)
    assert record.token_ids == plain.token_ids and record.evidence_recall is None
    assert record.evidence_note == "evidence not computed: evidence recall needs 9 GiB, 1 GiB free"
    assert session.report()["evidence_recall"] is None
