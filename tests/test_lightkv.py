"""LightKV: prompt-aware windowed merging of visual tokens inside the prefill."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tests.conftest import get_adapter
from visualkv.bench.synthetic import image_media, video_media
from visualkv.cli.main import main
from visualkv.errors import ConfigError
from visualkv.methods.lightkv import LightKV, LightKVConfig, merge_in_windows, scale_layers
from visualkv.models.registry import load_model
from visualkv.models.synthetic import tiny
from visualkv.runtime.session import ChatSession, SessionConfig

DEEP = {"qwen": ("tiny-qwen2.5-vl", "test4-qwen2.5-vl"), "smol": ("tiny-smolvlm2", "test4-smolvlm2")}


@pytest.fixture(scope="module")
def models():
    """Tiny 2-layer models, plus 4-layer variants (same classes) so three stages fit before the last layer."""
    for base, deep in DEEP.values():
        tiny.TINY_SPECS[deep] = dataclasses.replace(tiny.TINY_SPECS[base], text_num_layers=4)
    try:
        out = {}
        for fam, (base, deep) in DEEP.items():
            out[fam] = get_adapter(base)  # shared with the other test files (unmodified here)
            out[fam + "4"] = load_model(deep)
        yield out
    finally:
        for _, deep in DEEP.values():
            tiny.TINY_SPECS.pop(deep, None)


@pytest.fixture(scope="module")
def image():
    return image_media(640, 360)  # Qwen: one 13 x 23 grid; SmolVLM: 3 x 4 tiles of 8 x 8 + a global tile


def _run(adapter, media, prompt="What is shown here?", max_new_tokens=1, **options) -> ChatSession:
    cfg = SessionConfig(method="lightkv", max_new_tokens=max_new_tokens, method_options=options)
    session = ChatSession(adapter, cfg)
    session.ask(prompt, media)
    return session


def _visual_ids(session: ChatSession, layer: int) -> torch.Tensor:
    """Visual ids held by one layer's cache (head 0), in sequence order."""
    prepared = session.prepared
    idx = session.cache.layers[layer].all_token_index()[0, 0].long()
    idx = idx[idx < prepared.seq_len]
    vid = torch.from_numpy(prepared.layout.visual_id_of_seq(prepared.seq_len))[idx]
    return vid[vid >= 0]


def _expected_survivors(
    session: ChatSession, vids: torch.Tensor, windows: int, ratio: float, block_of_vid: torch.Tensor | None = None
) -> int:
    """Σ over windows (W per side of each tile/frame grid, by original row/col) of n - min(⌊P n⌋, ⌊n/2⌋)."""
    layout = session.prepared.layout
    total = 0
    groups: dict[tuple, int] = {}
    for v in vids.tolist():
        f = int(layout.frame[v])
        rows, cols = layout.frames[f].grid
        key = (f, int(layout.row[v]) * windows // rows, int(layout.col[v]) * windows // cols)
        if block_of_vid is not None:
            key = (int(block_of_vid[v]),) + key
        groups[key] = groups.get(key, 0) + 1
    for n in groups.values():
        total += n - min(int(ratio * n), n // 2)
    return total


# -- schedule and config ----------------------------------------------------------------------------------------------
def test_default_schedule_scales_with_depth():
    assert scale_layers((12, 17, 22), 28, 28) == [11, 16, 21]  # Qwen2.5-VL-7B itself
    assert scale_layers((12, 18, 24), 32, 32) == [11, 17, 23]  # LLaVA-7B itself
    assert scale_layers((12, 17, 22), 28, 16) == [6, 9, 12]  # bench-qwen2.5-vl (16 layers)
    assert scale_layers((12, 17, 22), 28, 8) == [2, 4, 5]
    assert scale_layers((12, 17, 22), 28, 2) == [0]  # collisions pushed deeper, then dropped
    assert LightKVConfig().resolve("qwen2_5_vl", 8) == [(2, 6, 0.5), (4, 4, 0.5), (5, 2, 0.5)]
    assert LightKVConfig().resolve("smolvlm", 24) == [(8, 4, 0.5), (13, 2, 0.5), (17, 1, 0.5)]
    assert LightKVConfig(layers="1,2", ratios="0.3").resolve("smolvlm", 4) == [(1, 4, 0.3), (2, 2, 0.3)]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"layers": "3,2"},
        {"layers": "x"},
        {"windows": "0"},
        {"ratios": "1.5"},
        {"ratios": "-0.1"},
    ],
)
def test_bad_config_is_refused(kwargs):
    with pytest.raises(ConfigError):
        LightKVConfig(**kwargs)


