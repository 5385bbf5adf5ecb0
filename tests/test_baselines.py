"""The field's baselines keep what their published rules keep.

StreamingLLM and PyramidKV against hand-written references of the formulas of kvpress's `StreamingLLMPress` and
`PyramidKVPress` (written out here from their definitions, not imported or copied), on fixed tensors and then on a
tiny model's block-wise prefill.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import assert_held_keys_are_the_full_caches, get_adapter
from visualkv.bench.synthetic import image_media, video_media
from visualkv.methods import method_names
from visualkv.methods.pyramidkv import PyramidKV, pyramid_budgets
from visualkv.methods.streamingllm import streaming_scores
from visualkv.runtime.session import ChatSession, SessionConfig

PROMPT = "What happens in the video?"


def streamingllm_reference(k_len: int, n_kept: int, n_sink: int) -> set[int]:
    """kvpress's StreamingLLM rule for `n_kept` (its `int(k_len * (1 - compression_ratio))`) of `k_len` entries:
    scores 1 but for the `n_pruned` entries right after the first `n_sink`, so the sinks and the latest stay."""
    n_pruned = k_len - n_kept
    return set(range(n_sink)) | set(range(n_sink + n_pruned, k_len))


def pyramidkv_reference(q_len: int, ratio: float, window: int, beta: float, layers: int, layer: int) -> int:
    """kvpress's PyramidKV layer budget: a linear pyramid of mean `q_len * (1 - ratio)`, from `max` at layer 0 down
    to `min = mean / beta` at the top, `max = 2 mean - min` capped at `q_len - window` (then `min` takes the rest);
    the uniform mean where that does not fit between `window` and `q_len`."""
    mean = q_len * (1 - ratio)
    low, high = mean / beta, 2 * mean - mean / beta
    if high >= q_len - window:
        high = q_len - window
        low = 2 * mean - high
    if not q_len >= high >= low >= window:
        return round(q_len * (1 - ratio))
    return round(high - layer * (high - low) / (layers - 1))


#: (entries, compression ratio, sinks), where at least the sinks are kept (fewer, and the formula ties)
STREAMING_CASES = [
    (k, r, s) for k in (9, 64, 333) for r in (0.0, 0.5, 0.75, 0.9) for s in (0, 1, 4) if int(k * (1 - r)) >= s
]


@pytest.mark.parametrize(("k_len", "ratio", "n_sink"), STREAMING_CASES)
def test_streamingllm_keeps_what_kvpress_formula_keeps(k_len, ratio, n_sink):
    """Top-k of our scores over fixed entries (global indices from an arbitrary offset) is the formula's set."""
    n_kept = int(k_len * (1 - ratio))
    offset = 1000
    index = (torch.arange(k_len) + offset).view(1, 1, k_len).expand(1, 2, k_len)
    scores = streaming_scores(index, offset + n_sink, offset + k_len + 1)
    kept = scores.topk(n_kept, dim=-1).indices
    for head in range(2):
        assert set(kept[0, head].tolist()) == streamingllm_reference(k_len, n_kept, n_sink)


@pytest.mark.parametrize("q_len", [64, 256, 1000])
@pytest.mark.parametrize("ratio", [0.5, 0.75, 0.875])
@pytest.mark.parametrize("beta", [1.0, 2.0, 20.0])
@pytest.mark.parametrize("layers", [2, 4, 28])
def test_pyramidkv_budgets_equal_kvpress_formula(q_len, ratio, beta, layers):
    """Per-layer budgets of M = q_len (1 - ratio) visual entries: kvpress's with its window term 0 (the question's
    window is protected text here, never a ranked entry); together about L x M."""
    budget = int(q_len * (1 - ratio))
    assert budget == q_len * (1 - ratio)  # the cases are exact, so both sides round the same numbers
    ours = pyramid_budgets(q_len, budget, layers, beta)
    assert ours == [pyramidkv_reference(q_len, ratio, 0, beta, layers, layer) for layer in range(layers)]
    assert abs(sum(ours) - layers * budget) <= layers // 2 + 1
    if beta > 1:
        assert ours[0] > budget > ours[-1]  # really a pyramid, more in the lower layers


def _visual_kept(session) -> list[list[set[int]]]:
    """Per layer, per KV head: the visual sequence indices held after the prefill (prompt turn only)."""
    visual = set(session.prepared.layout.seq_index.tolist())
    return [[set(row.tolist()) & visual for row in layer.token_index[0]] for layer in session.cache.layers]


