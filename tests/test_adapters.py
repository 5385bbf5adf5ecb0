"""Model adapters: tokens, layout and streamed pixels agree with transformers' processors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import get_adapter
from visualkv.bench.synthetic import image_media


def test_qwen_lazy_pixels_equal_the_processor():
    adapter = get_adapter("tiny-qwen2.5-vl")
    media = image_media(1000, 700, seed=3)
    prepared = adapter.prepare(media, "Describe it.")
    text = adapter.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    enc = adapter.processor(text=[text], images=[Image.fromarray(media.frames[0])], return_tensors="pt")
    assert torch.equal(prepared.input_ids, enc["input_ids"][0])
    assert torch.equal(prepared.vision_inputs["image_grid_thw"], enc["image_grid_thw"])
    rows, cols = prepared.layout.frames[0].grid
    per_row = cols * 4
    for r0, r1 in [(0, 1), (3, 7), (rows - 2, rows)]:
        strip = adapter._pixels_rows(prepared.vision_inputs, r0, r1)
        assert torch.allclose(strip, enc["pixel_values"][r0 * per_row : r1 * per_row], atol=1e-6)


def test_qwen_4k_layout():
    adapter = get_adapter("tiny-qwen2.5-vl")
    prepared = adapter.prepare(image_media(3840, 2160), "Where is the star?")
    layout = prepared.layout
    assert 10_000 < layout.n_visual < 11_000
    rows, cols = layout.frames[0].grid
    assert len(layout.units) == rows and all(u.n_tokens == cols for u in layout.units)
    assert layout.box[:, 2].max() == 3840 and layout.box[:, 3].max() == 2160
    assert (layout.box[:, 0] < layout.box[:, 2]).all() and (layout.box[:, 1] < layout.box[:, 3]).all()
    # M-RoPE: image tokens share the temporal id and take row/col ids; text after continues past them
    pos = prepared.position_ids
    first = int(layout.seq_index[0])
    assert pos[1, layout.seq_index[cols]] == pos[1, first] + 1  # next row
    assert prepared.next_position == int(pos.max()) + 1


def test_smolvlm_tiles_and_boxes():
    adapter = get_adapter("tiny-smolvlm2")
    prepared = adapter.prepare(image_media(1600, 900), "Describe it.")
    layout = prepared.layout
    kinds = [f.kind for f in layout.frames]
    assert kinds[-1] == "global" and set(kinds[:-1]) == {"tile"}
    assert all(u.n_tokens == 64 for u in layout.units)
    tiles = [f for f in layout.frames if f.kind == "tile"]
    # tiles cover the image without overlap
    area = sum((f.box[2] - f.box[0]) * (f.box[3] - f.box[1]) for f in tiles)
    assert abs(area - 1600 * 900) <= 0.01 * 1600 * 900
    assert layout.frames[-1].box == (0, 0, 1600, 900)


def test_video_units_are_frames_with_times(small_video):
    for alias in ("tiny-qwen2.5-vl", "tiny-smolvlm2"):
        prepared = get_adapter(alias).prepare(small_video, "What happens?")
        layout = prepared.layout
        assert all(u.kind == "frame" for u in layout.units)
        times = [f.time for f in layout.frames]
        assert times == sorted(times) and times[0] == 0.0
        if alias == "tiny-qwen2.5-vl":  # one unit per temporal patch of 2 frames
            assert len(layout.units) == int(np.ceil(len(small_video.frames) / 2))
        else:
            assert len(layout.units) == len(small_video.frames)


def test_local_checkpoint_folder_loads_like_a_real_model(tmp_path, small_image):
    """The path real checkpoints take: save_pretrained folder -> AutoProcessor / AutoModelForImageTextToText."""
    from visualkv.models.registry import load_model
    from visualkv.models.synthetic.tiny import save_tiny
    from visualkv.runtime.session import ChatSession, SessionConfig

    for alias in ("tiny-qwen2.5-vl", "tiny-smolvlm2"):
        folder = save_tiny(alias, str(tmp_path / alias))
        adapter = load_model(folder)
        assert adapter.family == get_adapter(alias).family
        local = ChatSession(adapter, SessionConfig(max_new_tokens=3))
        local.ask("What is it?", small_image)
        built = ChatSession(get_adapter(alias), SessionConfig(max_new_tokens=3))
        built.ask("What is it?", small_image)
        assert torch.allclose(local.prefill_result.logits, built.prefill_result.logits, atol=1e-5)


def test_qwen_lazy_video_pixels_equal_the_processor():
    from visualkv.bench.synthetic import video_media
    from visualkv.models.base import video_metadata

    adapter = get_adapter("tiny-qwen2.5-vl")
    media = video_media(7, 320, 180, fps=2.0, seed=4)  # odd count: the last patch is padded
    prepared = adapter.prepare(media, "What happens?")
    text = adapter.chat_text(media, "What happens?")
    enc = adapter.processor(
        text=[text],
        videos=[np.stack(media.frames)],
        video_metadata=[video_metadata(media)],
        do_sample_frames=False,
        return_tensors="pt",
    )
    assert torch.equal(prepared.input_ids, enc["input_ids"][0])
    assert torch.equal(prepared.vision_inputs["video_grid_thw"], enc["video_grid_thw"])
    t, gh, gw = (int(x) for x in enc["video_grid_thw"][0])
    per = gh * gw
    for t0, t1 in [(0, 1), (1, 3), (t - 1, t)]:
        pixels = adapter._pixels_frames(prepared.vision_inputs, t0, t1)
        assert torch.allclose(pixels, enc["pixel_values_videos"][t0 * per : t1 * per], atol=1e-6)


@pytest.mark.parametrize("alias", ["tiny-qwen2.5-vl", "tiny-qwen3-vl"])
def test_qwen_video_pixels_in_chunks_equal_one_call(alias, monkeypatch):
    """A bulk block's frames go through the video processor a few temporal patches at a time (its float32
    copies of every frame at once were the largest transient of a `full` video prefill): the same values."""
    from visualkv.bench.synthetic import video_media
    from visualkv.models import qwen2_5_vl

    adapter = get_adapter(alias)
    prepared = adapter.prepare(video_media(13, 320, 180, fps=2.0, seed=4), "What happens?")
    t = int(prepared.vision_inputs["video_grid_thw"][0, 0])
    whole = adapter._pixels_frames(prepared.vision_inputs, 0, t)
    calls = []
    pixels_frames = adapter._pixels_frames

    def counted(vision, t0, t1, **kwargs):
        calls.append(t1 - t0)
        return pixels_frames(vision, t0, t1, **kwargs)

    monkeypatch.setattr(qwen2_5_vl, "VIDEO_CHUNK", 2)
    monkeypatch.setattr(adapter, "_pixels_frames", counted)
    chunked = adapter._video_pixels(prepared.vision_inputs, 0, t)
    assert calls == [2, 2, 2, 1] and torch.equal(chunked, whole)
    calls.clear()
    per = whole.shape[0] // t  # pixel patches of one temporal patch
    assert torch.equal(adapter._video_pixels(prepared.vision_inputs, 1, 6), whole[per : 6 * per])
    assert calls == [2, 2, 1]


@pytest.mark.parametrize("alias, dim", [("tiny-internvl3.5", 0), ("tiny-llava-onevision", 1)])
def test_video_frames_in_chunks_equal_one_processor_call(alias, dim):
    """InternVL's and LLaVA-OneVision's video processors see a block's frames a few at a time (`in_chunks`):
    each frame is processed on its own, so the pixels are those of one call on every frame."""
    from visualkv.bench.synthetic import video_media
    from visualkv.models.base import in_chunks

    adapter = get_adapter(alias)
    media = adapter.prepare(video_media(7, 320, 180, fps=2.0, seed=4), "What happens?").vision_inputs["video"]
    frames = [0, 1, 2, 4, 5, 6]
    whole = adapter._frame_pixels(media, frames)
    chunked = in_chunks(len(frames), 4, lambda i0, i1: adapter._frame_pixels(media, frames[i0:i1]), dim)
    assert chunked.shape == whole.shape and torch.equal(chunked, whole)


def test_smolvlm_lazy_video_equals_the_processor():
    from visualkv.bench.synthetic import video_media
    from visualkv.models.base import video_metadata

    adapter = get_adapter("tiny-smolvlm2")
    media = video_media(5, 320, 180, fps=1.0, seed=5)
    prepared = adapter.prepare(media, "What happens?")
    enc = adapter.processor(
        text=[adapter.chat_text(media, "What happens?")],
        videos=[np.stack(media.frames)],
        video_metadata=[video_metadata(media)],
        do_sample_frames=False,
        return_tensors="pt",
    )
    assert torch.equal(prepared.input_ids, enc["input_ids"][0])
    pixels, mask = adapter._frame_pixels(media, [1, 3])
    assert torch.allclose(pixels, enc["pixel_values"][:, [1, 3]], atol=1e-6)
    if mask is not None:
        assert torch.equal(mask, enc["pixel_attention_mask"][:, [1, 3]])


def test_smolvlm_video_frames_in_chunks_equal_one_processor_call(monkeypatch):
    """SmolVLM2's video processor sees a block's frames a few at a time too: pixels and mask as one call's."""
    from visualkv.bench.synthetic import video_media
    from visualkv.models import smolvlm

    adapter = get_adapter("tiny-smolvlm2")
    media = adapter.prepare(video_media(7, 320, 180, fps=2.0, seed=4), "What happens?").vision_inputs["video"]
    frames = [0, 1, 2, 4, 5, 6]
    whole_pixels, whole_mask = adapter._frame_pixels(media, frames)
    calls = []
    frame_pixels = adapter._frame_pixels

    def counted(media, chosen):
        calls.append(len(chosen))
        return frame_pixels(media, chosen)

    monkeypatch.setattr(smolvlm, "VIDEO_FRAMES_PER_CALL", 4)
    monkeypatch.setattr(adapter, "_frame_pixels", counted)
    pixels, mask = adapter._video_pixels(media, frames)
    assert calls == [4, 2]
    assert pixels.shape == whole_pixels.shape and torch.equal(pixels, whole_pixels)
    assert (mask is None) == (whole_mask is None)
    if mask is not None:
        assert torch.equal(mask, whole_mask)