def test_bad_config_for_the_model_is_refused(capsys):
    with pytest.raises(ConfigError):
        LightKVConfig(layers=(1,)).resolve("qwen2_5_vl", 2)  # after the last layer: changes nothing
    with pytest.raises(ConfigError):
        LightKVConfig(layers=(0, 1), windows=(4, 2, 1)).resolve("qwen2_5_vl", 8)
    assert main(["run", "--method", "full", "--lightkv-layers", "1", "--prompt", "hi"]) == 2
    assert main(["run", "--method", "lightkv", "--lightkv-ratios", "2", "--prompt", "hi"]) == 2
    assert "lightkv" in capsys.readouterr().err


# -- the merge itself ---------------------------------------------------------------------------------------------------
def test_window_merge_equals_weighted_average_by_hand():
    # Window 1 = tokens 0, 2, 3, 5 (A = 0, 3; B = 2, 5); window 0 = tokens 1, 4, 6 (A = 1, 6; B = 4).
    x = torch.tensor(
        [
            [1.0, 0.0, 0.0],  # 0: A of window 0, closest B: 2
            [0.6, 0.8, 0.0],  # 1: A of window 1, cos to 4 = 0.64
            [1.0, 0.1, 0.0],  # 2: B of window 0
            [0.9, 0.0, 0.2],  # 3: A of window 0, closest B: 2
            [0.0, 0.8, 0.6],  # 4: B of window 1
            [0.0, 0.0, 1.0],  # 5: B of window 0
            [0.0, 0.1, 1.0],  # 6: A of window 1, cos to 4 ≈ 0.68 (> 0.64): merges
        ]
    )
    group = torch.tensor([1, 0, 1, 1, 0, 1, 0])
    counts = np.array([3, 4])  # tokens per window
    w = torch.tensor([0.5, 2.0, 1.5, 0.25, 3.0, 1.0, 0.75])
    res = merge_in_windows(x, w, group, counts, ratio=0.5)  # window 1: r = min(2, 2) = 2; window 0: r = min(1, 1) = 1
    assert res.keep.tolist() == [False, True, True, False, True, True, False]
    assert res.dest.tolist() == [2, 1, 2, 2, 4, 5, 4]
    expect2 = (1.5 * x[2] + 0.5 * x[0] + 0.25 * x[3]) / (1.5 + 0.5 + 0.25)
    expect4 = (3.0 * x[4] + 0.75 * x[6]) / (3.0 + 0.75)
    torch.testing.assert_close(res.x[2], expect2)
    torch.testing.assert_close(res.x[4], expect4)
    assert sorted(res.merged.tolist()) == [0, 3, 6]
    assert sorted(set(res.dest[res.merged].tolist())) == [2, 4]  # the kept tokens that absorbed others
    for untouched in (1, 5):  # bit for bit
        assert torch.equal(res.x[untouched], x[untouched])
    assert res.weight[2].item() == pytest.approx(2.25) and res.weight[4].item() == pytest.approx(3.75)
    # Lower ratio: window 1 merges ⌊0.3·4⌋ = 1 (the most similar A: token 0), window 0 none (⌊0.9⌋ = 0).
    res = merge_in_windows(x, w, group, counts, ratio=0.3)
    assert res.keep.tolist() == [False, True, True, True, True, True, True]
    res = merge_in_windows(x, w, group, counts, ratio=0.0)
    assert bool(res.keep.all()) and res.x is x


