"""Qwen2.5-VL offline builds: the tiny and bench models, the released 3B and 7B shapes, the released processor."""

from __future__ import annotations

from transformers import (
    ProcessorMixin,
    Qwen2_5_VLConfig,
    Qwen2_5_VLProcessor,
    Qwen2VLImageProcessor,
    Qwen2VLVideoProcessor,
)
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, PILImageResampling

from visualkv.models.synthetic.specs import ShapeSpec, TinySpec, text_common, with_depth
from visualkv.models.synthetic.tokenizer_build import QWEN_CHAT_TEMPLATE, build_qwen_tokenizer, qwen_generation_ids

# Processor settings of Qwen/Qwen2.5-VL-*-Instruct (preprocessor_config.json); the released
# repos ship no separate video config, so the video processor gets the same values.
PROCESSOR_SETTINGS: dict[str, object] = {
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": OPENAI_CLIP_MEAN,
    "image_std": OPENAI_CLIP_STD,
    "resample": PILImageResampling.BICUBIC,
}

TINY_SPECS: dict[str, TinySpec] = {
    "tiny-qwen2.5-vl": TinySpec(
        family="qwen2_5_vl",
        text_hidden_size=64,
        text_num_layers=2,
        text_num_heads=4,
        text_num_kv_heads=2,
        text_intermediate_size=128,
        vision_hidden_size=32,
        vision_num_layers=2,
        vision_num_heads=2,
        vision_intermediate_size=64,
        mrope_section=(2, 3, 3),
        fullatt_block_indexes=(1,),
        note="random weights, Qwen2.5-VL architecture (tests)",
        description="Qwen2.5-VL, LLM 64x2L (4q/2kv heads, head_dim 16), vision 32x2L (block 1 full-attn)",
    ),
    # a bigger LLM with a small vision tower, so LLM compute dominates a CPU prefill (benchmarks)
    "bench-qwen2.5-vl": TinySpec(
        family="qwen2_5_vl",
        text_hidden_size=512,
        text_num_layers=16,
        text_num_heads=8,
        text_num_kv_heads=2,
        text_intermediate_size=1536,
        vision_hidden_size=64,
        vision_num_layers=2,
        vision_num_heads=2,
        vision_intermediate_size=128,
        mrope_section=(8, 12, 12),
        fullatt_block_indexes=(1,),
        note="random weights, larger LLM for benchmarks",
        description="Qwen2.5-VL, LLM 512x16L (8q/2kv heads, head_dim 64), vision 64x2L (block 1 full-attn)",
    ),
}

