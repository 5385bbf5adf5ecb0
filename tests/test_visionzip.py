"""VisionZip keeps what its rule keeps, merges the rest into its targets before the LLM, and composes.

The rule against a hand-written reference (written out here from the paper's and the official code's definition,
with the proxy ranking this implementation documents, in float64 numpy) on fixed tensors; then the tiny models.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import (
    assert_guard_bounds_kv_from_above,
    assert_held_keys_are_the_full_caches,
    fake_prefill_context,
    get_adapter,
)
from visualkv.bench.synthetic import image_media, synthetic_image, video_media
from visualkv.errors import ConfigError
from visualkv.methods import make_method, method_names, method_traits
from visualkv.methods.visionzip import VisionZip, counts
from visualkv.runtime.session import ChatSession, SessionConfig

PROMPT = "What is in the picture?"


def reference(h: np.ndarray, n_dom: int, n_ctx: int) -> tuple[set[int], dict[int, np.ndarray]]:
    """VisionZip on one unit's embeddings h (n, d): the n_dom tokens receiving the most attention (column sums of
    the row-wise softmax of h h^T / sqrt(d), ties to the earlier token); of the others in token order every
    (others // n_ctx)-th is a target (the first n_ctx of them); each other token joins its most cosine-similar
    target (the earlier one on a tie); a group becomes its mean, the target included. Returns (dominant set,
    {target: merged embedding})."""
    n, d = h.shape
    received = [0.0] * n
    for i in range(n):
        logits = [float(h[i] @ h[j]) / d**0.5 for j in range(n)]
        top = max(logits)
        weights = [np.exp(v - top) for v in logits]
        for j in range(n):
            received[j] += weights[j] / sum(weights)
    dominant = sorted(range(n), key=lambda j: (-received[j], j))[:n_dom]
    others = [j for j in range(n) if j not in dominant]
    if n_ctx == 0:
        return set(dominant), {}
    step = max(1, len(others) // n_ctx)
    targets = [others[k] for k in range(0, len(others), step)][:n_ctx]
    groups = {t: [t] for t in targets}
    for j in others:
        if j in groups:
            continue
        cos = [float(h[j] @ h[t] / (np.linalg.norm(h[j]) * np.linalg.norm(h[t]))) for t in targets]
        groups[targets[cos.index(max(cos))]].append(j)
    return set(dominant), {t: np.mean([h[j] for j in members], axis=0) for t, members in groups.items()}


def test_counts_are_the_shares_asked_rounded_half_up():
    """Hand-worked counts: the paper's 54 + 10 of 576; 0.25 and 0.1 of 48 are 12 and 4.8 -> 5; contextual takes at
    most what dominant leaves; a unit always keeps one token; an empty one none."""
    assert counts(576, 54 / 576, 10 / 576) == (54, 10)
    assert counts(48, 0.25, 0.1) == (12, 5)
    assert counts(10, 0.9, 0.5) == (9, 1)
    assert counts(10, 0.0, 0.0) == (1, 0) and counts(10, 0.0, 0.04) == (1, 0)
    assert counts(10, 0.0, 0.3) == (0, 3)
    assert counts(0, 0.5, 0.5) == (0, 0)


@pytest.mark.parametrize(("dominant", "contextual"), [(54 / 576, 10 / 576), (0.25, 0.1), (0.0, 0.3), (0.4, 0.0)])
def test_the_kept_set_and_merged_embeddings_on_fixed_tensors_are_the_rules(dominant, contextual):
    """Three frames of 6 x 8 random embeddings (one with a few near-copies, so groups differ in size): each frame's
    kept rows are its reference dominant tokens and targets, the targets' rows hold their groups' means, the other
    kept rows and every text row are unchanged, and the count is the one asked per frame."""
    t, h, w, d = 3, 6, 8, 16
    gen = torch.Generator().manual_seed(0)
    embeds = torch.randn(t, h * w, d, generator=gen)
    embeds[1, 10:20] = embeds[1, 3] + 0.01 * torch.randn(10, d, generator=gen)
    ctx, prefix, n = fake_prefill_context(t, h, w)
    hidden = torch.cat([torch.randn(1, prefix, d), embeds.reshape(1, n, d), torch.randn(1, 2, d)], dim=1)
    original = hidden.clone()
    method = VisionZip(dominant=dominant, contextual=contextual)
    method.begin(ctx)
    rows = method.select_rows(ctx, hidden, torch.arange(ctx.prepared.seq_len)).tolist()
    assert rows == sorted(rows) and set(range(prefix)) | {prefix + n, prefix + n + 1} <= set(rows)
    n_dom, n_ctx = counts(h * w, dominant, contextual)
    for f in range(t):
        start = prefix + f * h * w
        dominant_set, merged = reference(embeds[f].double().numpy(), n_dom, n_ctx)
        mine = {r - start for r in rows if start <= r < start + h * w}
        assert mine == dominant_set | set(merged) and len(mine) == n_dom + n_ctx
        for j in dominant_set:
            assert torch.equal(hidden[0, start + j], original[0, start + j])
        for j, mean in merged.items():
            assert np.allclose(hidden[0, start + j].numpy(), mean, atol=1e-5)
    assert torch.equal(hidden[0, :prefix], original[0, :prefix])
    report = method.report(ctx)
    assert (report["visionzip_dominant"], report["visionzip_contextual"]) == (t * n_dom, t * n_ctx)


def _held_visual(session) -> list[set[int]]:
    visual = set(session.prepared.layout.seq_index.tolist())
    return [set(head.tolist()) & visual for layer in session.cache.layers for head in layer.token_index[0]]


def _session(method: str = "visionzip", max_new_tokens: int = 1, **options) -> SessionConfig:
    return SessionConfig(method=method, method_options=options, max_new_tokens=max_new_tokens)


def test_the_kept_count_is_the_one_asked_per_image_and_frame():
    """Tiny Qwen2.5-VL: the image is one frame of 192 tokens (18 + 3 kept by default), the video 4 temporal patches
    of 48 (each 5 + 1: 4.5 and 0.83 rounded half up); every layer and head holds exactly those."""
    adapter = get_adapter("tiny-qwen2.5-vl")
    for media, sizes, kept in (
        (image_media(448, 336, seed=1), [192], 21),
        (video_media(8, 224, 168, seed=2), [48] * 4, 24),
    ):
        session = ChatSession(adapter, _session())
        session.ask(PROMPT, media)
        layout = session.prepared.layout
        assert np.bincount(layout.frame).tolist() == sizes
        assert all(len(head) == kept for head in _held_visual(session))
        assert session.report()["final_kv_bytes"] < session.report()["full_kv_bytes"]


@pytest.mark.parametrize("alias", ["tiny-qwen2.5-vl", "tiny-smolvlm2"])
def test_exact_where_everything_is_kept(alias):
    """dominant = 1, and dominant + contextual = 1 (every other token its own target), give the full model's logits
    and tokens on an image and a video; the default does move them (the check bites)."""
    adapter = get_adapter(alias)
    for media in (image_media(448, 336, seed=1), video_media(8, 224, 168, seed=2)):
        full = ChatSession(adapter, _session("full", max_new_tokens=4))
        full_record = full.ask(PROMPT, media)
        for options in ({"dominant": 1.0}, {"dominant": 0.3, "contextual": 0.7}):
            session = ChatSession(adapter, _session(max_new_tokens=4, **options))
            record = session.ask(PROMPT, media)
            assert torch.allclose(session.prefill_result.logits, full.prefill_result.logits, atol=1e-4, rtol=1e-4)
            assert record.token_ids == full_record.token_ids
        zipped = ChatSession(adapter, _session())
        zipped.ask(PROMPT, media)
        assert not torch.allclose(zipped.prefill_result.logits, full.prefill_result.logits, atol=1e-4)


def test_kept_tokens_keep_their_original_positions():
    """The decoder sees only the kept rows; the cache holds them at their original indices; layer 0's keys of the
    dominant (unmerged) tokens equal the full cache's (M-RoPE's 3-D ids: the token and its position only), and a
    follow-up continues the uncompressed numbering."""
    adapter = get_adapter("tiny-qwen2.5-vl")
    video = video_media(8, 224, 168, seed=2)
    rows_in = []
    handle = adapter.layers[0].register_forward_pre_hook(lambda module, args: rows_in.append(args[0].shape[1]))
    try:
        session = ChatSession(adapter, _session(dominant=0.25, contextual=0.0))
        session.ask(PROMPT, video)
    finally:
        handle.remove()
    prompt_len, n_visual = session.prepared.seq_len, session.prepared.layout.n_visual
    assert rows_in[0] == prompt_len - n_visual + 4 * 12
    session.ask("And then?")
    full = ChatSession(adapter, _session("full"))
    full.ask(PROMPT, video)
    full.ask("And then?")
    assert_held_keys_are_the_full_caches(session.cache, full.cache, below=prompt_len)
    layer, ref = session.cache.layers[0], full.cache.layers[0]
    n_follow = int(session.state.history_ids[-1].shape[0]) - 1
    assert torch.allclose(layer.keys[0, :, -n_follow:], ref.keys[0, :, -n_follow:], atol=1e-5)


def test_composes_with_blockwise_eviction_and_refuses_the_rest_in_one_line():
    """`blockwise-keydiff+visionzip` zips each block's frames and the budget bounds every layer; Sali-Cache and EVS
    (the other entry stages) and LightKV (windows planned before any row is dropped) are refused in one line."""
    assert {"blockwise-keydiff+visionzip", "streamingllm+visionzip", "pyramidkv+visionzip"} <= set(method_names())
    for name, words in (
        ("lightkv+visionzip", "visionzip does not compose with lightkv"),
        ("salicache+visionzip", "both entry"),
        ("evs+visionzip", "both entry"),
    ):
        with pytest.raises(ConfigError, match=words) as refused:
            method_traits(name)
        assert "\n" not in str(refused.value)
    assert make_method("blockwise-keydiff+visionzip", dominant=0.5).stages[0].config.dominant == 0.5
    config = SessionConfig(
        method="blockwise-keydiff+visionzip",
        method_options={"dominant": 0.5, "contextual": 0.25},
        budget=20,
        prefill="blockwise",
        block_size=48,
        max_new_tokens=1,
    )
    session = ChatSession(get_adapter("tiny-qwen2.5-vl"), config)
    session.ask(PROMPT, video_media(8, 224, 168, seed=2))
    report = session.report()
    assert (report["visionzip_dominant"], report["visionzip_contextual"]) == (4 * 24, 4 * 12)
    assert all(len(head) == 20 for head in _held_visual(session))


def test_the_memory_guard_bounds_visionzip_from_above():
    runs = (("visionzip", None, "bulk"), ("blockwise-keydiff+visionzip", 20, "blockwise"))
    assert_guard_bounds_kv_from_above(video_media(8, 224, 168, seed=2), runs, PROMPT)


def test_the_cli_runs_it_with_its_flags_and_bad_options_are_one_line(tmp_path, capsys):
    """`run --method visionzip --visionzip-dominant 0.25 --visionzip-contextual 0.05` on an image keeps 48 + 10 of
    its 192 tokens; an option out of range exits 2 with one line; the app's settings come from the same config."""
    from visualkv.cli.main import main
    from visualkv.runtime.streaming import method_settings

    path = str(tmp_path / "image.png")
    Image.fromarray(synthetic_image(448, 336)).save(path)
    out = tmp_path / "r.json"
    argv = ["run", "--media", path, "--prompt", PROMPT, "--model", "tiny-qwen2.5-vl", "--max-new-tokens", "1"]
    flags = ["--method", "visionzip", "--visionzip-dominant", "0.25", "--visionzip-contextual", "0.05"]
    assert main([*argv, "--quiet", *flags, "--json", str(out)]) == 0, capsys.readouterr().err
    report = json.loads(out.read_text())
    assert (report["visionzip_visual_tokens"], report["visionzip_dominant"], report["visionzip_contextual"]) == (
        192,
        48,
        10,
    )
    for bad in (["--visionzip-dominant", "1.5"], ["--visionzip-contextual", "-0.1"]):
        capsys.readouterr()
        assert main([*argv, "--method", "visionzip", *bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "visionzip" in err[0]
    with pytest.raises(ConfigError, match="visionzip dominant"):
        make_method("visionzip", dominant=2)
    assert [s.key for s in method_settings("visionzip")] == ["dominant", "contextual"]
    assert "visionzip:dominant" in [s.key for s in method_settings("blockwise-keydiff+visionzip")]
