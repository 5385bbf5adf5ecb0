"""Tests for the offline tiny random-weight VLMs (``visualkv.models.synthetic.tiny``)."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import socket
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from visualkv.models.synthetic.tiny import TINY_SPECS, TinySpec, build_tiny, save_tiny
from visualkv.models.synthetic.tokenizer_build import (
    QWEN_SPECIAL_TOKENS,
    SMOLVLM_ADDED_SPECIAL_TOKENS,
    SMOLVLM_LEADING_SPECIAL_TOKENS,
)

TINY_ALIASES = ["tiny-qwen2.5-vl", "tiny-smolvlm2"]
IMAGE_MESSAGES = [
    {
        "role": "user",
        "content": [{"type": "image"}, {"type": "text", "text": "Describe this image."}],
    }
]
VIDEO_MESSAGES = [
    {
        "role": "user",
        "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}],
    }
]


@pytest.fixture(autouse=True)
def _no_network(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fail loudly if anything tries to open a network connection."""

    def _refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("network access attempted in an offline test")

    monkeypatch.setattr(socket.socket, "connect", _refuse)
    monkeypatch.setattr(socket, "create_connection", _refuse)
    yield


@pytest.fixture(scope="module")
def built() -> dict[str, tuple]:
    """One (model, processor) per tiny alias, built once for the module."""
    return {alias: build_tiny(alias, seed=0) for alias in TINY_ALIASES}


def _image(width: int = 448, height: int = 336, seed: int = 0) -> Image.Image:
    rng = np.random.RandomState(seed)
    return Image.fromarray(rng.randint(0, 256, (height, width, 3), dtype=np.uint8))


def _video(n: int = 8, size: int = 224, seed: int = 1) -> np.ndarray:
    rng = np.random.RandomState(seed)
    return rng.randint(0, 256, (n, size, size, 3), dtype=np.uint8)


def _image_inputs(processor, image: Image.Image):
    prompt = processor.apply_chat_template(IMAGE_MESSAGES, add_generation_prompt=True, tokenize=False)
    return processor(text=[prompt], images=[image], return_tensors="pt")


def _video_inputs(processor, video: np.ndarray, fps: float = 2.0):
    prompt = processor.apply_chat_template(VIDEO_MESSAGES, add_generation_prompt=True, tokenize=False)
    # SmolVLM needs ``frames_indices`` (for frame timestamps) as well as ``fps``.
    metadata = [{"total_num_frames": len(video), "fps": fps, "frames_indices": list(range(len(video)))}]
    return processor(text=[prompt], videos=[video], video_metadata=metadata, return_tensors="pt")


# --------------------------------------------------------------------------- specs / tokenizers


def test_specs_are_consistent() -> None:
    assert set(TINY_SPECS) == {
        "tiny-qwen2.5-vl",
        "tiny-smolvlm2",
        "bench-qwen2.5-vl",
        "bench-smolvlm2",
        "tiny-qwen3-vl",
        "tiny-llava-onevision",
        "tiny-internvl3.5",
    }
    for alias, spec in TINY_SPECS.items():
        assert isinstance(spec, TinySpec)
        assert spec.family in ("qwen2_5_vl", "smolvlm", "qwen3_vl", "llava_onevision", "internvl"), alias
        assert spec.text_num_heads % spec.text_num_kv_heads == 0
        assert spec.text_num_kv_heads < spec.text_num_heads, "GQA expected"
        if spec.family == "qwen2_5_vl":
            assert 2 * sum(spec.mrope_section) == spec.head_dim
            assert spec.fullatt_block_indexes, "keep at least one full-attention vision block"
            assert max(spec.fullatt_block_indexes) < spec.vision_num_layers
        if spec.family == "qwen3_vl":
            assert 2 * sum(spec.mrope_section) == spec.head_dim
            assert spec.deepstack_visual_indexes and max(spec.deepstack_visual_indexes) < spec.vision_num_layers
    with pytest.raises(KeyError):
        build_tiny("no-such-model")