def test_streamingllm_blockwise_keeps_the_rule_over_the_whole_input():
    """Evicting after every 16-token block keeps exactly the sinks and the latest visual tokens of the video,
    the formula applied to all its visual tokens at once, on every layer and head."""
    adapter = get_adapter("tiny-qwen2.5-vl")
    video = video_media(8, 224, 168, fps=1.0, seed=2)
    budget, sinks = 20, 4
    config = SessionConfig(method="streamingllm", budget=budget, prefill="blockwise", block_size=16, max_new_tokens=1)
    session = ChatSession(adapter, config)
    session.ask(PROMPT, video)
    visual = session.prepared.layout.seq_index.tolist()
    assert len(session.blocks) > 3 and len(visual) > budget
    expected = {visual[i] for i in streamingllm_reference(len(visual), budget, sinks)}
    assert len(expected) == budget
    for layer in _visual_kept(session):
        assert all(head == expected for head in layer)


def test_pyramidkv_keeps_each_layers_top_scores_under_kvpress_budgets(monkeypatch):
    """With fixed per-token scores in place of SnapKV's, each layer keeps its kvpress budget of the highest: the
    pyramid decides how many per layer, the scores which."""

    def fixed(self, ctx, layer_idx, keys, token_index):
        return ((token_index.long() * 7919) % 10007).float()  # distinct for indices under 10007

    monkeypatch.setattr(PyramidKV, "score", fixed)
    adapter = get_adapter("tiny-qwen2.5-vl")
    video = video_media(8, 224, 168, fps=1.0, seed=2)
    budget = 24
    config = SessionConfig(method="pyramidkv", budget=budget, prefill="blockwise", block_size=16, max_new_tokens=1)
    session = ChatSession(adapter, config)
    session.ask(PROMPT, video)
    visual = session.prepared.layout.seq_index.tolist()
    layers = adapter.num_layers
    budgets = [pyramidkv_reference(len(visual), 1 - budget / len(visual), 0, 20, layers, i) for i in range(layers)]
    assert budgets[0] > budget > budgets[-1]
    ranked = sorted(visual, key=lambda i: (i * 7919) % 10007, reverse=True)
    for layer, n in zip(_visual_kept(session), budgets):
        assert all(head == set(ranked[:n]) for head in layer)


def test_baselines_are_choosable_and_compose():
    names = method_names()
    for name in ("streamingllm", "pyramidkv"):
        assert name in names and f"{name}+salicache" in names and f"{name}+lightkv" in names


# -- FastV -------------------------------------------------------------------------------------------------------


def _stock_last_token_attention(adapter, media, layer: int) -> torch.Tensor:
    """The last prompt token's attention over the prompt at decoder layer `layer`, averaged over heads, from
    transformers' own eager attention weights (the model put back as it was)."""
    from PIL import Image

    proc = adapter.processor
    content = [{"type": "image"}, {"type": "text", "text": PROMPT}]
    text = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
    enc = proc(text=[text], images=[Image.fromarray(media.frames[0])], return_tensors="pt")
    impl = adapter.model.config._attn_implementation
    adapter.model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = adapter.model(**enc, output_attentions=True)
    finally:
        adapter.model.set_attn_implementation(impl)
    return out.attentions[layer][0, :, -1].float().mean(0)


def _fastv(adapter, media, **options) -> ChatSession:
    session = ChatSession(adapter, SessionConfig(method="fastv", method_options=options, max_new_tokens=2))
    session.ask(PROMPT, media)
    return session


def test_fastv_layers_before_k_keep_every_visual_token_and_later_ones_the_most_attended():
    """K = 1 on the 2-layer tiny Qwen: layer 0 holds every visual token; layer 1 the (1 - R) of them that the
    last prompt token attends to most in layer 0's attention map (transformers' eager weights), text untouched."""
    adapter = get_adapter("tiny-qwen2.5-vl")
    image = image_media(448, 336, seed=1)
    session = _fastv(adapter, image, layer=1, ratio=0.5)
    visual = session.prepared.layout.seq_index.tolist()
    before, after = _visual_kept(session)
    assert all(head == set(visual) for head in before)
    attention = _stock_last_token_attention(adapter, image, 0)
    n_kept = len(visual) - int(0.5 * len(visual))
    expected = set(sorted(visual, key=lambda i: float(attention[i]), reverse=True)[:n_kept])
    assert all(head == expected for head in after)
    protected = set((~session.prepared.visual_mask).nonzero().flatten().tolist())
    for layer in session.cache.layers:
        assert all(protected <= set(row.tolist()) for row in layer.token_index[0])
    assert session.report()["fastv_dropped"] == len(visual) - n_kept


