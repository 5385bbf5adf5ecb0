"""Sali-Cache end to end on the tiny models: frames skipped before encoding, packed tiers, exactness,
pruned tokens absent, original positions, bad input through the CLI.

INT8 / INT4 round trips are tested in tests/test_quant.py and the pixel signals in
tests/test_saliency.py; here the method, the engine and the cache work together.
"""

from __future__ import annotations

import json
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from tests.conftest import FAMILIES, get_adapter
from visualkv.bench.synthetic import synthetic_image
from visualkv.cli.main import main
from visualkv.kv.cache import TIER_FULL, TIER_INT4, TIER_INT8
from visualkv.kv.quant import QuantSpec, dequantize, packed_bytes_per_token
from visualkv.media import Media
from visualkv.methods.salicache import TIER_SKIPPED
from visualkv.runtime.session import ChatSession, SessionConfig

PROMPT = "What happens?"
W, H = 224, 168
EXAMPLE = Path(__file__).resolve().parent.parent / "assets" / "example_video.webm"


# -- helpers ----------------------------------------------------------------------------------


def _video(frames: list[np.ndarray]) -> Media:
    n = len(frames)
    return Media(
        kind="video", frames=frames, times=[float(i) for i in range(n)], source_fps=1.0, duration=float(n), path=None
    )