@pytest.mark.parametrize("alias", TINY_ALIASES)
def test_tokenizer_round_trip_and_special_tokens(built, alias: str) -> None:
    model, processor = built[alias]
    tok = processor.tokenizer
    text = "Hello world! 12345 The cat, (sat) on: a mat?\n  two  spaces\ttab ~`{}[]|^ x"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    specials = (
        QWEN_SPECIAL_TOKENS
        if alias.startswith("tiny-qwen")
        else SMOLVLM_LEADING_SPECIAL_TOKENS + SMOLVLM_ADDED_SPECIAL_TOKENS
    )
    for token in specials:
        enc = tok.encode(token, add_special_tokens=False)
        assert len(enc) == 1 and tok.convert_ids_to_tokens(enc[0]) == token, token
    assert model.config.text_config.vocab_size == len(tok)
    if alias.startswith("tiny-qwen"):
        cfg = model.config
        assert cfg.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>") == processor.image_token_id
        assert cfg.video_token_id == tok.convert_tokens_to_ids("<|video_pad|>") == processor.video_token_id
        assert cfg.vision_start_token_id == tok.convert_tokens_to_ids("<|vision_start|>")
        assert cfg.vision_end_token_id == tok.convert_tokens_to_ids("<|vision_end|>")
        assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    else:
        assert model.config.image_token_id == tok.convert_tokens_to_ids("<image>") == processor.image_token_id
        assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
        assert tok.bos_token == "<|im_start|>" and tok.eos_token == "<end_of_utterance>"
        assert model.generation_config.eos_token_id == tok.convert_tokens_to_ids("<end_of_utterance>")


def test_chat_templates_match_released_format(built) -> None:
    _, qwen = built["tiny-qwen2.5-vl"]
    assert qwen.apply_chat_template(IMAGE_MESSAGES, add_generation_prompt=True, tokenize=False) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe this image.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert "<|vision_start|><|video_pad|><|vision_end|>What happens?" in qwen.apply_chat_template(
        VIDEO_MESSAGES, add_generation_prompt=True, tokenize=False
    )
    _, smol = built["tiny-smolvlm2"]
    assert (
        smol.apply_chat_template(IMAGE_MESSAGES, add_generation_prompt=True, tokenize=False)
        == "<|im_start|>User:<image>Describe this image.<end_of_utterance>\nAssistant:"
    )
    assert (
        smol.apply_chat_template(VIDEO_MESSAGES, add_generation_prompt=True, tokenize=False)
        == "<|im_start|>User: <video>What happens?<end_of_utterance>\nAssistant:"
    )
    # The tokenizer carries the same template.
    assert smol.tokenizer.chat_template == smol.chat_template
    assert qwen.tokenizer.chat_template == qwen.chat_template


# --------------------------------------------------------------------------- building


@pytest.mark.parametrize("alias", TINY_ALIASES)
def test_build_is_deterministic_and_fast(built, alias: str) -> None:
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    t0 = time.perf_counter()
    again, _ = build_tiny(alias, seed=0)
    elapsed = time.perf_counter() - t0
    assert torch.equal(torch.rand(3), expected_next), "build_tiny must not disturb the global RNG"
    assert elapsed < 10.0
    ref = built[alias][0].state_dict()
    sd = again.state_dict()
    assert sd.keys() == ref.keys()
    assert all(torch.equal(sd[k], ref[k]) for k in ref)
    other = build_tiny(alias, seed=1)[0].state_dict()
    assert any(not torch.equal(other[k], ref[k]) for k in ref)
    assert not again.training
    assert again.config._attn_implementation == "sdpa"


