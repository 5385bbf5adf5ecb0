"""The newer model families (Qwen3-VL, LLaVA-OneVision, InternVL3.5): adapters against transformers, and DESIGN.md's invariants.

The shared invariant checks of tests/test_invariants.py are re-collected here with this module's
`adapter` fixture (the new families only), so the matrix there stays as fast as it was; the exactness
checks against transformers' own forward / generate are written per family because their streaming
differs (DeepStack, timestamps between frames).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from tests import test_invariants as shared
from tests.conftest import get_adapter
from visualkv.bench.synthetic import image_media
from visualkv.models.base import LayerFeatures, video_metadata
from visualkv.runtime.session import ChatSession, SessionConfig

NEW_FAMILIES = ["tiny-qwen3-vl", "tiny-llava-onevision", "tiny-internvl3.5"]
PROMPT = shared.PROMPT
ATOL = 1e-4


@pytest.fixture(params=NEW_FAMILIES)
def adapter(request):
    return get_adapter(request.param)


@pytest.fixture
def small_image(request):
    """conftest's 448 x 336 image, except for InternVL: 4:3 there means 12 tiles + a thumbnail (3,328
    tokens); 896 x 448 is two tiles + the thumbnail, the same code paths in a quarter of the time."""
    callspec = getattr(request.node, "callspec", None)
    alias = callspec.params.get("adapter", callspec.params.get("alias")) if callspec else None
    return image_media(896, 448, seed=1) if alias == "tiny-internvl3.5" else image_media(448, 336, seed=1)


# The shared invariants (2 bound, 3 protected, 4 positions, 6 telemetry), on the new families.
test_full_bulk_matches_transformers = shared.test_full_bulk_matches_transformers
test_visual_entries_never_exceed_budget_plus_block_or_unit = (
    shared.test_visual_entries_never_exceed_budget_plus_block_or_unit
)
test_telemetry_agrees_with_an_independent_count = shared.test_telemetry_agrees_with_an_independent_count
test_full_report_matches_full_kv_bytes = shared.test_full_report_matches_full_kv_bytes
test_protected_tokens_survive = shared.test_protected_tokens_survive
test_kept_entries_keep_original_positions = shared.test_kept_entries_keep_original_positions


def _session(adapter, method="full", **kwargs) -> ChatSession:
    max_new = kwargs.pop("max_new_tokens", 6)
    options = kwargs.pop("method_options", {})
    return ChatSession(adapter, SessionConfig(method=method, max_new_tokens=max_new, method_options=options, **kwargs))


_REFERENCE: dict = {}


def _reference(alias: str, media) -> tuple[torch.Tensor, list[int]]:
    """transformers' own forward logits and greedy tokens (cached per alias and media kind)."""
    key = (alias, media.kind)
    if key not in _REFERENCE:
        adapter = get_adapter(alias)
        logits, tokens = shared._hf_reference(adapter, media)
        _REFERENCE[key] = (logits, shared._strip_eos(adapter, tokens))
    return _REFERENCE[key]


# -- invariant 1: exactness against transformers, blocks forced ------------------------------


@pytest.mark.parametrize("method", shared.ALL)
def test_qwen3_video_blocks_are_exact(method, small_video):
    """One temporal patch per block (timestamps travel with their frame), DeepStack per block: exact."""
    adapter = get_adapter("tiny-qwen3-vl")
    ref_logits, ref_tokens = _reference("tiny-qwen3-vl", small_video)
    s = _session(adapter, method, budget=100_000, prefill="blockwise", block_size=32)
    record = s.ask(PROMPT, small_video)
    assert len(s.blocks) == 2 + len(s.prepared.layout.units)  # prefix, one block per temporal patch, suffix
    assert torch.allclose(s.prefill_result.logits, ref_logits, atol=ATOL, rtol=ATOL)
    assert record.token_ids == ref_tokens


@pytest.mark.parametrize("method", shared.ALL)
def test_qwen3_whole_image_block_is_exact(method, small_image):
    adapter = get_adapter("tiny-qwen3-vl")
    ref_logits, ref_tokens = _reference("tiny-qwen3-vl", small_image)
    s = _session(adapter, method, budget=100_000, prefill="blockwise", block_size=100_000)
    record = s.ask(PROMPT, small_image)
    assert [b.kind for b in s.prefill_result.context.blocks] == ["text", "rows", "text"]
    assert torch.allclose(s.prefill_result.logits, ref_logits, atol=ATOL, rtol=ATOL)
    assert record.token_ids == ref_tokens


