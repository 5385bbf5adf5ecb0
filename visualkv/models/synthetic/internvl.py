"""InternVL3.5 offline builds: the tiny model, the released 8B shape, the released processor and chat template."""

from __future__ import annotations

from transformers import (
    GotOcr2ImageProcessor,
    InternVLConfig,
    InternVLProcessor,
    InternVLVideoProcessor,
    ProcessorMixin,
)
from transformers.image_utils import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, PILImageResampling

from visualkv.models import compat
from visualkv.models.synthetic.specs import ShapeSpec, TinySpec, text_common
from visualkv.models.synthetic.tokenizer_build import build_qwen_tokenizer, qwen_generation_ids, set_qwen_text_ids

# Processor settings of OpenGVLab/InternVL3_5-*-HF (GotOcr2 image processor with crop_to_patches, InternVL
# video processor): 448-px tiles, 1..12 tiles chosen by aspect ratio plus a thumbnail, 256 tokens per tile
# (32 x 32 patches, pixel shuffle 0.5), ImageNet mean/std.
PROCESSOR_SETTINGS: dict[str, object] = {
    "tile_size": 448,
    "min_patches": 1,
    "max_patches": 12,
    "image_seq_length": 256,
    "patch_size": 14,
    "downsample_ratio": 0.5,
    "image_mean": IMAGENET_DEFAULT_MEAN,
    "image_std": IMAGENET_DEFAULT_STD,
    "resample": PILImageResampling.BICUBIC,
}

# Chat template of OpenGVLab/InternVL3_5-*-HF, reduced to what VisualKV sends: Qwen-style turns, an
# image as "<IMG_CONTEXT>\n" and a video as "<video>\n" before the text (the processor expands both).
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\n' }}"
    "{% elif content['type'] == 'video' %}{{ '<video>\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TINY_SPECS: dict[str, TinySpec] = {
    "tiny-internvl3.5": TinySpec(
        family="internvl",
        text_hidden_size=64,
        text_num_layers=2,
        text_num_heads=4,
        text_num_kv_heads=2,
        text_intermediate_size=128,
        vision_hidden_size=32,
        vision_num_layers=2,
        vision_num_heads=2,
        vision_intermediate_size=64,
        note="random weights, InternVL3.5 architecture (tests)",
        description="InternVL3.5, Qwen3 LLM 64x2L (4q/2kv heads, head_dim 16), InternViT 32x2L 448px/14, "
        "pixel shuffle 0.5 (256 tokens per tile)",
    ),
}


def internvl3_5_8b_config(attn_implementation: str = "sdpa") -> InternVLConfig:
    """OpenGVLab/InternVL3_5-8B-HF: InternViT-300M-448px (24 x 1024, 16 heads, MLP 4096, 448 px / 14, pixel
    shuffle 0.5: 256 tokens per tile) and the Qwen3-8B LLM (36 x 4096, 32 query / 8 KV heads of 128, MLP
    12288, vocabulary 151936).

    Assembled from the model card (InternViT-300M-448px-V2.5 + Qwen3-8B) and those two models' configs, as no
    copy of the -HF config.json itself was at hand; checked against xtuner's `InternVL3P5Dense8BConfig` (the
    trainer that writes these checkpoints): qkv bias on, layer norm, GELU, image token 151671, 1..12 tiles +
    thumbnail, 40960 positions, theta 1e6, untied.
    """
    return InternVLConfig(
        text_config={
            "model_type": "qwen3",
            "vocab_size": 151936,
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "hidden_act": "silu",
            "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "tie_word_embeddings": False,
        },
        vision_config={
            "hidden_size": 1024,
            "num_hidden_layers": 24,
            "num_attention_heads": 16,
            "intermediate_size": 4096,
            "image_size": [448, 448],
            "patch_size": [14, 14],
            "attention_bias": True,
        },
        image_token_id=151671,
        downsample_ratio=0.5,
        image_seq_length=256,
        tie_word_embeddings=False,
        attn_implementation=attn_implementation,
    )


