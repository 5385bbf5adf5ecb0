"""EVS keeps what vLLM's rule keeps, drops rows before the LLM through the engine's general hook, and composes.

The rule against a hand-written reference of vLLM's `compute_retention_mask` (written out here from its definition,
not imported or copied) on fixed tensors; then a synthetic clip with a static background and one moving square on
the tiny Qwen2.5-VL, whose kept tokens are worked out by hand from the square's place in each frame.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import (
    assert_guard_bounds_kv_from_above,
    assert_held_keys_are_the_full_caches,
    fake_prefill_context,
    get_adapter,
)
from visualkv.bench.synthetic import image_media, synthetic_image, video_media
from visualkv.errors import ConfigError
from visualkv.media import Media
from visualkv.methods import make_method, method_names, method_traits
from visualkv.methods.evs import EVS
from visualkv.runtime.session import ChatSession, SessionConfig

PROMPT = "What moves in the video?"
CELL = 28  # pixels per merged token of Qwen2.5-VL (14 px patches, 2 x 2 merged)


def vllm_retention(embeds: torch.Tensor, q: float) -> set[int]:
    """vLLM's EVS over embeddings (T, H, W, d): dissimilarity 1 - cos with the same place one frame earlier, 255 for
    the first frame; the max(H W, int(T H W (1 - q))) highest kept, ties to the earlier token. Flat indices."""
    t, h, w, _ = embeds.shape
    dis = 1 - torch.nn.functional.cosine_similarity(embeds[1:], embeds[:-1], dim=-1)
    flat = torch.cat([torch.full((1, h, w), 255.0), dis]).flatten().tolist()
    n_keep = max(h * w, int(t * h * w * (1 - q)))
    return set(sorted(range(len(flat)), key=lambda i: (-flat[i], i))[:n_keep])


@pytest.mark.parametrize("q", [0.0, 0.3, 0.5, 0.75, 0.9, 1.0])
def test_the_kept_set_on_fixed_tensors_is_vllms(q):
    """Random embeddings, some places static from frame to frame (exact ties): the kept video tokens are the
    reference's, every text row stays, and a block-by-block run keeps vLLM's count with the first frame whole."""
    t, h, w, d = 5, 3, 4, 16
    gen = torch.Generator().manual_seed(0)
    embeds = torch.randn(t, h, w, d, generator=gen)
    embeds[1:, :2] = embeds[:1, :2]  # the top two rows never change
    ctx, prefix, n = fake_prefill_context(t, h, w)
    hidden = torch.cat([torch.randn(1, prefix, d), embeds.reshape(1, n, d), torch.randn(1, 2, d)], dim=1)
    method = EVS(pruning_rate=q)
    method.begin(ctx)
    rows = method.select_rows(ctx, hidden, torch.arange(ctx.prepared.seq_len))
    rows = set(range(ctx.prepared.seq_len)) if rows is None else set(rows.tolist())
    assert {r - prefix for r in rows if prefix <= r < prefix + n} == vllm_retention(embeds, q)
    assert set(range(prefix)) | {prefix + n, prefix + n + 1} <= rows
    blockwise = EVS(pruning_rate=q)
    blockwise.begin(ctx)
    kept = []
    for start in (0, prefix + 2 * h * w, prefix + 3 * h * w):  # blocks: text + 2 frames, 1 frame, 2 frames + text
        end = {0: prefix + 2 * h * w, prefix + 2 * h * w: prefix + 3 * h * w}.get(start, ctx.prepared.seq_len)
        local = torch.arange(start, end)
        chosen = blockwise.select_rows(ctx, hidden[:, start:end], local)
        kept += (local if chosen is None else local[chosen]).tolist()
    video = [r - prefix for r in kept if prefix <= r < prefix + n]
    assert len(video) == len(vllm_retention(embeds, q)) and set(range(h * w)) <= set(video)


def moving_square_clip(n_frames: int = 8, width: int = 224, height: int = 168, row: int = 2) -> Media:
    """A static textured background; a white square of one token cell at token row `row`, one cell further right
    every Qwen temporal patch (2 frames), so the two frames of each patch are equal."""
    background = synthetic_image(width, height, 5)
    frames = []
    for i in range(n_frames):
        frame = background.copy()
        patch = i // 2
        frame[row * CELL : (row + 1) * CELL, patch * CELL : (patch + 1) * CELL] = 255
        frames.append(np.ascontiguousarray(frame))
    return Media("video", frames, [i / 2 for i in range(n_frames)], 2.0, n_frames / 2, None)


def _held_visual(session) -> list[set[int]]:
    """Per layer and KV head: the visual sequence indices the cache holds for the prompt."""
    visual = set(session.prepared.layout.seq_index.tolist())
    return [set(head.tolist()) & visual for layer in session.cache.layers for head in layer.token_index[0]]


def _evs(adapter, media, max_new_tokens: int = 2, **options) -> ChatSession:
    session = ChatSession(adapter, SessionConfig(method="evs", method_options=options, max_new_tokens=max_new_tokens))
    session.ask(PROMPT, media)
    return session


def test_kept_patches_are_the_moving_objects_and_the_first_frame():
    """4 temporal patches of 6 x 8 tokens: patch 0 whole (48), and in each later patch u the square's cell (2, u)
    and the cell it left, (2, u - 1): 48 + 3 x 2 = 54 of 192, asked as q = 1 - 54.5 / 192."""
    adapter = get_adapter("tiny-qwen2.5-vl")
    session = _evs(adapter, moving_square_clip(), pruning_rate=1 - 54.5 / 192)
    layout = session.prepared.layout
    assert [f.grid for f in layout.frames] == [(6, 8)] * 4

    def seq(patch: int, row: int, col: int) -> int:
        (i,) = np.flatnonzero((layout.frame == patch) & (layout.row == row) & (layout.col == col))
        return int(layout.seq_index[i])

    first = {int(s) for s in layout.seq_index[layout.frame == 0]}
    moving = {seq(u, 2, c) for u in (1, 2, 3) for c in (u - 1, u)}
    assert all(layout.box[layout.seq_index.tolist().index(s)][1] == 2 * CELL for s in moving)  # the square's row
    assert all(head == first | moving for head in _held_visual(session))
    report = session.report()
    assert (report["evs_kept"], report["evs_video_tokens"]) == (54, 192)


@pytest.mark.parametrize("q", [0.25, 0.5, 0.9])
def test_the_retention_rate_is_the_one_asked_and_the_first_frame_stays_whole(q):
    """vLLM's count max(48, int(192 (1 - q))) in every layer; the moving square's tokens whenever that leaves room."""
    adapter = get_adapter("tiny-qwen2.5-vl")
    session = _evs(adapter, moving_square_clip(), pruning_rate=q)
    layout = session.prepared.layout
    first = {int(s) for s in layout.seq_index[layout.frame == 0]}
    n_keep = max(48, int(192 * (1 - q)))
    for head in _held_visual(session):
        assert len(head) == n_keep and first <= head
    assert session.report()["final_kv_bytes"] < session.report()["full_kv_bytes"]


@pytest.mark.parametrize("alias", ["tiny-qwen2.5-vl", "tiny-smolvlm2"])
def test_exact_at_rate_zero_and_an_image_is_kept_whole(alias):
    """q = 0 gives the full model's logits and tokens on a video; an image has no previous frame, so any rate keeps
    it whole (and the report says why); q = 0.75 on the video does move the logits (the check bites)."""
    adapter = get_adapter(alias)
    video, image = video_media(8, 224, 168, fps=1.0, seed=2), image_media(448, 336, seed=1)
    for media, q in ((video, 0.0), (image, 0.75)):
        full = ChatSession(adapter, SessionConfig(method="full", max_new_tokens=4))
        full_record = full.ask(PROMPT, media)
        session = ChatSession(
            adapter, SessionConfig(method="evs", method_options={"pruning_rate": q}, max_new_tokens=4)
        )
        record = session.ask(PROMPT, media)
        assert torch.allclose(session.prefill_result.logits, full.prefill_result.logits, atol=1e-4, rtol=1e-4)
        assert record.token_ids == full_record.token_ids
    assert "still image" in session.report()["evs_note"]
    pruned = _evs(adapter, video, pruning_rate=0.75)
    assert not torch.allclose(pruned.prefill_result.logits, full.prefill_result.logits, atol=1e-4)


def test_dropped_rows_never_reach_a_decoder_layer_and_kept_ones_keep_their_positions():
    """The decoder layers see exactly the kept rows; layer 0's keys of the kept tokens equal the full cache's (they
    depend on the token and its original position only: M-RoPE's 3-D ids), and a follow-up continues the numbering."""
    adapter = get_adapter("tiny-qwen2.5-vl")
    clip = moving_square_clip()
    rows_in = []
    handle = adapter.layers[0].register_forward_pre_hook(lambda module, args: rows_in.append(args[0].shape[1]))
    try:
        session = _evs(adapter, clip, max_new_tokens=1, pruning_rate=0.5)  # 1: no decode step, no answer fed
    finally:
        handle.remove()
    prompt_len, n_visual = session.prepared.seq_len, session.prepared.layout.n_visual
    assert rows_in[0] == prompt_len - (n_visual - max(48, int(n_visual * 0.5)))  # the prefill's one block
    session.ask("And then?")
    full = ChatSession(adapter, SessionConfig(method="full", max_new_tokens=1))
    full.ask(PROMPT, clip)
    full.ask("And then?")
    assert_held_keys_are_the_full_caches(session.cache, full.cache, below=prompt_len)
    layer, ref = session.cache.layers[0], full.cache.layers[0]
    n_follow = int(session.state.history_ids[-1].shape[0]) - 1
    assert torch.allclose(layer.keys[0, :, -n_follow:], ref.keys[0, :, -n_follow:], atol=1e-5)


def test_the_engine_refuses_a_method_that_drops_protected_text(monkeypatch):
    monkeypatch.setattr(EVS, "select_rows", lambda self, ctx, hidden, local: torch.arange(1, local.numel()))
    session = ChatSession(get_adapter("tiny-qwen2.5-vl"), SessionConfig(method="evs", max_new_tokens=1))
    with pytest.raises(ValueError, match="dropped protected tokens"):
        session.ask(PROMPT, moving_square_clip())


def test_composes_with_blockwise_eviction_and_refuses_the_rest_in_one_line():
    """`blockwise-keydiff+evs` runs block-wise: EVS keeps vLLM's count over the video and the budget bounds every
    layer; Sali-Cache (the other entry stage) and LightKV (whose windows are planned before any row is dropped)
    are refused with one line, and are not offered."""
    names = method_names()
    assert {"blockwise-keydiff+evs", "blockwise-snapkv+evs", "streamingllm+evs", "pyramidkv+evs"} <= set(names)
    assert not [n for n in names if "evs" in n.split("+") and ({"lightkv", "salicache"} & set(n.split("+")))]
    for name, words in (("lightkv+evs", "evs does not compose with lightkv"), ("salicache+evs", "both entry")):
        with pytest.raises(ConfigError, match=words) as refused:
            method_traits(name)
        assert "\n" not in str(refused.value)
    assert make_method("blockwise-keydiff+evs", pruning_rate=0.5).stages[0].config.pruning_rate == 0.5
    adapter = get_adapter("tiny-qwen2.5-vl")
    budget, block = 40, 48
    config = SessionConfig(
        method="blockwise-keydiff+evs",
        method_options={"pruning_rate": 0.5},
        budget=budget,
        prefill="blockwise",
        block_size=block,
    )
    session = ChatSession(adapter, config)
    session.ask(PROMPT, moving_square_clip())
    assert session.blocks[0].n_blocks == 6  # the prompt's text, one block per temporal patch, the question
    report = session.report()
    assert (report["evs_kept"], report["evs_video_tokens"]) == (96, 192)  # max(48, int(192 x 0.5))
    assert all(len(head) == budget for head in _held_visual(session))


def test_a_block_whose_every_row_is_dropped_is_still_reported():
    """At vLLM's floor of one frame's tokens (q = 0.9 keeps the first temporal patch alone), the blocks of the later
    patches lose every row: they run no decoder layer, yet each is reported, so the progress reaches the last block."""
    adapter = get_adapter("tiny-qwen2.5-vl")
    config = SessionConfig(
        method="blockwise-keydiff+evs",
        method_options={"pruning_rate": 0.9},
        budget=4096,
        prefill="blockwise",
        block_size=48,
    )
    session = ChatSession(adapter, config)
    session.ask(PROMPT, moving_square_clip())
    assert [(b.index, b.n_blocks) for b in session.blocks] == [(i, 6) for i in range(6)]
    assert [b.tokens_in for b in session.blocks[2:5]] == [0, 0, 0]  # temporal patches 1-3
    assert session.blocks[1].visual_tokens_in == 48 and session.report()["evs_kept"] == 48


def test_the_memory_guard_bounds_evs_from_above():
    """Dropping rows only lowers memory: the guard predicts at least the measured peak of entries and buffers."""
    runs = (("evs", None, "bulk"), ("blockwise-keydiff+evs", 40, "blockwise"))
    assert_guard_bounds_kv_from_above(moving_square_clip(), runs, PROMPT)


def test_compare_ticks_evs_beside_salicache_for_a_video_only():
    from visualkv.runtime.streaming import compared_by_default

    names = method_names()
    video, image = compared_by_default("video", names), compared_by_default("image", names)
    assert {"evs", "salicache"} <= set(video) and not {"evs", "salicache"} & set(image)
    assert video == [n for n in names if n in video]  # in menu order


def test_the_cli_runs_evs_with_its_flag_and_the_app_offers_its_setting(tmp_path, capsys):
    """`run --method evs --video-pruning-rate 0.5` (the flag generated from its config) keeps vLLM's count; the
    app's settings for it and for its composition come from the same declaration; a bad rate is one line."""
    import json

    from visualkv.bench.synthetic import write_video_file
    from visualkv.cli.main import main
    from visualkv.runtime.streaming import method_options, method_settings

    video = write_video_file(str(tmp_path / "clip.mp4"), n_frames=8, width=224, height=168, fps=2.0)
    out = tmp_path / "r.json"
    argv = ["run", "--media", video, "--prompt", PROMPT, "--model", "tiny-qwen2.5-vl", "--max-new-tokens", "1"]
    code = main([*argv, "--quiet", "--method", "evs", "--video-pruning-rate", "0.5", "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    report = json.loads(out.read_text())
    n_video = report["evs_video_tokens"]
    assert n_video > 0 and report["evs_kept"] == int(n_video * 0.5)  # above the first frame: several frames
    assert main([*argv, "--method", "evs", "--video-pruning-rate", "1.5"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert [s.key for s in method_settings("evs")] == ["pruning_rate"]
    assert "evs:pruning_rate" in [s.key for s in method_settings("blockwise-keydiff+evs")]
    assert method_options("evs", {"pruning_rate": 0.25}) == {"pruning_rate": 0.25}