def test_qwen3_image_strips_deviation_is_measured(small_image):
    """Every Qwen3-VL vision block attends over the whole image: strips of rows are inexact, but close.

    Strips get their true rotary ids and resampled position embeddings, so attention is the only
    difference. Printed; docs/RESULTS.md reports it.
    """
    adapter = get_adapter("tiny-qwen3-vl")
    ref_logits, _ = _reference("tiny-qwen3-vl", small_image)
    s = _session(adapter, "full", budget=100_000, prefill="blockwise", block_size=32)
    s.ask(PROMPT, small_image)
    assert len(s.blocks) > 3
    deviation = (s.prefill_result.logits - ref_logits).abs().max().item()
    print(f"qwen3-vl image streamed-encoding max |dlogit| = {deviation:.3g}")
    assert 0 < deviation < 0.1


def test_qwen3_deepstack_injection_is_what_makes_blocks_exact(small_video, monkeypatch):
    """Guard for the exactness tests above: without DeepStack the same run is far from transformers."""
    adapter = get_adapter("tiny-qwen3-vl")
    ref_logits, _ = _reference("tiny-qwen3-vl", small_video)
    monkeypatch.setattr(LayerFeatures, "add_after_layer", lambda self, layer_idx, hidden, token_index: hidden)
    s = _session(adapter, "full", budget=100_000, prefill="blockwise", block_size=32)
    s.ask(PROMPT, small_video)
    assert (s.prefill_result.logits - ref_logits).abs().max().item() > 100 * ATOL


def test_layer_features_skip_tokens_merged_away():
    """DeepStack rows of tokens no longer in the block (merged by a method) are dropped, the rest land."""
    hidden = torch.zeros(1, 4, 2)
    feats = LayerFeatures(torch.tensor([10, 11, 12]), [torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])])
    out = feats.add_after_layer(0, hidden, torch.tensor([5, 10, 12, 20]))  # token 11 merged away
    assert out[0, :, 0].tolist() == [0.0, 1.0, 3.0, 0.0]
    assert feats.add_after_layer(1, hidden, torch.tensor([5, 10, 12, 20])) is hidden  # no layer-1 features
    assert hidden.abs().sum() == 0  # out of place


@pytest.mark.parametrize("method", shared.ALL)
def test_llava_onevision_blocks_are_exact(method, small_image, small_video):
    """Base tile, packed-map rows (newline with its row), video frames: block by block, exact."""
    adapter = get_adapter("tiny-llava-onevision")
    for media in (small_image, small_video):
        ref_logits, ref_tokens = _reference("tiny-llava-onevision", media)
        s = _session(adapter, method, budget=100_000, prefill="blockwise", block_size=300)
        record = s.ask(PROMPT, media)
        assert len(s.blocks) > 4
        assert torch.allclose(s.prefill_result.logits, ref_logits, atol=ATOL, rtol=ATOL)
        assert record.token_ids == ref_tokens


def test_llava_onevision_downsampled_map_streams_exactly():
    """12 tiles' worth of features: the anyres_max_9 bilinear downsampling, applied per block of rows."""
    adapter = get_adapter("tiny-llava-onevision")
    media = image_media(1536, 1152, seed=4)
    s = _session(adapter, "full", budget=100_000, prefill="blockwise", block_size=784, max_new_tokens=2)
    s.ask(PROMPT, media)
    geometry = s.prepared.vision_inputs["geometry"]
    assert geometry.downsampled and (geometry.tile_rows, geometry.tile_cols) == (3, 4)
    logits, _ = shared._hf_reference(adapter, media, new_tokens=1)
    assert torch.allclose(s.prefill_result.logits, logits, atol=ATOL, rtol=ATOL)


