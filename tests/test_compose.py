"""Composed methods (visualkv.methods.compose): Sali-Cache's frame skipping and tiers on top of block-wise
eviction, checked against DESIGN.md's invariants on every supported family.

(a) M + b bound on visual entries over *all* tiers after every append, and M after every layer of a block;
(b) kept entries keep their original positions (full-precision keys equal, packed keys within the
quantization bound); (c) exact when nothing is dropped; (d) skipped frames never reach the vision
encoder and pruned tokens never enter the LLM; (e) telemetry bytes equal bytes recomputed from shapes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import get_adapter
from tests.test_invariants import PROMPT, _layer_bytes_by_formula, _Watch
from tests.test_salicache import _story_clip
from visualkv.cli.main import main
from visualkv.cli.stacking import stacked_method
from visualkv.errors import ConfigError
from visualkv.kv.cache import TIER_FULL, TIER_INT4, TIER_INT8
from visualkv.kv.quant import dequantize
from visualkv.methods import make_method, method_names, method_traits
from visualkv.methods.compose import Pipeline
from visualkv.methods.eviction import tier_budgets
from visualkv.runtime.session import ChatSession, SessionConfig

ALL_FAMILIES = ["tiny-qwen2.5-vl", "tiny-smolvlm2", "tiny-qwen3-vl", "tiny-llava-onevision", "tiny-internvl3.5"]
COMPOSED = ["blockwise-keydiff+salicache", "blockwise-snapkv+salicache"]
#: the bound holds with LightKV merging inside the forward too
BOUNDED = [*COMPOSED, "blockwise-snapkv+lightkv+salicache"]
TIERS = "0.43,0.1,0.29"
BLOCK = 64


def _session(alias, method, budget=None, max_new_tokens=1, prefill="blockwise", **options) -> ChatSession:
    return ChatSession(
        get_adapter(alias),
        SessionConfig(
            method=method,
            budget=budget,
            prefill=prefill,
            block_size=BLOCK,
            max_new_tokens=max_new_tokens,
            method_options=options,
        ),
    )


def _budget(alias, media) -> int:
    """A fifth of the visual tokens: binding for every tier, whatever the family's token count."""
    return max(12, get_adapter(alias).prepare(media, PROMPT).layout.n_visual // 5)


def _visual_per_head(layer, visual: torch.Tensor) -> torch.Tensor:
    """(heads,) visual entries of a layer over every tier, counted from its token indices and the layout."""
    if not layer.is_initialized:
        return torch.zeros(1, dtype=torch.long)
    return torch.isin(layer.all_token_index()[0].long().cpu(), visual).sum(-1)


# -- names, refusals, flags --------------------------------------------------------------------------


def test_composed_names_are_listed_canonical_and_refusals_are_one_line():
    names = method_names()
    assert set(COMPOSED) <= set(names) and "lightkv+salicache" in names
    assert method_traits("salicache+blockwise-keydiff").name == "blockwise-keydiff+salicache"
    traits = method_traits("blockwise-snapkv+salicache")
    assert traits.default_prefill == "hybrid"  # never Sali-Cache's bulk: a bounded pipeline streams the media
    assert traits.needs_budget and traits.evicts_per_block and traits.query_aware and traits.question_apart
    assert traits.stages == ("salicache", "blockwise-snapkv")  # entry decisions first
    assert not method_traits("lightkv+salicache").needs_budget
    for bad, words in [
        ("post-snapkv+salicache", "does not compose"),
        ("full+salicache", "does not compose"),
        ("blockwise-keydiff+blockwise-snapkv", "both evict"),
        ("blockwise-keydiff+nope", "unknown method"),
        ("salicache+salicache", "twice"),
    ]:
        with pytest.raises(ConfigError, match=words) as err:
            method_traits(bad)
        assert "\n" not in str(err.value)
        with pytest.raises(ConfigError):
            SessionConfig(method=bad, budget=10).validate()


def test_options_reach_their_stage_and_flags_combine_on_the_instance():
    method = make_method("blockwise-snapkv+salicache", tiers=TIERS, flow_threshold=0.0)
    assert isinstance(method, Pipeline)
    sali, snap = method.stages
    assert sali.config.tiers == (0.43, 0.1, 0.29) and sali.config.flow_threshold == 0.0
    assert method.default_prefill == "hybrid" and method.needs_budget and method.question_apart
    method.proxy_ids = torch.tensor([1, 2])
    assert snap.proxy_ids is method.proxy_ids  # a follow-up re-prefill's question reaches every stage
    by_stage = make_method("blockwise-snapkv+salicache", **{"blockwise-snapkv": {}, "salicache": {"tiers": "1,0,0"}})
    assert by_stage.stages[0].config.tiers == (1.0, 0.0, 0.0)
    with pytest.raises(ConfigError, match="no stage"):
        make_method("blockwise-keydiff+salicache", window=3)


def test_flags_stack_salicache_on_a_method():
    assert stacked_method("blockwise-keydiff", True, TIERS) == ("blockwise-keydiff+salicache", {"tiers": TIERS})
    assert stacked_method("blockwise-keydiff", True) == ("blockwise-keydiff+salicache", {"tiers": (1.0, 0.0, 0.0)})
    assert stacked_method("blockwise-snapkv", False, TIERS) == (
        "blockwise-snapkv+salicache",
        {"tiers": TIERS, "flow_threshold": 0.0},
    )
    with pytest.raises(ConfigError, match="apply to --method salicache only"):
        stacked_method("full", True, TIERS)  # full means no compression
    assert stacked_method("blockwise-keydiff") == ("blockwise-keydiff", {})


def test_tier_budgets_split_m_and_sum_to_it():
    assert tier_budgets(100, None) == {TIER_FULL: 100}
    assert tier_budgets(100, (1.0, 0.0, 0.0)) == {TIER_FULL: 100, TIER_INT8: 0, TIER_INT4: 0}
    for m in (1, 7, 48, 1000):
        parts = tier_budgets(m, (0.43, 0.1, 0.29))
        assert sum(parts.values()) == m
        for tier, share in zip((TIER_FULL, TIER_INT8, TIER_INT4), (0.43, 0.1, 0.29)):
            assert abs(parts[tier] - m * share / 0.82) < 1


def test_cli_skip_frames_and_tiers_run_the_composed_pipeline(tmp_path, capsys):
    import json

    from tests.test_salicache import _write_video

    media, _ = _story_clip()
    video = _write_video(tmp_path / "clip.avi", media.frames, 1.0, "MJPG")
    out = tmp_path / "r.json"
    argv = ["run", "--model", "tiny-qwen2.5-vl", "--media", str(video), "--prompt", "hi", "--quiet"]
    argv += ["--max-new-tokens", "1", "--method", "blockwise-keydiff", "--budget", "40"]
    assert main([*argv, "--skip-frames", "--tiers", TIERS, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["method"] == "blockwise-keydiff+salicache" and report["prefill"] == "hybrid"
    assert report["stages"] == ["salicache", "blockwise-keydiff"]
    assert report["tiers"]["skipped"] > 0 and report["tiers"]["int4"] > 0
    assert main([*argv, "--tiers", TIERS, "--json", str(out)]) == 0  # tiers alone: no frame skipped
    assert json.loads(out.read_text())["tiers"]["skipped"] == 0
    assert main([*argv, "--skip-frames", "--json", str(out)]) == 0  # skipping alone: all full precision
    tiers = json.loads(out.read_text())["tiers"]
    assert tiers["skipped"] > 0 and tiers["int8"] == tiers["int4"] == tiers["pruned"] == 0
    capsys.readouterr()
    for extra, words in [
        (["--flow-threshold", "0.2"], "--flow-threshold"),
        (["--method", "post-snapkv", "--skip-frames"], "does not compose"),
    ]:
        assert main([*argv, *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0] and "Traceback" not in err[0]


# -- (a) bounded: M + b over every tier, M after every layer of a block -----------------------------


@pytest.mark.parametrize("method", BOUNDED)
@pytest.mark.parametrize("alias", ALL_FAMILIES)
def test_every_tier_counts_towards_the_budget(alias, method, monkeypatch):
    media, _ = _story_clip()
    budget = _budget(alias, media)
    watch = _Watch(monkeypatch)  # visual entries over every tier right after every append
    watch.arm(get_adapter(alias), media)
    after_layer: list[tuple[bool, list[int]]] = []
    original = Pipeline.after_layer

    def spy(self, ctx, state):
        out = original(self, ctx, state)
        per_head = _visual_per_head(ctx.cache.layers[state.layer_idx], watch.visual_seq)
        after_layer.append((bool(ctx.block.units), per_head.tolist()))
        return out

    monkeypatch.setattr(Pipeline, "after_layer", spy)
    s = _session(alias, method, budget, tiers=TIERS)
    s.ask(PROMPT, media)
    report = s.report()
    largest_unit = max(u.n_tokens for u in s.prepared.layout.units)
    visual_after_append, _ = watch.of(s)
    assert max(visual_after_append) <= budget + max(BLOCK, largest_unit)
    assert max(visual_after_append) > budget  # the cache really went over M before evicting
    assert after_layer and all(max(c) <= budget and min(c) == max(c) for units, c in after_layer if units)
    # every packed tier was evicted too: more INT8 / INT4 tokens entered than any layer holds
    for layer in s.cache.layers:
        held = layer.visual_by_tier()
        assert report["tiers"]["int4"] > held[TIER_INT4] > 0 and report["tiers"]["int8"] >= held[TIER_INT8] > 0
        assert sum(held.values()) == int(_visual_per_head(layer, watch.visual_seq).max()) <= budget
    assert report["tiers"]["skipped"] > 0


# -- (b) positions ---------------------------------------------------------------------------------


@pytest.mark.parametrize("method", COMPOSED)
@pytest.mark.parametrize("alias", ALL_FAMILIES)
def test_kept_entries_of_every_tier_keep_their_original_positions(alias, method):
    """Layer-0 keys depend only on token and position: full-precision entries equal the full cache's,
    packed ones dequantize to within half a quantization step of them, and a follow-up continues the
    original numbering."""
    media, _ = _story_clip()
    s = _session(alias, method, _budget(alias, media), tiers=TIERS)
    s.ask(PROMPT, media)
    s.ask("And then?")
    full = _session(alias, "full")
    full.ask(PROMPT, media)
    full.ask("And then?")
    layer, ref = s.cache.layers[0], full.cache.layers[0]
    assert torch.equal(ref.token_index[0, 0].long(), torch.arange(ref.token_index.shape[-1]))
    idx = layer.token_index[0].long()  # (heads, n) full precision
    assert idx.shape[1] < ref.token_index.shape[2] and bool((idx[:, 1:] > idx[:, :-1]).all())
    prompt = idx < s.prepared.seq_len  # the answers may differ between the two runs; the prompt may not
    assert int(prompt.sum(-1).min()) > 0
    for head in range(idx.shape[0]):
        mine = layer.keys[0, head][prompt[head]]
        assert torch.allclose(mine, ref.keys[0, head, idx[head][prompt[head]]], atol=1e-4)
    assert set(layer.quant) == {TIER_INT8, TIER_INT4}
    for seg in layer.quant.values():
        packed = seg.token_index[0].long()  # (heads, m)
        mine = dequantize(seg.keys)[0].float()  # (heads, m, d)
        theirs = torch.stack([ref.keys[0, h, packed[h]] for h in range(packed.shape[0])]).float()
        step = seg.keys.scale[0].float().repeat_interleave(mine.shape[-1] // seg.keys.scale.shape[-1], dim=-1)
        assert bool(((mine - theirs).abs() <= step / 2 + 1e-4).all())
    n_follow = int(s.state.history_ids[-1].shape[0]) - 1  # its first token is the previous answer's last
    assert torch.allclose(layer.keys[0, :, -n_follow:], ref.keys[0, :, -n_follow:], atol=1e-5)


# -- (c) exactness when nothing is dropped -----------------------------------------------------------


@pytest.mark.parametrize("method", COMPOSED)
@pytest.mark.parametrize("alias", ALL_FAMILIES)
def test_nothing_dropped_is_exact_with_forced_blocks(alias, method, small_video):
    """Budget >= input, tiers 1,0,0, flow threshold 0, blocks forced: the full cache's logits and tokens."""
    ref = _session(alias, "full", max_new_tokens=4)
    ref_record = ref.ask(PROMPT, small_video)
    s = _session(alias, method, 100_000, max_new_tokens=4, tiers="1,0,0", flow_threshold=0.0)
    record = s.ask(PROMPT, small_video)
    assert len(s.blocks) > 3  # really block by block
    assert s.report()["tiers"]["full"] == s.prepared.layout.n_visual  # nothing skipped, pruned or packed
    assert torch.allclose(s.prefill_result.logits, ref.prefill_result.logits, atol=1e-4, rtol=1e-4)
    assert record.token_ids == ref_record.token_ids


# -- (d) skipped frames never reach the encoder, pruned tokens never enter the LLM ------------------


@pytest.mark.parametrize("alias", ALL_FAMILIES)
def test_skipped_frames_are_not_encoded_and_dropped_tokens_never_enter_the_llm(alias, monkeypatch):
    from visualkv.attention.step import current
    from visualkv.kv.cache import CompressibleCache

    media, _ = _story_clip()
    entered: set[int] = set()
    original = CompressibleCache.update

    def update(cache, key_states, value_states, layer_idx, *args, **kwargs):
        step = current()
        if layer_idx == 0 and step is not None and step.token_index is not None:
            entered.update(step.token_index.long().cpu().tolist())
        return original(cache, key_states, value_states, layer_idx, *args, **kwargs)

    monkeypatch.setattr(CompressibleCache, "update", update)
    s = _session(alias, "blockwise-keydiff+salicache", _budget(alias, media), tiers="0.3,0.2,0.2")
    encoded: list[int] = []  # units the engine asks the vision tower to encode (every family goes through this)
    encode = s.adapter.encode_units_with_layer_features

    def spy(prepared, units):
        encoded.extend(u.frame for u in units)
        return encode(prepared, units)

    monkeypatch.setattr(s.adapter, "encode_units_with_layer_features", spy)
    s.ask(PROMPT, media)
    report = s.report()
    skipped_units = {f["unit"] for f in report["frames"] if f["skipped"]}
    assert skipped_units and report["tiers"]["pruned"] > 0  # not vacuous
    assert not skipped_units & set(encoded)
    assert encoded == s.prefill_result.context.encoded_frames and sorted(set(encoded)) == report["vision_encoder_units"]
    prompt_entered = {i for i in entered if i < s.prepared.seq_len}
    kept = set(s.prepared.keep.nonzero().flatten().tolist())
    codes = np.array(report["tier"])
    dropped = set(s.prepared.layout.seq_index[codes >= 3].tolist())  # pruned (3) and skipped (4)
    assert prompt_entered == kept and not dropped & prompt_entered


# -- (e) telemetry bytes are the bytes held ----------------------------------------------------------


@pytest.mark.parametrize("alias", ALL_FAMILIES)
def test_reported_bytes_are_the_bytes_held_in_every_tier(alias, monkeypatch):
    media, _ = _story_clip()
    adapter = get_adapter(alias)
    watch = _Watch(monkeypatch)
    watch.arm(adapter, media)
    s = _session(alias, "blockwise-snapkv+salicache", _budget(alias, media), tiers=TIERS)
    s.ask(PROMPT, media)
    report = s.report()
    layers = s.cache.layers
    by_formula = sum(_layer_bytes_by_formula(layer, adapter) for layer in layers)
    assert report["final_kv_bytes"] == by_formula == report["blocks"][-1]["kv_bytes"]
    assert sum(report["kv_bytes_by_tier"].values()) == by_formula
    assert report["kv_bytes_by_tier"]["int8"] > 0 and report["kv_bytes_by_tier"]["int4"] > 0
    assert report["peak_kv_bytes"] == max(watch.of(s)[1])
    entries = [layer.total_entries_per_head() for layer in layers]
    assert report["blocks"][-1]["kv_tokens_per_layer"] == entries


def test_settings_of_a_composed_method_are_its_stages_settings():
    """The app's settings form: each stage's settings under "stage:key", back to {stage: options}."""
    from visualkv.runtime.streaming import method_options, method_settings

    keys = {s.key for s in method_settings("blockwise-snapkv+salicache")}
    assert {"salicache:tiers", "salicache:flow_threshold", "blockwise-snapkv:window"} <= keys
    options = method_options(
        "blockwise-snapkv+salicache", {"salicache:tiers": "0.5,0.2,0.1", "blockwise-snapkv:window": 16}
    )
    sali, snap = make_method("blockwise-snapkv+salicache", **options).stages
    assert sali.config.tiers == (0.5, 0.2, 0.1) and snap.config.window == 16


def test_memory_guard_sees_a_composed_pipeline_as_bounded(small_video):
    """The guard reads the pipeline's flags: block-wise's bound, not Sali-Cache's bulk prefill."""
    from visualkv.runtime.memory_guard import MemoryGuard

    adapter = get_adapter("tiny-qwen2.5-vl")
    prepared = adapter.prepare(small_video, PROMPT)
    guard = MemoryGuard(free_bytes=lambda: 10**12)

    def estimate(method, budget=None):
        return guard.check(adapter, prepared, SessionConfig(method=method, budget=budget)).kv_bytes

    composed = estimate("blockwise-keydiff+salicache", 16)
    assert composed == estimate("blockwise-keydiff", 16) < estimate("salicache")
