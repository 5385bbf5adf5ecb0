"""Video frames resized at decode to what the processor needs.

A lazy video's frames reach the vision side through `ModelAdapter.video_for_encoding`: each frame is
resized right after decoding, by the video processor's own resize call, and cached small. The processor
then leaves it as is (torchvision returns a same-size input unchanged), so the visual tokens are the ones
the processor makes from the decoded frames: same ids, positions and grid, bit-identical pixel values and
embeddings (tolerance 0).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import get_adapter
from tests.test_media import corrupt_mjpeg, noise_frames, write_video
from visualkv.bench.synthetic import write_video_file
from visualkv.media import FrameSampling, LazyFrames, MediaLimits, load_media
from visualkv.methods import METHODS
from visualkv.runtime.memory_guard import estimate_prefill

ALL = FrameSampling(fps=1.0, max_frames=None)
NO_CAP = MediaLimits(max_frames=None)
FAMILIES = ["tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-smolvlm2", "tiny-llava-onevision", "tiny-internvl3.5"]
# Qwen2.5-VL's released processor keeps frames up to 12.8 MP (4K included) at about their size: nothing
# to shrink. These tests give its video processor a per-frame cap of 300 tokens (Qwen2-VL's default video
# processor has 768) so that its resize path runs; test_qwen_released_settings_on_short_clips checks the
# released settings leave the frames alone. Qwen3-VL's budget is a total over the clip (25 MP: a 5-frame
# 720p clip fits whole); it gets 300 tokens' worth per frame of this 5-frame clip, as a long video would.
SMALL_SIZES = {
    "tiny-qwen2.5-vl": {"shortest_edge": 3136, "longest_edge": 28 * 28 * 300},
    "tiny-qwen3-vl": {"shortest_edge": 4096, "longest_edge": 5 * 32 * 32 * 300},
}


@pytest.fixture(scope="module")
def hd_video(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """5 s at 1 fps, 1280x720, panning: larger than every family's processed frame."""
    return Path(write_video_file(str(tmp_path_factory.mktemp("resize") / "hd.mp4"), 5, 1280, 720, fps=1.0))


@pytest.fixture
def family(request, monkeypatch: pytest.MonkeyPatch):
    adapter = get_adapter(request.param)
    if request.param in SMALL_SIZES:
        monkeypatch.setattr(adapter.processor.video_processor, "size", dict(SMALL_SIZES[request.param]))
    return adapter