def test_llava_onevision_layout_marks_newlines(small_image, small_video):
    adapter = get_adapter("tiny-llava-onevision")
    layout = adapter.prepare(small_image, PROMPT).layout
    g = adapter.prepare(small_image, PROMPT).vision_inputs["geometry"]
    assert [f.kind for f in layout.frames] == ["global", "image"]
    assert layout.units[0].kind == "tile" and layout.units[0].n_tokens == 27 * 27
    rows = layout.units[1:]
    assert len(rows) == g.rows and all(u.n_tokens == g.cols + 1 for u in rows)
    newline = layout.extra["newline"]
    assert int(newline.sum()) == g.rows
    ids = adapter.prepare(small_image, PROMPT).input_ids
    assert (ids[layout.seq_index] == adapter.model.config.image_token_id).all()
    # every map token's box lies inside the image; the base tile covers it whole
    assert layout.box[:, 2].max() == small_image.size[0] and layout.box[:, 3].max() == small_image.size[1]
    video = adapter.prepare(small_video, PROMPT)
    vl = video.layout
    assert len(vl.units) == len(small_video.frames) and int(vl.extra["newline"].sum()) == 1
    assert vl.units[-1].n_tokens == 14 * 14 + 1 and all(u.n_tokens == 14 * 14 for u in vl.units[:-1])
    enc = adapter.processor(
        text=[adapter.chat_text(small_video, PROMPT)],
        videos=[torch.from_numpy(np.stack(small_video.frames))],
        return_tensors="pt",
    )
    assert torch.equal(video.input_ids, enc["input_ids"][0])


def test_llava_onevision_4k_layout():
    adapter = get_adapter("tiny-llava-onevision")
    prepared = adapter.prepare(image_media(3840, 2160), "Where is the star?")
    g = prepared.vision_inputs["geometry"]
    # best grid 1536 x 2304 px = 4 x 6 tiles; 92 x 162 unpadded features, downsampled to 61 x 107
    assert (g.tile_rows, g.tile_cols, g.crop_h, g.crop_w, g.rows, g.cols) == (4, 6, 92, 162, 61, 107)
    assert prepared.layout.n_visual == 729 + 61 * 108 == 7317


@pytest.mark.parametrize("method", shared.ALL)
def test_internvl_tile_blocks_are_exact(method, small_video):
    """One 448-px tile (256 tokens) or frame per block: exact, thumbnail included."""
    adapter = get_adapter("tiny-internvl3.5")
    for media in (image_media(896, 448, seed=1), small_video):
        ref_logits, ref_tokens = _reference("tiny-internvl3.5", media)
        s = _session(adapter, method, budget=100_000, prefill="blockwise", block_size=256)
        record = s.ask(PROMPT, media)
        assert len(s.blocks) == 2 + len(s.prepared.layout.units)
        assert torch.allclose(s.prefill_result.logits, ref_logits, atol=ATOL, rtol=ATOL)
        assert record.token_ids == ref_tokens


def test_internvl_tiles_thumbnail_and_4k():
    adapter = get_adapter("tiny-internvl3.5")
    layout = adapter.prepare(image_media(896, 448), PROMPT).layout
    assert [f.kind for f in layout.frames] == ["tile", "tile", "global"]
    assert [f.box for f in layout.frames] == [(0, 0, 448, 448), (448, 0, 896, 448), (0, 0, 896, 448)]
    assert all(u.n_tokens == 256 for u in layout.units)
    # 3840 x 2160: the 4 x 2 grid (aspect 2, the closest within 12 tiles) + thumbnail = 9 tiles
    big = adapter.prepare(image_media(3840, 2160), PROMPT).layout
    assert [f.kind for f in big.frames].count("tile") == 8 and big.n_visual == 9 * 256 == 2304
    tiles = [f for f in big.frames if f.kind == "tile"]
    assert sum((f.box[2] - f.box[0]) * (f.box[3] - f.box[1]) for f in tiles) == 3840 * 2160


# -- every method runs; Sali-Cache skips frames before the vision tower ------------------------


@pytest.mark.parametrize("alias", NEW_FAMILIES)
def test_every_method_runs_on_image_and_video(alias, small_image, small_video):
    adapter = get_adapter(alias)
    for method in ("blockwise-keydiff", "blockwise-snapkv", "post-snapkv", "blockwise-random", "salicache", "lightkv"):
        for media in (small_image, small_video):
            budget = 24 if method not in ("salicache", "lightkv") else None
            s = _session(adapter, method, budget=budget, max_new_tokens=2)
            record = s.ask(PROMPT, media)
            report = s.report()
            assert len(record.token_ids) >= 1
            assert report["final_kv_bytes"] <= report["full_kv_bytes"]
            held = sum(layer.keys.nbytes + layer.values.nbytes for layer in s.cache.layers)
            assert report["final_kv_bytes"] >= held  # packed tiers come on top of the FP16 tensors