def test_qwen2_vl_goes_through_the_same_adapter(small_image, small_video):
    """Qwen2-VL (no vision windows) loads as a qwen2_vl family and matches transformers' forward."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor

    from visualkv.models.base import video_metadata
    from visualkv.models.registry import _adapter
    from visualkv.runtime.session import ChatSession, SessionConfig

    base = get_adapter("tiny-qwen2.5-vl")
    c, p = base.model.config, base.processor
    cfg = Qwen2VLConfig(
        text_config=c.text_config.to_dict(),
        vision_config={
            "depth": 2,
            "embed_dim": 32,
            "hidden_size": c.text_config.hidden_size,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        image_token_id=c.image_token_id,
        video_token_id=c.video_token_id,
        vision_start_token_id=c.vision_start_token_id,
        vision_end_token_id=c.vision_end_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(cfg).eval()
    proc = Qwen2VLProcessor(
        image_processor=p.image_processor,
        tokenizer=p.tokenizer,
        video_processor=p.video_processor,
        chat_template=p.chat_template,
    )
    adapter = _adapter(model, proc, "tiny-qwen2-vl")
    assert adapter.family == "qwen2_5_vl" and adapter.describe()["model_type"] == "qwen2_vl"
    for media in (small_image, small_video):
        session = ChatSession(adapter, SessionConfig(max_new_tokens=2))
        session.ask("What?", media)
        text = adapter.chat_text(media, "What?")
        if media.kind == "image":
            enc = proc(text=[text], images=[Image.fromarray(media.frames[0])], return_tensors="pt")
        else:
            enc = proc(
                text=[text],
                videos=[np.stack(media.frames)],
                video_metadata=[video_metadata(media)],
                do_sample_frames=False,
                return_tensors="pt",
            )
        with torch.no_grad():
            reference = model(**enc).logits[0, -1]
        assert torch.allclose(session.prefill_result.logits, reference, atol=1e-4)
        compressed = ChatSession(
            adapter, SessionConfig(method="blockwise-snapkv", budget=32, block_size=48, max_new_tokens=2)
        )
        compressed.ask("What?", media)
        assert compressed.report()["final_kv_bytes"] < compressed.report()["full_kv_bytes"]