def _grid_windows(rows: int, cols: int, per_side: int) -> tuple[torch.Tensor, np.ndarray]:
    """Window ids of a rows x cols token grid cut into per_side x per_side windows, and tokens per window."""
    row, col = torch.div(torch.arange(rows * cols), cols, rounding_mode="floor"), torch.arange(rows * cols) % cols
    group = (row * per_side // rows) * per_side + col * per_side // cols
    return group, np.bincount(group.numpy())


def test_window_merge_runs_the_same_operations_for_any_number_of_tokens_and_windows():
    """Vectorised: the operations dispatched do not grow with tokens or windows (no loop per window or token),
    which is what keeps a 10k-token merge fast; counted, not timed."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountOps(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    ops = []
    for rows, cols, per_side, dim in ((20, 25, 2, 16), (80, 125, 6, 256)):  # 500 tokens / 4 windows, 10k / 36
        group, counts = _grid_windows(rows, cols, per_side)
        x, w = torch.randn(rows * cols, dim, generator=g), torch.rand(rows * cols, generator=g) + 0.1
        with CountOps() as counter:
            res = merge_in_windows(x, w, group, counts, 0.5)
        ops.append(counter.ops)
        # r = min(⌊0.5 n⌋, ⌊n/2⌋) = ⌊n/2⌋ per window
        assert int(res.keep.sum()) == int((counts - counts // 2).sum())
    assert ops[0] == ops[1], ops


# -- in the model -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fam", ["qwen", "smol"])
def test_ratio_zero_reproduces_full(models, image, fam):
    adapter = models[fam]
    full = ChatSession(adapter, SessionConfig(method="full", max_new_tokens=4))
    full.ask("What is shown here?", image)
    light = _run(adapter, image, max_new_tokens=4, ratios=0)
    torch.testing.assert_close(light.prefill_result.logits, full.prefill_result.logits)
    assert light.turns[0].token_ids == full.turns[0].token_ids
    assert light.report()["final_kv_bytes"] == full.report()["final_kv_bytes"]


@pytest.mark.parametrize("case", ["qwen-image", "smol-tiles", "qwen-video", "smol-video"])
def test_stage_counts_follow_the_formula(models, image, case):
    fam, kind = case.split("-")
    media = image if kind in ("image", "tiles") else video_media(4 if fam == "qwen" else 3, 320, 240)
    ratios = (0.5, 0.4, 0.5)
    session = _run(models[fam + "4"], media, layers=(0, 1, 2), ratios=ratios)
    report = session.report()
    stages = report["lightkv"]["stages"]
    layout = session.prepared.layout
    assert len(layout.frames) > 1 or kind == "image"
    if kind == "image":
        rows, cols = layout.frames[0].grid
        assert rows != cols  # a non-square grid
    previous = _visual_ids(session, 0)
    assert previous.numel() == layout.n_visual  # layers up to λ1 keep every visual token
    for k, (layer, stage) in enumerate(zip((0, 1, 2), stages)):
        survivors = _visual_ids(session, layer + 1)
        assert set(survivors.tolist()) <= set(previous.tolist())
        expected = _expected_survivors(session, previous, stage["windows"], ratios[k])
        assert survivors.numel() == expected == stage["tokens_out"]
        assert stage["tokens_in"] == previous.numel()
        previous = survivors
    # Windows never mix tiles / frames; the survivors are exactly the tokens that map to themselves.
    merge_map = torch.tensor(report["merge_map"])
    frame = torch.from_numpy(layout.frame)
    assert torch.equal(frame[merge_map], frame)
    assert set((merge_map == torch.arange(layout.n_visual)).nonzero().flatten().tolist()) == set(previous.tolist())
    # Per-layer report agrees with the cache.
    per_layer = report["layer_tokens"]
    assert [row["visual_tokens"] for row in per_layer] == [_visual_ids(session, i).numel() for i in range(4)]
    assert sum(row["kv_bytes"] for row in per_layer) == report["final_kv_bytes"]
    assert sum(report["retained"]) < layout.n_visual * 0.75


@pytest.mark.parametrize("ratios", [(0.5, 0.0, 0.0), (0.5, 0.0, 0.5), (0.0, 0.5, 0.5)])
def test_stages_without_merging_keep_the_counts(models, image, ratios):
    """A stage that merges nothing (P = 0) between stages whose windows cut each other (6 -> 4 -> 2 on Qwen's
    13 x 23 grid): later stages still follow the formula on the tokens that reach them."""
    session = _run(models["qwen4"], image, layers=(0, 1, 2), windows=(6, 4, 2), ratios=ratios)
    stages = session.report()["lightkv"]["stages"]
    previous = _visual_ids(session, 0)
    for k, stage in enumerate(stages):
        survivors = _visual_ids(session, k + 1)
        expected = _expected_survivors(session, previous, stage["windows"], ratios[k])
        assert stage["tokens_in"] == previous.numel() and survivors.numel() == expected == stage["tokens_out"]
        previous = survivors


def test_single_stage_windows_stay_inside_their_window(models, image):
    session = _run(models["smol"], image)  # 2 layers: default schedule = one stage after layer 0, 4 x 4 windows
    layout = session.prepared.layout
    assert report_stage_windows(session) == [4]
    merge_map = torch.tensor(session.report()["merge_map"])
    assert int((merge_map != torch.arange(layout.n_visual)).sum()) > 0
    for v, owner in enumerate(merge_map.tolist()):
        f, g = int(layout.frame[v]), int(layout.frame[owner])
        rows, cols = layout.frames[f].grid
        assert f == g
        assert int(layout.row[v]) * 4 // rows == int(layout.row[owner]) * 4 // rows
        assert int(layout.col[v]) * 4 // cols == int(layout.col[owner]) * 4 // cols


def report_stage_windows(session: ChatSession) -> list[int]:
    return session.report()["lightkv"]["windows"]


class _RecordingLightKV(LightKV):
    """Records the token indices and position ids every layer runs on."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.seen: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    def after_layer(self, ctx, state):
        self.seen.append((state.layer_idx, state.token_index.clone(), state.positions.clone()))
        new = super().after_layer(ctx, state)
        if new is not None:
            assert new.cos.shape[1] == new.hidden.shape[1] == new.positions.shape[1] == new.token_index.shape[0]
        return new


def test_kept_tokens_keep_their_original_positions(models, image):
    adapter = models["qwen4"]  # 3-D M-RoPE positions
    session = ChatSession(adapter, SessionConfig(method="lightkv", max_new_tokens=3))
    session.method = _RecordingLightKV(layers=(0, 2))
    decode_positions = []
    rotary = adapter.rotary

    def spy(hidden, positions):
        if positions.shape[1] == 1:
            decode_positions.append(positions[:, 0].tolist())
        return rotary(hidden, positions)

    adapter.rotary = spy
    try:
        session.ask("Where is the red square?", image)
    finally:
        del adapter.rotary
    prepared = session.prepared
    table = prepared.position_ids
    lengths = []
    for layer, token_index, positions in session.method.seen:
        assert torch.equal(positions, table[:, token_index.long()])  # original ids, all three axes
        lengths.append(token_index.numel())
    assert lengths[0] == prepared.seq_len > lengths[1] == lengths[2] > lengths[3]  # merged after layers 0 and 2
    text = (~prepared.visual_mask).nonzero().flatten()
    for layer in session.cache.layers:
        idx = layer.token_index[0, 0].long()
        assert bool((idx[1:] > idx[:-1]).all())
        prompt_idx = idx[idx < prepared.seq_len]
        assert set(text.tolist()) <= set(prompt_idx.tolist())  # protected tokens never merged
        assert idx[-2:].tolist() == [prepared.seq_len, prepared.seq_len + 1]  # decoded tokens continue the numbering
    n = prepared.next_position
    assert decode_positions == [[n, n, n], [n + 1, n + 1, n + 1]]


def test_different_prompts_merge_differently(models, image):
    # An own copy with sharpened attention: random tiny weights give near-uniform ξ, trained models do not.
    adapter = load_model(DEEP["qwen"][1])
    with torch.no_grad():
        for layer in adapter.layers:
            for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                lin.weight.mul_(6)
                if lin.bias is not None:
                    lin.bias.mul_(6)
    a = _run(adapter, image, "What color is the sky in this picture?", layers=(0, 1, 2))
    b = _run(adapter, image, "Count the small squares near the bottom left corner, please.", layers=(0, 1, 2))
    xi_a, xi_b = a.method.last_xi[0], b.method.last_xi[0]
    assert not torch.allclose(xi_a / xi_a.sum(), xi_b / xi_b.sum(), rtol=0.05)
    assert a.report()["merge_map"] != b.report()["merge_map"]

    def visual_keys(session, layer):
        cache = session.cache.layers[layer]
        vis = session.prepared.visual_mask[cache.token_index[0, 0].long()]
        return cache.token_index[0, 0][vis], cache.keys[:, :, vis]

    # The image comes before the question: without merging its keys cannot depend on the question (layer 0,
    # before any merge, proves it); after merges the kept tokens hold ξ-weighted averages, so they differ.
    assert torch.equal(visual_keys(a, 0)[1], visual_keys(b, 0)[1])
    (idx_a, k_a), (idx_b, k_b) = visual_keys(a, 1), visual_keys(b, 1)
    assert torch.equal(idx_a, idx_b)  # stage 1 picks pairs by similarity of image states only
    assert not torch.allclose(k_a, k_b)


@pytest.mark.parametrize("followup", ["reuse", "reprefill"])
def test_multi_turn(models, image, followup):
    adapter = models["smol4"]
    cfg = SessionConfig(method="lightkv", max_new_tokens=3, followup=followup, method_options={"layers": (0, 2)})
    session = ChatSession(adapter, cfg)
    session.ask("What is shown here?", image)
    visual_after_first = [_visual_ids(session, i).numel() for i in range(4)]
    session.ask("Is there any text?")
    report = session.report()
    assert len(report["turns"]) == 2 and all(t["token_ids"] for t in report["turns"])
    assert [_visual_ids(session, i).numel() for i in range(4)] == visual_after_first or followup == "reprefill"
    assert report["lightkv"]["xi_source"] == ("proxy" if followup == "reprefill" else "inline")
    assert visual_after_first[1] < visual_after_first[0]


def test_blockwise_prefill_merges_per_block(models, image):
    adapter = models["qwen4"]
    full = ChatSession(adapter, SessionConfig(method="full", prefill="blockwise", block_size=64, max_new_tokens=1))
    full.ask("What is shown here?", image)
    same = ChatSession(
        adapter,
        SessionConfig(
            method="lightkv", prefill="blockwise", block_size=64, max_new_tokens=1, method_options={"ratios": 0}
        ),
    )
    same.ask("What is shown here?", image)
    torch.testing.assert_close(same.prefill_result.logits, full.prefill_result.logits)

    session = ChatSession(
        adapter,
        SessionConfig(
            method="lightkv", prefill="blockwise", block_size=64, max_new_tokens=1, method_options={"layers": (0,)}
        ),
    )
    session.ask("What is shown here?", image)
    report = session.report()
    assert report["lightkv"]["xi_source"] == "proxy" and len(report["blocks"]) > 3
    prepared = session.prepared
    seq_block = torch.zeros(prepared.seq_len, dtype=torch.long)
    for block in session.prefill_result.context.blocks:
        seq_block[block.start : block.end] = block.index
    block_of_vid = seq_block[torch.from_numpy(prepared.layout.seq_index)]
    expected = _expected_survivors(session, _visual_ids(session, 0), 6, 0.5, block_of_vid)
    assert _visual_ids(session, 1).numel() == expected


def test_report_fields(models, image):
    session = _run(models["qwen4"], image, layers=(0, 1, 2))
    info = session.report()["lightkv"]
    assert info["layers"] == [0, 1, 2] and info["windows"] == [6, 4, 2] and info["ratios"] == [0.5, 0.5, 0.5]
    assert info["overhead_seconds"]["xi"] > 0 and info["overhead_seconds"]["merge"] > 0
    assert 0.3 < info["flops"]["reduction"] < 0.8
    assert info["flops"]["llm_lightkv"] < info["flops"]["llm_full"]


def test_question_apart_takes_xi_from_the_proxy_pass(models, image):
    """Composed with Sali-Cache the question is a block of its own (`question_apart`), so it is not in the media's
    forward even in bulk: ξ must come from the proxy pass (LightKV reads the engine's blocks, `ctx.blocks`)."""
    session = ChatSession(models["qwen"], SessionConfig(method="lightkv+salicache", max_new_tokens=1))
    session.ask("What is shown here?", image)
    blocks = session.prefill_result.context.blocks
    assert [b.kind for b in blocks] == ["bulk", "text"]
    lk = session.report()["lightkv"]
    assert lk["xi_source"] == "proxy" and lk["overhead_seconds"]["proxy_pass"] > 0