def test_fastv_keeps_original_positions_and_is_exact_at_ratio_zero():
    """Layer K's keys of the kept tokens equal the full cache's (they come from layer K-1's output and their
    original positions); R = 0 gives the full model's logits, R = 0.5 does not (the check bites)."""
    adapter = get_adapter("tiny-qwen2.5-vl")
    image = image_media(448, 336, seed=1)
    full = ChatSession(adapter, SessionConfig(method="full", max_new_tokens=2))
    full.ask(PROMPT, image)
    pruned = _fastv(adapter, image, layer=1, ratio=0.5)
    layer, ref = pruned.cache.layers[1], full.cache.layers[1]
    idx = layer.token_index[0].long()
    prompt = idx < pruned.prepared.seq_len
    for head in range(idx.shape[0]):
        assert torch.allclose(layer.keys[0, head][prompt[head]], ref.keys[0, head, idx[head][prompt[head]]], atol=1e-5)
    logits = full.prefill_result.logits
    assert not torch.allclose(pruned.prefill_result.logits, logits, atol=1e-4)
    exact = _fastv(adapter, image, layer=1, ratio=0.0)
    assert torch.allclose(exact.prefill_result.logits, logits, atol=1e-4, rtol=1e-4)


def test_fastv_refuses_what_it_cannot_do_in_one_line():
    from visualkv.errors import ConfigError
    from visualkv.methods import make_method, method_traits

    with pytest.raises(ConfigError, match="fastv does not compose"):
        method_traits("blockwise-keydiff+fastv")
    adapter = get_adapter("tiny-qwen2.5-vl")
    image = image_media(448, 336, seed=1)
    config = SessionConfig(method="fastv", prefill="blockwise", block_size=32, max_new_tokens=1)
    with pytest.raises(ConfigError, match="one block"):
        ChatSession(adapter, config).ask(PROMPT, image)
    with pytest.raises(ConfigError, match="below the model's 2 decoder layers"):
        make_method("fastv", layer=2).pruning_layer(adapter.num_layers)
    assert make_method("fastv").pruning_layer(28) == 2 and make_method("fastv").pruning_layer(2) == 1


# -- the invariant suite on the families the generated one does not parametrize ----------------------------------

OTHER_FAMILIES = ["tiny-qwen3-vl", "tiny-llava-onevision", "tiny-internvl3.5"]  # conftest's FAMILIES run the rest


@pytest.mark.slow
@pytest.mark.parametrize("method", ["streamingllm", "pyramidkv", "fastv", "evs", "visionzip"])
@pytest.mark.parametrize("alias", OTHER_FAMILIES)
def test_baselines_pass_the_invariant_suite_on_every_family(alias, method):
    """Telemetry equal to the cache on image and video; for the two scorers also the bound, protected text and
    original positions; for FastV, every visual token in the layers before K and protected text everywhere; for
    EVS, vLLM's count of a video's tokens with its first frame whole, an image whole, protected text and the full
    cache's keys at the kept entries (original positions); for VisionZip, its count per image tile / frame, protected
    text and, without merging, the full cache's keys at the kept entries."""
    from tests import test_invariants as inv

    adapter = get_adapter(alias)
    # conftest's media; InternVL's image in two tiles + a thumbnail, as tests/test_new_families.py has it
    image = image_media(896, 448, seed=1) if alias == "tiny-internvl3.5" else image_media(448, 336, seed=1)
    video = video_media(8, 224, 168, fps=1.0, seed=2)
    with pytest.MonkeyPatch.context() as mp:
        inv.test_telemetry_agrees_with_an_independent_count(adapter, image, video, method, mp)
    if method == "evs":
        for media in (image, video):
            _check_evs(adapter, media)
        return
    if method == "visionzip":
        for media in (image, video):
            _check_visionzip(adapter, media)
        return
    if method == "fastv":
        for media in (image, video):
            session = ChatSession(adapter, SessionConfig(method="fastv", max_new_tokens=1))
            session.ask(PROMPT, media)
            visual, k = set(session.prepared.layout.seq_index.tolist()), session.method.k
            protected = set((~session.prepared.visual_mask).nonzero().flatten().tolist())
            held = _visual_kept(session)
            assert all(head == visual for layer in held[:k] for head in layer)
            n_kept = len(visual) - int(0.5 * len(visual))
            assert all(len(head) == n_kept for layer in held[k:] for head in layer) and k < len(held)
            for layer in session.cache.layers:
                assert all(protected <= set(row.tolist()) for row in layer.token_index[0])
        return
    with pytest.MonkeyPatch.context() as mp:
        inv.test_visual_entries_never_exceed_budget_plus_block_or_unit(adapter, image, video, method, 16, mp)
    inv.test_protected_tokens_survive(adapter, image, video, method)
    for kind in ("image", "video"):
        inv.test_kept_entries_keep_original_positions(adapter, image, video, method, kind)