@pytest.mark.parametrize("alias", NEW_FAMILIES)
def test_salicache_skipped_frames_never_reach_the_vision_tower(alias):
    """A static clip: Sali-Cache skips repeated frames; only the kept units are encoded."""
    from visualkv.bench.synthetic import synthetic_image

    frame = synthetic_image(224, 168, seed=5)
    frames = [frame.copy() for _ in range(8)]
    from visualkv.media import Media

    clip = Media(
        kind="video", frames=frames, times=[float(i) for i in range(8)], source_fps=1.0, duration=8.0, path=None
    )
    adapter = get_adapter(alias)
    s = _session(adapter, "salicache", max_new_tokens=1)
    s.ask(PROMPT, clip)
    encoded = s.prefill_result.context.encoded_frames
    units = s.prepared.layout.units
    assert 0 < len(encoded) < len(units)
    kept_units = {u.frame for u in units if bool(s.prepared.keep[u.seq_start : u.seq_end].any())}
    assert set(encoded) == kept_units


# -- adapters agree with the processors --------------------------------------------------------


def test_qwen3_lazy_tokens_and_pixels_equal_the_processor(small_video):
    adapter = get_adapter("tiny-qwen3-vl")
    proc = adapter.processor
    media = image_media(1000, 700, seed=3)
    prepared = adapter.prepare(media, "Describe it.")
    text = adapter.chat_text(media, "Describe it.")
    enc = proc(text=[text], images=[Image.fromarray(media.frames[0])], return_tensors="pt")
    assert torch.equal(prepared.input_ids, enc["input_ids"][0])
    assert torch.equal(prepared.vision_inputs["image_grid_thw"], enc["image_grid_thw"])
    rows, cols = prepared.layout.frames[0].grid
    per_row = cols * 4
    for r0, r1 in [(0, 1), (3, 7), (rows - 2, rows)]:
        strip = adapter._pixels_rows(prepared.vision_inputs, r0, r1)
        assert torch.allclose(strip, enc["pixel_values"][r0 * per_row : r1 * per_row], atol=1e-6)
    # video: timestamps between frames, and per-block pixels resized to the whole clip's size
    prepared = adapter.prepare(small_video, "What happens?")
    enc = proc(
        text=[adapter.chat_text(small_video, "What happens?")],
        videos=[torch.from_numpy(np.stack(small_video.frames))],
        video_metadata=[video_metadata(small_video)],
        do_sample_frames=False,
        cap_pixels_per_frame=False,
        return_tensors="pt",
    )
    assert torch.equal(prepared.input_ids, enc["input_ids"][0])
    assert "<0.5 seconds>" in adapter.tokenizer.decode(prepared.input_ids)
    assert torch.equal(prepared.vision_inputs["video_grid_thw"], enc["video_grid_thw"])
    _, gh, gw = enc["video_grid_thw"][0].tolist()
    per_patch = gh * gw
    for t0, t1 in [(0, 1), (1, 3), (3, 4)]:
        pixels = adapter._pixels_frames(prepared.vision_inputs, t0, t1)
        assert torch.allclose(pixels, enc["pixel_values_videos"][t0 * per_patch : t1 * per_patch], atol=1e-6)
    # M-RoPE positions equal transformers' own
    positions, _ = adapter.model.model.get_rope_index(
        enc["input_ids"], mm_token_type_ids=enc["mm_token_type_ids"], video_grid_thw=enc["video_grid_thw"]
    )
    assert torch.equal(prepared.position_ids, positions[:, 0])


def test_qwen3_video_units_are_temporal_patches_between_timestamps(small_video):
    adapter = get_adapter("tiny-qwen3-vl")
    layout = adapter.prepare(small_video, "What happens?").layout
    assert len(layout.units) == 4 and all(u.kind == "frame" for u in layout.units)
    gaps = [b.seq_start - a.seq_end for a, b in zip(layout.units, layout.units[1:])]
    assert min(gaps) > 2  # "<t seconds>" and the vision end/start tokens lie between two frames
    assert [f.time for f in layout.frames] == sorted(f.time for f in layout.frames)