def _noisy(frame: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Camera noise of sigma 2: static frames are never bit-identical."""
    return np.clip(frame + rng.normal(0, 2.0, frame.shape), 0, 255).astype(np.uint8)


def _story_clip() -> tuple[Media, dict]:
    """12 frames: static scene A (0-3), hard cut to B at 4, static B, a red ball in frame 9 only,
    static B again. Frame 9 is the *second* frame of Qwen's temporal patch (8, 9)."""
    rng = np.random.default_rng(0)
    scene_a, scene_b = synthetic_image(W, H, seed=11).astype(np.float32), synthetic_image(W, H, seed=12)
    frames = [_noisy(scene_a, rng) for _ in range(4)]
    for i in range(4, 12):
        frame = scene_b.copy()
        if i == 9:
            cv2.circle(frame, (150, 90), 14, (255, 0, 0), -1)
        frames.append(_noisy(frame.astype(np.float32), rng))
    kept_frames = {"tiny-smolvlm2": [0, 4, 9, 10], "tiny-qwen2.5-vl": [0, 2, 4, 5]}  # units
    return _video(frames), kept_frames


def _session(alias: str, method: str = "salicache", max_new_tokens: int = 1, **options) -> ChatSession:
    return ChatSession(
        get_adapter(alias), SessionConfig(method=method, max_new_tokens=max_new_tokens, method_options=options)
    )


_FULL: dict = {}


def _full_reference(alias: str, media: Media, key: str) -> ChatSession:
    """The uncompressed session for (alias, media), run once per test module (3 greedy tokens)."""
    if (alias, key) not in _FULL:
        session = _session(alias, "full", max_new_tokens=3)
        session.ask(PROMPT, media)
        _FULL[alias, key] = session
    return _FULL[alias, key]


def _spy_encoder(adapter, monkeypatch) -> list[int]:
    """Unit (frame / temporal patch) indices the vision tower is asked to encode."""
    calls: list[int] = []
    original = adapter.encode_units

    def spy(prepared, units):
        calls.extend(u.frame for u in units)
        return original(prepared, units)

    monkeypatch.setattr(adapter, "encode_units", spy)
    return calls


def _entries(layer) -> list[int]:
    """Token indices of every entry of head 0 of a cache layer (all tiers), sorted."""
    return sorted(layer.all_token_index()[0, 0].tolist())


# -- storage: bytes per token per tier -----------------------------------------------------------


@pytest.mark.parametrize("alias", FAMILIES)
def test_bytes_per_token_of_each_tier_match_the_formula(alias, small_video):
    group = 8  # head_dim 16: two groups per token, so the scale / zero count matters
    s = _session(alias, tiers="0.4,0.3,0.3", group_size=group, flow_threshold=0.0)
    s.ask(PROMPT, small_video)
    a = s.adapter
    itemsize = torch.empty((), dtype=a.dtype).element_size()
    ctx = s.prefill_result.context
    visual_tiers = torch.tensor(s.report()["tier"])
    assert set(visual_tiers.tolist()) == {TIER_FULL, TIER_INT8, TIER_INT4}  # nothing pruned or skipped
    n_full = s.prepared.seq_len - int(((ctx.tiers == TIER_INT8) | (ctx.tiers == TIER_INT4)).sum())
    expected_total = 0
    for layer in s.cache.layers:
        counts = layer.tier_counts()
        heads = a.num_kv_heads
        assert counts[TIER_FULL] == n_full * heads
        assert layer.keys.nbytes == layer.values.nbytes == n_full * heads * a.head_dim * itemsize
        for tier, bits in ((TIER_INT8, 8), (TIER_INT4, 4)):
            seg = layer.quant[tier]
            n = int((visual_tiers == tier).sum())
            assert counts[tier] == n * heads
            per_token = packed_bytes_per_token(a.head_dim, QuantSpec(bits, group), a.dtype)
            assert per_token == a.head_dim * bits // 8 + 2 * (a.head_dim // group) * itemsize
            assert seg.keys.nbytes == seg.values.nbytes == n * heads * per_token
            assert seg.keys.data.dtype == torch.uint8 and seg.keys.data.shape[-1] == a.head_dim * bits // 8
        expected_total += layer.keys.nbytes * 2 + sum(
            2
            * int((visual_tiers == t).sum())
            * heads
            * packed_bytes_per_token(a.head_dim, QuantSpec(b, group), a.dtype)
            for t, b in ((TIER_INT8, 8), (TIER_INT4, 4))
        )
    report = s.report()
    assert report["final_kv_bytes"] == s.cache.kv_bytes() == expected_total
    assert sum(report["kv_bytes_by_tier"].values()) == expected_total
    assert report["final_kv_bytes"] < report["full_kv_bytes"]

    # Just-in-time dequantization: layer-0 keys depend only on token and position, so the packed
    # entries must dequantize to the full cache's keys within half a quantization step.
    ref = _full_reference(alias, small_video, "small_video").cache.layers[0]
    for tier in (TIER_INT8, TIER_INT4):
        seg = s.cache.layers[0].quant[tier]
        keys = dequantize(seg.keys)[0]  # (heads, n, head_dim)
        idx = seg.token_index[0].long()
        want = torch.stack([ref.keys[0, h, idx[h]] for h in range(idx.shape[0])])
        step = seg.keys.scale[0].float().repeat_interleave(group, dim=-1)
        assert bool(((keys - want).abs() <= step / 2 + 1e-5).all())


# -- exactness -----------------------------------------------------------------------------------


@pytest.mark.parametrize("alias", FAMILIES)
def test_all_full_precision_and_tau_zero_reproduce_full(alias, small_image, small_video):
    for key, media in (("small_image", small_image), ("small_video", small_video)):
        ref = _full_reference(alias, media, key)
        ref_record = ref.turns[-1]
        s = _session(alias, max_new_tokens=3, tiers="1,0,0", flow_threshold=0.0)
        record = s.ask(PROMPT, media)
        assert torch.allclose(s.prefill_result.logits, ref.prefill_result.logits, atol=1e-4, rtol=1e-4)
        assert record.token_ids == ref_record.token_ids
        report = s.report()
        assert report["tiers"]["full"] == report["visual_tokens"]
        assert report["final_kv_bytes"] == ref.report()["final_kv_bytes"]
        if media.kind == "video":
            assert not any(f["skipped"] for f in report["frames"])


@pytest.mark.parametrize("alias", FAMILIES)
def test_first_answer_token_reads_the_media_as_stored(alias, small_image):
    """All media tokens INT4 (nothing pruned, nothing skipped): the question runs after the media as its
    own block, so the first answer token's logits carry the quantization error (a bulk forward would let
    the question see the fresh full-precision keys, and give `full`'s logits exactly)."""
    ref = _full_reference(alias, small_image, "small_image")
    s = _session(alias, max_new_tokens=1, tiers="0,0,1", flow_threshold=0.0)
    s.ask(PROMPT, small_image)
    report = s.report()
    assert report["tiers"]["int4"] == report["visual_tokens"]
    assert [b["kind"] for b in report["blocks"]] == ["bulk", "text"]
    diff = (s.prefill_result.logits - ref.prefill_result.logits).abs().max().item()
    assert diff > 1e-4, "the question did not read the quantized media"
    assert torch.nn.functional.cosine_similarity(s.prefill_result.logits, ref.prefill_result.logits, dim=0) > 0.9


# -- temporal filter: skipped before the encoder, cut and event kept -----------------------------


@pytest.mark.parametrize("alias", FAMILIES)
def test_static_clip_is_skipped_after_its_first_frame(alias, monkeypatch):
    rng = np.random.default_rng(1)
    scene = synthetic_image(W, H, seed=5).astype(np.float32)
    media = _video([_noisy(scene, rng) for _ in range(6)])
    s = _session(alias)
    encoded = _spy_encoder(s.adapter, monkeypatch)
    s.ask(PROMPT, media)
    report = s.report()
    assert [f["skipped"] for f in report["frames"]] == [False] * (2 if "qwen" in alias else 1) + [True] * (
        4 if "qwen" in alias else 5
    )
    assert [f["redundant"] for f in report["frames"]] == [False] + [True] * 5
    assert report["frames"][0]["motion"] is None and all(f["motion"] < 0.1 for f in report["frames"][1:])
    assert encoded == report["vision_encoder_units"] == [0] and report["vision_encoder_frames"] == 1


@pytest.mark.parametrize("alias", FAMILIES)
def test_cut_and_event_are_kept_and_only_kept_frames_are_encoded(alias, monkeypatch):
    media, kept_units = _story_clip()
    s = _session(alias)
    encoded = _spy_encoder(s.adapter, monkeypatch)
    s.ask(PROMPT, media)
    report = s.report()
    layout = s.prepared.layout
    assert encoded == kept_units[alias] == report["vision_encoder_units"]
    kept_frames = {f["index"] for f in report["frames"] if not f["skipped"]}
    assert {4, 9, 10} <= kept_frames  # the cut, the event, the ball vanishing
    assert kept_frames == {s for u in kept_units[alias] for s in layout.frames[u].source_frames}
    # every token of a skipped unit is tier "skipped", absent from the LLM, and costs no bytes
    skipped_tokens = int(
        sum(
            layout.frames[u].grid[0] * layout.frames[u].grid[1]
            for u in range(len(layout.frames))
            if u not in kept_units[alias]
        )
    )
    assert report["tiers"]["skipped"] == skipped_tokens == report["tier"].count(TIER_SKIPPED)


def test_example_video_at_defaults_tiny_qwen(monkeypatch):
    """The example video (64 s, 1 fps): static shots skipped, pan, cut and red-ball event kept,
    encoder called for kept patches only, final KV >= 2.2x smaller than the full cache."""
    from visualkv.media import FrameSampling, load_media

    media = load_media(EXAMPLE, sampling=FrameSampling(fps=1.0, max_frames=64))
    s = _session("tiny-qwen2.5-vl")
    encoded = _spy_encoder(s.adapter, monkeypatch)
    s.ask(PROMPT, media)
    report = s.report()
    frames = {f["index"]: f for f in report["frames"]}
    assert not frames[35]["skipped"] and not frames[45]["skipped"]  # cut at 35 s, ball at 45 s
    assert all(not frames[t]["skipped"] for t in range(21, 35))  # the pan
    assert all(frames[t]["skipped"] for t in (*range(2, 20), *range(36, 44), *range(48, 64)))
    assert encoded == report["vision_encoder_units"]
    assert report["full_kv_bytes"] / report["final_kv_bytes"] >= 2.2
    assert 0 < report["tiers"]["pruned"] and 0 < report["tiers"]["int4"] and 0 < report["tiers"]["int8"]


# -- pruned tokens never enter the LLM; positions stay original ----------------------------------


@pytest.mark.parametrize("alias", FAMILIES)
def test_pruned_and_skipped_tokens_are_absent_from_the_llm(alias):
    media, _ = _story_clip()
    s = _session(alias, tiers="0.3,0.2,0.2")  # 30 % of the kept frames' tokens pruned
    s.ask(PROMPT, media)
    report = s.report()
    prepared = s.prepared
    kept = set(prepared.keep.nonzero().flatten().tolist())
    dropped = set(range(prepared.seq_len)) - kept
    codes = np.array(report["tier"])
    seq = prepared.layout.seq_index
    assert dropped == set(seq[codes >= 3].tolist())  # exactly the pruned + skipped visual tokens
    assert report["tiers"]["pruned"] > 0 and report["tiers"]["skipped"] > 0
    assert sum(b["tokens_in"] for b in report["blocks"]) == len(kept) == report["llm_tokens"]
    for layer in s.cache.layers:
        assert _entries(layer) == sorted(kept)
        idx = layer.all_token_index()
        for head in range(idx.shape[1]):
            assert set(idx[0, head].tolist()) == kept


@pytest.mark.parametrize("alias", FAMILIES)
def test_kept_tokens_keep_original_positions(alias):
    """Layer-0 keys depend only on token and position: every full-precision entry (later frames
    after skipped ones included) equals the full cache's entry for the same token, and a follow-up
    continues the original numbering."""
    media, _ = _story_clip()
    s = _session(alias, tiers="0.8,0,0")
    s.ask(PROMPT, media)
    s.ask("And then?")
    full = _session(alias, "full")
    full.ask(PROMPT, media)
    full.ask("And then?")
    assert s.report()["tiers"]["skipped"] > 0
    layer, ref = s.cache.layers[0], full.cache.layers[0]
    idx = layer.token_index[0].long()  # (heads, n): full-precision entries only (no quantized tier)
    assert not layer.quant and idx.shape[1] < ref.token_index.shape[2]
    assert int(idx[0].max()) >= s.prepared.suffix_start  # later tokens are there
    for head in range(idx.shape[0]):
        assert torch.allclose(layer.keys[0, head], ref.keys[0, head, idx[head]], atol=1e-4)
    n_follow = int(s.state.history_ids[-1].shape[0])
    assert torch.allclose(layer.keys[0, :, -n_follow:], ref.keys[0, :, -n_follow:], atol=1e-5)


# -- options and bad input through the CLI -------------------------------------------------------


def _write_video(path: Path, frames: list[np.ndarray], fps: float, fourcc: str) -> Path:
    h, w = frames[0].shape[:2]
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*fourcc), fps, (w, h))
    assert writer.isOpened()
    for frame in frames:
        writer.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
    writer.release()
    return path