def test_memory_guard_bounds_pyramidkv_from_above():
    """PyramidKV's lower layers hold more than M and its upper ones less: each layer's buffer is sized for its own
    budget (the bottom one's larger than the top one's by the difference of their budgets), and the guard predicts
    at least the cache's measured peak of entries and of buffers."""
    from visualkv.methods import method_traits
    from visualkv.runtime.memory_guard import estimate_prefill

    adapter = get_adapter("tiny-qwen2.5-vl")
    video = video_media(8, 224, 168, fps=1.0, seed=2)
    config = SessionConfig(method="pyramidkv", budget=24, prefill="blockwise", block_size=16, max_new_tokens=2)
    prepared = adapter.prepare(video, PROMPT)
    estimate = estimate_prefill(
        adapter, prepared, method_traits("pyramidkv"), 24, 16, "blockwise", headroom=config.cache_headroom
    )
    session = ChatSession(adapter, config)
    session.ask(PROMPT, video)
    assert estimate.kv_bytes >= session.cache.peak_kv_bytes > 0
    assert estimate.kv_allocated_bytes >= session.cache.peak_allocated_bytes > 0
    bottom, top = session.cache.layers[0].capacity_hint, session.cache.layers[-1].capacity_hint
    assert bottom - top == session.method.budgets[0] - session.method.budgets[-1] > 0


def _check_evs(adapter, media) -> None:
    """EVS at its default q = 0.75 against the full cache of the same input: every layer and head holds the text,
    the non-video visual tokens, the first video frame and max(first frame, int(n / 4)) of the n video tokens, and
    layer 0's keys of what it holds equal the full cache's (they depend on the token and its position only)."""
    session = ChatSession(adapter, SessionConfig(method="evs", max_new_tokens=1))
    session.ask(PROMPT, media)
    full = ChatSession(adapter, SessionConfig(method="full", max_new_tokens=1))
    full.ask(PROMPT, media)
    layout = session.prepared.layout
    video = [f for f, info in enumerate(layout.frames) if info.kind == "frame"]
    in_video = torch.from_numpy(np.isin(layout.frame, video))
    seq = torch.from_numpy(layout.seq_index).long()
    first = set(seq[torch.from_numpy(layout.frame == video[0])].tolist()) if video else set()
    n_video = int(in_video.sum())
    n_kept = max(len(first), int(n_video * 0.25)) if video else 0
    protected = set((~session.prepared.visual_mask).nonzero().flatten().tolist())
    for layer in _visual_kept(session):
        for head in layer:
            assert len(head) == len(seq) - n_video + n_kept and first <= head
            assert set(seq[~in_video].tolist()) <= head
    for layer in session.cache.layers:
        assert all(protected <= set(row.tolist()) for row in layer.token_index[0])
    assert_held_keys_are_the_full_caches(session.cache, full.cache)


def _check_visionzip(adapter, media) -> None:
    """VisionZip at its defaults holds, in every layer and head, the protected text and counts(n_f) of each frame
    (image, tile or video frame) of n_f tokens; with contextual = 0 (no merged rows) layer 0's keys of what it holds
    equal the full cache's (the token and its original position only)."""
    from visualkv.methods.visionzip import counts

    full = ChatSession(adapter, SessionConfig(method="full", max_new_tokens=1))
    full.ask(PROMPT, media)
    protected = set((~full.prepared.visual_mask).nonzero().flatten().tolist())
    for options in ({}, {"contextual": 0.0}):
        session = ChatSession(adapter, SessionConfig(method="visionzip", method_options=options, max_new_tokens=1))
        session.ask(PROMPT, media)
        config = session.method.config
        n_kept = sum(
            sum(counts(int(n), config.dominant, config.contextual))
            for n in np.bincount(session.prepared.layout.frame)
            if n
        )
        assert all(len(head) == n_kept for layer in _visual_kept(session) for head in layer)
        assert n_kept < session.prepared.layout.n_visual
        for layer in session.cache.layers:
            assert all(protected <= set(row.tolist()) for row in layer.token_index[0])
    assert_held_keys_are_the_full_caches(session.cache, full.cache)