SHAPE_SPECS: dict[str, ShapeSpec] = {
    "shape-internvl3.5-8b": ShapeSpec(
        "OpenGVLab/InternVL3_5-8B-HF", "internvl", "InternVL3.5-8B", released=internvl3_5_8b_config
    ),
}

generation_ids = qwen_generation_ids


def build_processor(spec: TinySpec) -> ProcessorMixin:
    """InternVLProcessor with the released settings around the offline Qwen tokenizer plus InternVL's tokens."""
    s = PROCESSOR_SETTINGS
    common = {
        "size": {"height": s["tile_size"], "width": s["tile_size"]},
        "image_mean": s["image_mean"],
        "image_std": s["image_std"],
        "resample": s["resample"],
    }
    tokenizer = build_qwen_tokenizer(spec.bpe_vocab_size)
    names = {
        "start_image_token": "<img>",
        "end_image_token": "</img>",
        "context_image_token": "<IMG_CONTEXT>",
        "video_token": "<video>",
    }
    tokenizer.add_tokens(list(names.values()), special_tokens=True)
    # the released tokenizer_config names these in a dict of extra special tokens; this is how
    # transformers registers such names (tokenizer.start_image_token, .start_image_token_id, ...)
    compat.set_special_token_names(tokenizer, names)
    tokenizer.chat_template = CHAT_TEMPLATE
    return InternVLProcessor(
        image_processor=GotOcr2ImageProcessor(
            crop_to_patches=True, min_patches=s["min_patches"], max_patches=s["max_patches"], **common
        ),
        tokenizer=tokenizer,
        video_processor=InternVLVideoProcessor(**common),
        image_seq_length=s["image_seq_length"],
        chat_template=CHAT_TEMPLATE,
    )


def build_config(spec: TinySpec, processor: ProcessorMixin, attn_implementation: str = "sdpa") -> InternVLConfig:
    """InternVL3.5 config for `spec` (Qwen3 LLM, InternViT tower, pixel shuffle); token ids from the processor."""
    tok = processor.tokenizer
    ids = tok.convert_tokens_to_ids
    s = PROCESSOR_SETTINGS
    return InternVLConfig(
        text_config={
            **text_common(spec, tok),
            "model_type": "qwen3",
            "head_dim": spec.head_dim,
            "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
            "bos_token_id": ids("<|endoftext|>"),
            "eos_token_id": ids("<|im_end|>"),
            "pad_token_id": ids("<|endoftext|>"),
            "tie_word_embeddings": False,
        },
        vision_config={
            "hidden_size": spec.vision_hidden_size,
            "intermediate_size": spec.vision_intermediate_size,
            "num_hidden_layers": spec.vision_num_layers,
            "num_attention_heads": spec.vision_num_heads,
            "image_size": [s["tile_size"], s["tile_size"]],
            "patch_size": [s["patch_size"], s["patch_size"]],
            "hidden_act": "gelu",
            "norm_type": "layer_norm",
            "use_mean_pooling": True,
        },
        image_token_id=processor.image_token_id,
        image_seq_length=s["image_seq_length"],
        downsample_ratio=s["downsample_ratio"],
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
        attn_implementation=attn_implementation,
    )


def shape_processor(shape: ShapeSpec) -> ProcessorMixin:
    return build_processor(TINY_SPECS["tiny-internvl3.5"])  # the tiny processor's settings are the released ones


def shape_config(shape: ShapeSpec, processor: ProcessorMixin, num_layers: int | None = None) -> InternVLConfig:
    """The released config with the offline tokenizer's ids; `num_layers` sets both depths."""
    cfg = shape.released()
    set_qwen_text_ids(cfg.text_config, processor.tokenizer)
    cfg.image_token_id = processor.image_token_id
    if num_layers is not None:
        cfg.text_config.num_hidden_layers = num_layers
        cfg.vision_config.num_hidden_layers = num_layers
    return cfg