def _noise_frames(n: int, w: int = 64, h: int = 48) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for _ in range(n)]


def _run(capsys, *args: str) -> tuple[int, str]:
    code = main(["run", "--model", "tiny-smolvlm2", "--prompt", PROMPT, "--max-new-tokens", "1", "--quiet", *args])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def test_video_with_undecodable_frame_runs_and_reports_the_gap(tmp_path, capsys):
    path = _write_video(tmp_path / "bad.avi", _noise_frames(10), 4.0, "MJPG")
    data = bytearray(path.read_bytes())
    starts = [i for i in range(len(data) - 3) if data[i : i + 3] == b"\xff\xd8\xff"]
    data[starts[5] : starts[5] + 300] = bytes(300)  # frame 5 loses its JPEG headers
    path.write_bytes(bytes(data))
    out = tmp_path / "r.json"
    code, _ = _run(capsys, "--media", str(path), "--method", "salicache", "--fps", "4", "--json", str(out))
    assert code == 0
    report = json.loads(out.read_text())
    warned = report["media"]["warnings"]
    assert any("frame 5" in w for w in warned) and not any(str(tmp_path) in w for w in warned)  # no server path
    assert "media_warnings" not in report  # said once, in media.warnings (it held the file's whole path)
    # decoded lazily: frame 4 stands in for frame 5 (media.py), so the filter sees it repeated
    assert [f["time"] for f in report["frames"]] == [k / 4 for k in range(10)]
    # noise: every other frame differs; SmolVLM's unit is one frame, so the repeat is skipped
    assert [f["index"] for f in report["frames"] if f["redundant"]] == [5]
    assert [f["index"] for f in report["frames"] if f["skipped"]] == [5]