def test_qwen3_4k_layout():
    adapter = get_adapter("tiny-qwen3-vl")
    layout = adapter.prepare(image_media(3840, 2160), "Where is the star?").layout
    rows, cols = layout.frames[0].grid
    # 3840 x 2160 -> 3840 x 2176 (multiples of 32, within 16.7 MP) -> 68 x 120 tokens
    assert (rows, cols) == (68, 120) and layout.n_visual == 8160
    assert len(layout.units) == rows and all(u.n_tokens == cols for u in layout.units)
    assert layout.box[:, 2].max() == 3840 and layout.box[:, 3].max() == 2160


# -- the tiny aliases load like released checkpoints --------------------------------------------


def test_chat_templates_match_released_format():
    adapter = get_adapter("tiny-qwen3-vl")
    assert adapter.chat_text(image_media(64, 64), "Describe this image.") == (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe this image.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert adapter.processor.tokenizer.chat_template == adapter.processor.chat_template
    llava = get_adapter("tiny-llava-onevision")
    assert llava.chat_text(image_media(64, 64), "Describe this image.") == (
        "<|im_start|>user <image>\nDescribe this image.<|im_end|><|im_start|>assistant\n"
    )
    internvl = get_adapter("tiny-internvl3.5")
    assert internvl.chat_text(image_media(64, 64), "Describe this image.") == (
        "<|im_start|>user\n<IMG_CONTEXT>\nDescribe this image.<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("alias", NEW_FAMILIES)
def test_saved_tiny_folder_loads_like_a_real_checkpoint(alias, tmp_path, small_image):
    """save_pretrained folder -> AutoProcessor / AutoModelForImageTextToText -> the same answers."""
    from visualkv.models.registry import load_model
    from visualkv.models.synthetic.tiny import save_tiny

    folder = save_tiny(alias, str(tmp_path / alias))
    local = load_model(folder)
    built = get_adapter(alias)
    assert type(local) is type(built) and type(local.processor) is type(built.processor)
    a, b = _session(local, max_new_tokens=2), _session(built, max_new_tokens=2)
    a.ask(PROMPT, small_image)
    b.ask(PROMPT, small_image)
    assert torch.allclose(a.prefill_result.logits, b.prefill_result.logits, atol=1e-5)


def test_released_configs_have_the_released_shapes():
    """The shape-alias configs build (on the meta device: no memory) to the released parameter counts."""
    from transformers import AutoModelForImageTextToText

    from visualkv.models.synthetic.shapes import SHAPE_SPECS

    released = {alias: spec.released for alias, spec in SHAPE_SPECS.items() if spec.released is not None}

    expected = {
        "shape-qwen3-vl-8b": (8.6e9, 8.9e9),  # Qwen3-VL-8B: 8.77 B parameters
        "shape-llava-onevision-7b": (7.9e9, 8.1e9),  # llava-onevision-qwen2-7b: 8.03 B
        "shape-internvl3.5-8b": (8.3e9, 8.7e9),  # InternVL3.5-8B: about 8.5 B
    }
    assert set(expected) == set(released)
    for alias, (low, high) in expected.items():
        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(released[alias]())
        n = sum(p.numel() for p in model.parameters())
        assert low < n < high, (alias, n)


def test_each_family_is_one_registry_entry():
    """A family's adapter, transformers class and every offline alias hang off its one `FAMILIES` entry: each
    alias its builds module defines is listed, belongs to it, and its class is the family's model_type."""
    from visualkv.models.registry import ADAPTER_BY_MODEL_TYPE, FAMILIES, OFFLINE_MODELS

    listed = {choice.name for choice in OFFLINE_MODELS}
    for family in FAMILIES:
        assert family.adapter.family == family.name
        assert family.model_class.config_class.model_type == family.name
        specs = {**family.builds.TINY_SPECS, **family.builds.SHAPE_SPECS}
        assert specs and all(spec.family == family.name for spec in specs.values()), family.name
        assert set(specs) <= listed, family.name
    assert set(ADAPTER_BY_MODEL_TYPE) == {
        "qwen2_5_vl",
        "qwen2_vl",
        "qwen3_vl",
        "llava_onevision",
        "internvl",
        "smolvlm",
        "idefics3",
    }