# Released configurations (config.json; checked against public copies):
# - Qwen/Qwen2.5-VL-3B-Instruct: LLM 36 layers, hidden 2048, 16 heads, 2 KV heads, MLP 11008, vocab 151936,
#   tied embeddings, rope_theta 1e6, mrope_section (16, 24, 24); vision 32 blocks, hidden 1280, 16 heads,
#   MLP 3420, window 112, full attention in blocks 7/15/23/31, out 2048 (a copy of the released config.json,
#   with its torchinfo print, in a public notes repository).
# - Qwen/Qwen2.5-VL-7B-Instruct: LLM 28 layers, hidden 3584, 28 heads, 4 KV heads (k_proj 3584 -> 512), MLP
#   18944, vocab 152064, untied; same vision tower, out 3584 (model print of the released checkpoint in
#   acproject/duorou docs/qwen2.5vl_graph.md; also transformers' Qwen2_5_VLConfig defaults, which are the 7B).
# Both processors: PROCESSOR_SETTINGS above.
_VISION = {
    "vision_hidden_size": 1280,
    "vision_num_layers": 32,
    "vision_num_heads": 16,
    "vision_intermediate_size": 3420,
    "mrope_section": (16, 24, 24),
    "fullatt_block_indexes": (7, 15, 23, 31),
    "rope_theta": 1000000.0,
}
SHAPE_SPECS: dict[str, ShapeSpec] = {
    "shape-qwen2.5-vl-3b": ShapeSpec(
        "Qwen/Qwen2.5-VL-3B-Instruct",
        "qwen2_5_vl",
        "Qwen2.5-VL-3B",
        TinySpec("qwen2_5_vl", 2048, 36, 16, 2, 11008, **_VISION),
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "shape-qwen2.5-vl-7b": ShapeSpec(
        "Qwen/Qwen2.5-VL-7B-Instruct",
        "qwen2_5_vl",
        "Qwen2.5-VL-7B",
        TinySpec("qwen2_5_vl", 3584, 28, 28, 4, 18944, **_VISION),
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
}

generation_ids = qwen_generation_ids


def build_processor(spec: TinySpec) -> ProcessorMixin:
    """Qwen2_5_VLProcessor with the released settings around the offline Qwen tokenizer."""
    s = PROCESSOR_SETTINGS
    common = {
        k: s[k]
        for k in (
            "patch_size",
            "temporal_patch_size",
            "merge_size",
            "image_mean",
            "image_std",
        )
    }
    image_processor = Qwen2VLImageProcessor(
        min_pixels=s["min_pixels"],
        max_pixels=s["max_pixels"],
        resample=s["resample"],
        **common,
    )
    video_processor = Qwen2VLVideoProcessor(
        min_pixels=s["min_pixels"],
        max_pixels=s["max_pixels"],
        resample=s["resample"],
        **common,
    )
    tokenizer = build_qwen_tokenizer(spec.bpe_vocab_size)
    return Qwen2_5_VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=QWEN_CHAT_TEMPLATE,
    )


def build_config(spec: TinySpec, processor: ProcessorMixin, attn_implementation: str = "sdpa") -> Qwen2_5_VLConfig:
    """Qwen2.5-VL config for `spec` (also used by scripts/train_demo.py); token ids from the processor."""
    tok = processor.tokenizer
    if sum(spec.mrope_section) * 2 != spec.head_dim:
        raise ValueError(f"mrope_section {spec.mrope_section} must sum to head_dim/2 = {spec.head_dim // 2}")
    ids = tok.convert_tokens_to_ids
    s = PROCESSOR_SETTINGS
    return Qwen2_5_VLConfig(
        text_config={
            **text_common(spec, tok),
            "max_position_embeddings": 128000,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": spec.rope_theta,
                "mrope_section": list(spec.mrope_section),
            },
            "use_sliding_window": False,
            "bos_token_id": ids("<|endoftext|>"),
            "eos_token_id": ids("<|im_end|>"),
            "pad_token_id": ids("<|endoftext|>"),
        },
        vision_config={
            "depth": spec.vision_num_layers,
            "hidden_size": spec.vision_hidden_size,
            "intermediate_size": spec.vision_intermediate_size,
            "num_heads": spec.vision_num_heads,
            "hidden_act": "silu",
            "in_channels": 3,
            "patch_size": s["patch_size"],
            "spatial_merge_size": s["merge_size"],
            "temporal_patch_size": s["temporal_patch_size"],
            "tokens_per_second": 2,
            "window_size": 112,
            "out_hidden_size": spec.text_hidden_size,
            "fullatt_block_indexes": list(spec.fullatt_block_indexes),
            "initializer_range": 0.02,
        },
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=False,
        attn_implementation=attn_implementation,
    )


def shape_processor(shape: ShapeSpec) -> ProcessorMixin:
    return build_processor(TINY_SPECS["tiny-qwen2.5-vl"])  # the tiny processor's settings are the released ones


def shape_config(shape: ShapeSpec, processor: ProcessorMixin, num_layers: int | None = None) -> Qwen2_5_VLConfig:
    cfg = build_config(with_depth(shape.sizes, num_layers), processor)
    cfg.text_config.vocab_size = shape.vocab_size
    cfg.text_config.max_position_embeddings = shape.max_position_embeddings
    cfg.text_config.sliding_window = 32768  # released value; unused (use_sliding_window is false)
    cfg.tie_word_embeddings = cfg.text_config.tie_word_embeddings = shape.tie_word_embeddings
    return cfg