def test_one_frame_video(tmp_path, capsys):
    path = _write_video(tmp_path / "one.mp4", _noise_frames(1), 4.0, "mp4v")
    out = tmp_path / "r.json"
    code, _ = _run(capsys, "--media", str(path), "--method", "salicache", "--json", str(out))
    assert code == 0
    report = json.loads(out.read_text())
    assert [(f["index"], f["skipped"], f["motion"]) for f in report["frames"]] == [(0, False, None)]
    assert report["vision_encoder_frames"] == 1 and report["tiers"]["skipped"] == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tiers", "0.9,0.9,0"], "error: salicache: tier fractions must sum to <= 1"),
        (["--tiers", "half"], "error: salicache: tiers must be 'full,int8,int4' fractions"),
        (["--flow-threshold", "-1"], "error: salicache flow_threshold must be a number from 0 to 1,000, got -1.0"),
    ],
)
def test_bad_options_give_one_line(capsys, args, message):
    code, err = _run(capsys, "--method", "salicache", *args)
    assert code == 2 and err.strip().startswith(message) and len(err.strip().splitlines()) == 1


def test_salicache_options_refused_for_other_methods(capsys):
    code, err = _run(capsys, "--method", "full", "--tiers", "1,0,0")
    assert code == 2 and "apply to --method salicache only" in err and len(err.strip().splitlines()) == 1