def test_dtype_argument() -> None:
    model, _ = build_tiny("tiny-smolvlm2", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ref, _ = build_tiny("tiny-smolvlm2")
    name, param = next(iter(ref.named_parameters()))
    assert torch.equal(dict(model.named_parameters())[name], param.to(torch.bfloat16))


def test_model_attribute_paths(built) -> None:
    qwen, _ = built["tiny-qwen2.5-vl"]
    assert qwen.model.language_model.embed_tokens is qwen.get_input_embeddings()
    assert len(qwen.model.language_model.layers) == TINY_SPECS["tiny-qwen2.5-vl"].text_num_layers
    assert qwen.model.visual.fullatt_block_indexes == [1]
    assert qwen.lm_head.out_features == qwen.config.text_config.vocab_size
    attn = qwen.model.language_model.layers[0].self_attn
    assert attn.k_proj.out_features == 2 * 16 and attn.q_proj.out_features == 4 * 16
    smol, _ = built["tiny-smolvlm2"]
    assert smol.model.text_model.embed_tokens is smol.get_input_embeddings()
    assert len(smol.model.text_model.layers) == TINY_SPECS["tiny-smolvlm2"].text_num_layers
    assert smol.model.vision_model.config.image_size == 512
    assert smol.model.image_seq_len == 64 == built["tiny-smolvlm2"][1].image_seq_len
    assert smol.lm_head.out_features == smol.config.text_config.vocab_size


# --------------------------------------------------------------------------- forward / generate


@pytest.mark.parametrize("alias", TINY_ALIASES)
def test_image_forward_and_generate(built, alias: str) -> None:
    model, processor = built[alias]
    inputs = _image_inputs(processor, _image())
    n_visual = int((inputs["input_ids"] == processor.image_token_id).sum())
    if alias.startswith("tiny-qwen"):
        # 448x336 -> 448x336 (multiples of 28) -> 32x24 patches -> 16x12 merged tokens.
        assert inputs["image_grid_thw"].tolist() == [[1, 24, 32]]
        assert n_visual == 192
    else:
        # Longest edge -> 2048, 512-px tiles: 3 rows x 4 cols + global image, 64 tokens each.
        assert tuple(inputs["pixel_values"].shape) == (1, 13, 3, 512, 512)
        assert n_visual == 13 * 64
    with torch.no_grad():
        out = model(**inputs)
    assert out.logits.shape == (1, inputs["input_ids"].shape[1], len(processor.tokenizer))
    assert torch.isfinite(out.logits).all()
    generated = model.generate(**inputs, max_new_tokens=3)
    n_new = generated.shape[1] - inputs["input_ids"].shape[1]
    assert 1 <= n_new <= 3
    assert torch.equal(generated[:, : inputs["input_ids"].shape[1]], inputs["input_ids"])


@pytest.mark.parametrize("alias", TINY_ALIASES)
def test_video_forward(built, alias: str) -> None:
    model, processor = built[alias]
    inputs = _video_inputs(processor, _video(), fps=2.0)
    if alias.startswith("tiny-qwen"):
        # 8 frames / temporal patch 2 -> t=4; 224 px -> 16x16 patches -> 8x8 merged per step.
        assert inputs["video_grid_thw"].tolist() == [[4, 16, 16]]
        assert int((inputs["input_ids"] == processor.video_token_id).sum()) == 4 * 8 * 8
        assert inputs["second_per_grid_ts"].tolist() == [1.0]  # temporal_patch_size / fps
    else:
        # Every frame becomes one 512x512 image of 64 tokens.
        assert tuple(inputs["pixel_values"].shape) == (1, 8, 3, 512, 512)
        assert int((inputs["input_ids"] == processor.image_token_id).sum()) == 8 * 64
        text = processor.tokenizer.decode(inputs["input_ids"][0])
        assert "series of eight frames" in text and "Frame from 00:03" in text
    with torch.no_grad():
        out = model(**inputs)
    assert torch.isfinite(out.logits).all()


@pytest.mark.parametrize("alias", TINY_ALIASES)
def test_eager_attention_matches_sdpa(built, alias: str) -> None:
    model, processor = built[alias]
    eager, _ = build_tiny(alias, seed=0, attn_implementation="eager")
    assert eager.config._attn_implementation == "eager"
    inputs = _image_inputs(processor, _image(224, 168))
    with torch.no_grad():
        a = model(**inputs).logits
        b = eager(**inputs).logits
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_qwen_4k_image_token_count_and_full_forward(built) -> None:
    model, processor = built["tiny-qwen2.5-vl"]
    inputs = _image_inputs(processor, _image(3840, 2160))
    assert inputs["image_grid_thw"].tolist() == [[1, 154, 274]]
    n_visual = int((inputs["input_ids"] == processor.image_token_id).sum())
    assert 10_000 <= n_visual <= 11_000
    assert n_visual == 154 * 274 // 4
    with torch.no_grad():
        out = model(**inputs, logits_to_keep=1)
    assert out.logits.shape[1] == 1
    assert torch.isfinite(out.logits).all()


# --------------------------------------------------------------------------- save / reload


@pytest.mark.parametrize("alias", TINY_ALIASES)
def test_save_reload_round_trip(built, alias: str, tmp_path) -> None:
    model, processor = built[alias]
    path = save_tiny(alias, tmp_path / alias)
    loaded = AutoModelForImageTextToText.from_pretrained(path)
    loaded_processor = AutoProcessor.from_pretrained(path)
    assert type(loaded) is type(model)
    assert type(loaded_processor) is type(processor)
    assert type(loaded_processor.tokenizer) is type(processor.tokenizer)
    assert type(loaded_processor.image_processor) is type(processor.image_processor)
    assert type(loaded_processor.video_processor) is type(processor.video_processor)
    assert loaded_processor.chat_template == processor.chat_template
    assert not loaded.training

    image = _image()
    inputs = _image_inputs(processor, image)
    loaded_inputs = _image_inputs(loaded_processor, image)
    assert inputs.keys() == loaded_inputs.keys()
    for key in inputs:
        assert torch.equal(inputs[key], loaded_inputs[key]), key
    with torch.no_grad():
        a = model(**inputs).logits
        b = loaded(**loaded_inputs).logits
    assert torch.equal(a, b)