def _record_pixels(adapter, monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """Every pixel tensor the video processor returns from now on (what the vision tower is given)."""
    seen: list[torch.Tensor] = []
    vp_type = type(adapter.processor.video_processor)
    original = vp_type.__call__

    def recording(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        seen.append(out.get("pixel_values_videos", out.get("pixel_values")))
        return out

    monkeypatch.setattr(vp_type, "__call__", recording)
    return seen


def _run(adapter, media, resize: bool, monkeypatch: pytest.MonkeyPatch):
    """Prepare and encode every visual unit with frames resized at decode or not."""
    with monkeypatch.context() as patch:
        patch.setattr(adapter, "resize_video_at_decode", resize)
        pixels = _record_pixels(adapter, patch)
        prepared = adapter.prepare(media, "What happens?")
        embeddings = adapter.encode_units(prepared, prepared.layout.units)
    return prepared, embeddings, pixels


@pytest.mark.parametrize("family", FAMILIES, indirect=True)
def test_resized_frames_give_the_same_tokens_and_pixels(
    family, hd_video: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    adapter = family
    plain, plain_emb, plain_px = _run(adapter, load_media(hd_video, NO_CAP, ALL), False, monkeypatch)
    media = load_media(hd_video, NO_CAP, ALL)
    resized, resized_emb, resized_px = _run(adapter, media, True, monkeypatch)
    # the vision side read small frames: the processor's size, not the decoded 1280x720
    frames = resized.vision_inputs["video"].frames
    target = adapter.video_frame_size(720, 1280, media.num_frames)
    assert isinstance(frames, LazyFrames) and frames.is_resized and frames.frame_shape[:2] == target
    assert target[0] * target[1] < 720 * 1280 and plain.vision_inputs["video"].frames.frame_shape[:2] == (720, 1280)
    # same layout: ids, positions, token grid, units, and boxes in decoded pixels
    assert torch.equal(resized.input_ids, plain.input_ids) and torch.equal(resized.position_ids, plain.position_ids)
    assert [f.grid for f in resized.layout.frames] == [f.grid for f in plain.layout.frames]
    assert resized.layout.units == plain.layout.units and resized.layout.media_size == (1280, 720)
    assert np.array_equal(resized.layout.box, plain.layout.box)
    for key in ("video_grid_thw", "second_per_grid_ts"):
        if key in plain.vision_inputs:
            assert torch.equal(resized.vision_inputs[key], plain.vision_inputs[key])
    # bit-identical pixel values (tolerance 0) and embeddings
    assert len(resized_px) == len(plain_px) > 0
    for a, b in zip(resized_px, plain_px, strict=True):
        assert a.shape == b.shape and torch.equal(a, b)
    assert torch.equal(resized_emb, plain_emb)


@pytest.mark.parametrize("family", FAMILIES, indirect=True)
def test_decoded_frames_held_are_the_small_ones(family, hd_video: Path) -> None:
    adapter = family
    media = load_media(hd_video, NO_CAP, ALL)
    prepared = adapter.prepare(media, "What happens?")
    adapter.encode_units(prepared, prepared.layout.units)
    frames = prepared.vision_inputs["video"].frames
    small = int(np.prod(frames.frame_shape))
    assert frames.decoded == media.num_frames  # every frame decoded once, through the resized view
    assert 0 < frames.cached_bytes <= frames.cache_size * small
    assert all(f.shape == frames.frame_shape for f in frames._cache.values())
    # nothing full-size is held: the first frame decoded at load was released, and none decoded since
    assert media.frames.cached_bytes == 0 and media.resident_frame_bytes == 0
    assert frames.live_frames <= frames.cache_size
    # the memory guard counts the frames at the size they are held (plus one full-size frame being resized)
    estimate = estimate_prefill(adapter, prepared, METHODS["blockwise-keydiff"], 64, None, None)
    assert media.frame_bytes < estimate.media_bytes < (frames.cache_size + 1) * media.frame_bytes
    # it pickles with the processor's resize, not the model (a call in another process gets it so), and the
    # copy decodes the same small frames
    payload = pickle.dumps(prepared.vision_inputs["video"])
    copy = pickle.loads(payload)
    assert len(payload) < media.num_frames * small / 100 and copy.frames.frame_shape == frames.frame_shape
    assert all(np.array_equal(copy.frames[k], frames[k]) for k in range(media.num_frames))


def test_qwen_released_settings_on_short_clips(hd_video: Path) -> None:
    """Qwen2.5-VL's released video processor (12.8 MP per frame) makes a 1080p frame 1092x1932 and a 720p
    one 728x1288: larger than decoded, so frames are not resized (nothing would be saved). Qwen3-VL's 25 MP
    total keeps a 5-frame 720p clip at 704x1280 (not worth resizing at decode) and shrinks an hour's frames."""
    qwen25, qwen3 = get_adapter("tiny-qwen2.5-vl"), get_adapter("tiny-qwen3-vl")
    assert qwen25.video_frame_size(1080, 1920, 3600) == (1092, 1932)
    media = load_media(hd_video, NO_CAP, ALL)
    assert qwen25.video_for_encoding(media) is media
    assert qwen3.video_frame_size(720, 1280, 5) == (704, 1280) and qwen3.video_for_encoding(media) is media
    height, width = qwen3.video_frame_size(1080, 1920, 3600)
    assert height * width < 1920 * 1080 / 100


def test_resized_view_decodes_once_and_shares_stand_ins(tmp_path: Path) -> None:
    frames = noise_frames(8, 96, 64, seed=3)
    path = corrupt_mjpeg(write_video(tmp_path / "broken.avi", frames, fps=4.0, fourcc="MJPG"), [5])
    media = load_media(path, NO_CAP, FrameSampling(fps=4.0, max_frames=None), backend="opencv")
    calls: list[tuple[int, ...]] = []

    def halve(frame: np.ndarray) -> np.ndarray:
        calls.append(frame.shape)
        return np.ascontiguousarray(frame[::2, ::2])

    small = media.resized_at_decode((32, 48), halve)
    assert small is not media and small.frames.decoded == 0 and media.frames.cached_bytes == 0
    assert small.size == (48, 32) and small.times == media.times and small.warnings is media.warnings
    for k in range(media.num_frames):
        assert np.array_equal(small.frames[k], media.frames[k][::2, ::2])
    assert all(shape == (64, 96, 3) for shape in calls)  # resize sees full-size decoded frames
    assert len(calls) == media.num_frames - 1  # the undecodable frame 5 shows frame 4 (cached), not re-resized
    assert sum("could not be decoded" in w for w in media.warnings) == 1  # reported once for both views
    # an eager video, an image and a size that would not shrink give the Media itself
    assert media.resized_at_decode((64, 96), halve) is media
    eager = load_media(path, NO_CAP, FrameSampling(fps=4.0, max_frames=None), lazy=False)
    assert eager.resized_at_decode((32, 48), halve) is eager


@pytest.mark.parametrize("alias", ["tiny-qwen2.5-vl", "tiny-smolvlm2"])
def test_per_token_tables_are_int32(alias: str, small_video) -> None:
    """The prepared input's ids and positions and the layout's per-token arrays are int32, masks bool: ~51 B per
    visual token on Qwen2.5-VL (3 position axes) and ~45 B on SmolVLM, against ~100 B / ~87 B in int64."""
    adapter = get_adapter(alias)
    prepared = adapter.prepare(small_video, "What happens?")
    layout = prepared.layout
    tensors = [prepared.input_ids, prepared.position_ids, prepared.visual_mask, prepared.keep]
    arrays = [layout.seq_index, layout.frame, layout.row, layout.col, layout.box]
    assert [t.dtype for t in tensors] == [torch.int32, torch.int32, torch.bool, torch.bool]
    assert all(a.dtype == np.int32 for a in arrays)
    per_token = (sum(t.numel() * t.element_size() for t in tensors) + sum(a.nbytes for a in arrays)) / layout.n_visual
    axes = prepared.position_ids.shape[0]
    text_share = prepared.seq_len / layout.n_visual  # text tokens carry ids, positions and masks too
    assert per_token == pytest.approx((4 + 4 * axes + 2) * text_share + 32)
    assert per_token < 0.55 * ((8 + 8 * axes + 2) * text_share + 64)  # the same tables in int64


def test_composed_prefill_holds_no_full_size_frame_after_saliency(hd_video: Path) -> None:
    """Sali-Cache's saliency reads the decoded (full-size) frames; it releases the ones it cached, so a
    composed prefill whose vision side reads resized frames holds no full-size frame while blocks run."""
    from visualkv.runtime.session import ChatSession, SessionConfig

    adapter = get_adapter("tiny-llava-onevision")
    media = load_media(hd_video, NO_CAP, ALL)
    config = SessionConfig(method="blockwise-keydiff+salicache", budget=256, max_new_tokens=1)
    ChatSession(adapter, config).ask("What happens?", media)
    assert media.frames.decoded >= media.num_frames  # the saliency pass read every decoded frame
    assert media.frames.cached_bytes == 0