def test_ten_hour_video_is_refused(tmp_path, capsys):
    path = _write_video(tmp_path / "ten_hours.mp4", _noise_frames(360, 32, 32), 0.01, "mp4v")
    code, err = _run(capsys, "--media", str(path), "--method", "salicache")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "video is 10.0 h long (360 frames at 0.01 fps, per its header); the limit is 3.0 h" in err


@pytest.mark.parametrize("prefill", ["bulk", "blockwise"])
def test_heavy_pruning_drops_whole_qwen_rows(prefill):
    """Rows whose every token is pruned are never sent to the LLM, in any prefill mode (regression)."""
    from visualkv.bench.synthetic import image_media

    adapter = get_adapter("tiny-qwen2.5-vl")
    s = ChatSession(
        adapter,
        SessionConfig(
            method="salicache", prefill=prefill, block_size=64, max_new_tokens=2, method_options={"tiers": "0.05,0,0"}
        ),
    )
    s.ask("What is it?", image_media(672, 378, seed=3))
    report = s.report()
    kept = report["tiers"]["full"]
    assert report["tiers"]["pruned"] > 0.9 * report["visual_tokens"]
    visual_in_cache = int(s.prefill_result.context.is_visual(s.cache.layers[0].token_index)[0, 0].sum())
    assert visual_in_cache == kept


def test_qwen_rows_with_gaps_encode_like_the_whole_image():
    from visualkv.bench.synthetic import image_media

    adapter = get_adapter("tiny-qwen2.5-vl")
    prepared = adapter.prepare(image_media(672, 378, seed=3), "What?")
    units = prepared.layout.units
    rows, cols = prepared.layout.frames[0].grid
    whole = adapter.encode_units(prepared, units).view(rows, cols, -1)
    chosen = [units[0], units[2], units[3], units[-1]]
    adapter.reset_stream()
    part = adapter.encode_units(prepared, chosen).view(len(chosen), cols, -1)
    assert torch.allclose(part, whole[[0, 2, 3, rows - 1]], atol=1e-6)
