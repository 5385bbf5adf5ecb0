"""Qwen3-VL offline builds: the tiny model, the released 8B shape, the released processor and chat template."""

from __future__ import annotations

from transformers import ProcessorMixin, Qwen2VLImageProcessor, Qwen3VLConfig, Qwen3VLProcessor, Qwen3VLVideoProcessor
from transformers.image_utils import IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD, PILImageResampling

from visualkv.models.synthetic.specs import ShapeSpec, TinySpec, text_common
from visualkv.models.synthetic.tokenizer_build import build_qwen_tokenizer, qwen_generation_ids, set_qwen_text_ids

# Processor settings of Qwen/Qwen3-VL-*-Instruct: preprocessor_config.json (image, Qwen2VLImageProcessorFast)
# and video_preprocessor_config.json (Qwen3VLVideoProcessor); pixel limits are totals (image: 256^2..4096^2
# px; video: all frames together). Both normalise with mean = std = 0.5.
PROCESSOR_SETTINGS: dict[str, object] = {
    "image_size": {"shortest_edge": 65536, "longest_edge": 16777216},
    "video_size": {"shortest_edge": 4096, "longest_edge": 25165824},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": IMAGENET_STANDARD_MEAN,  # (0.5, 0.5, 0.5)
    "image_std": IMAGENET_STANDARD_STD,
    "resample": PILImageResampling.BICUBIC,
    "video_fps": 2,
}

# Chat template of Qwen/Qwen3-VL-*-Instruct (chat_template.json of the released checkpoints), reduced to
# what VisualKV sends (text, image and video content; no tools): unlike Qwen2.5-VL there is no default
# system message.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TINY_SPECS: dict[str, TinySpec] = {
    "tiny-qwen3-vl": TinySpec(
        family="qwen3_vl",
        text_hidden_size=64,
        text_num_layers=2,
        text_num_heads=4,
        text_num_kv_heads=2,
        text_intermediate_size=128,
        vision_hidden_size=32,
        vision_num_layers=2,
        vision_num_heads=2,
        vision_intermediate_size=64,
        mrope_section=(4, 2, 2),
        deepstack_visual_indexes=(0, 1),
        num_position_embeddings=256,
        rope_theta=5000000.0,
        note="random weights, Qwen3-VL architecture with DeepStack (tests)",
        description="Qwen3-VL, LLM 64x2L (4q/2kv heads, head_dim 16, interleaved M-RoPE), "
        "vision 32x2L 16px patches, DeepStack from both vision blocks into LLM layers 0-1",
    ),
}


def qwen3_vl_8b_instruct_config(attn_implementation: str = "sdpa") -> Qwen3VLConfig:
    """Qwen/Qwen3-VL-8B-Instruct config.json.

    LLM 36 x 4096, 32 query / 8 KV heads of 128, MLP 12288, interleaved M-RoPE [24, 20, 20], theta 5e6; vision
    27 x 1152, 16 heads, patch 16, merge 2, DeepStack from vision blocks 8, 16, 24, 2304 learned positions.
    Checked value by value (token ids and vocabulary included) against two verbatim copies of the config.json:
    TensorRT-LLM's Qwen3-VL-8B-Instruct test config and a Swift port's test fixture.
    """
    return Qwen3VLConfig(
        text_config={
            "vocab_size": 151936,
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "hidden_act": "silu",
            "max_position_embeddings": 262144,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5000000.0,
                "mrope_section": [24, 20, 20],
                "mrope_interleaved": True,
            },
            "attention_bias": False,
            "bos_token_id": 151643,
            "eos_token_id": 151645,
        },
        vision_config={
            "depth": 27,
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "num_heads": 16,
            "hidden_act": "gelu_pytorch_tanh",
            "in_channels": 3,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": 4096,
            "num_position_embeddings": 2304,
            "deepstack_visual_indexes": [8, 16, 24],
        },
        image_token_id=151655,
        video_token_id=151656,
        vision_start_token_id=151652,
        vision_end_token_id=151653,
        tie_word_embeddings=False,
        attn_implementation=attn_implementation,
    )


SHAPE_SPECS: dict[str, ShapeSpec] = {
    "shape-qwen3-vl-8b": ShapeSpec(
        "Qwen/Qwen3-VL-8B-Instruct", "qwen3_vl", "Qwen3-VL-8B", released=qwen3_vl_8b_instruct_config
    ),
}

generation_ids = qwen_generation_ids


def build_processor(spec: TinySpec) -> ProcessorMixin:
    """Qwen3VLProcessor with the released settings around the offline Qwen tokenizer."""
    s = PROCESSOR_SETTINGS
    common = {
        k: s[k] for k in ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std", "resample")
    }
    tokenizer = build_qwen_tokenizer(spec.bpe_vocab_size)
    tokenizer.chat_template = CHAT_TEMPLATE
    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=dict(s["image_size"]), **common),
        tokenizer=tokenizer,
        video_processor=Qwen3VLVideoProcessor(size=dict(s["video_size"]), fps=s["video_fps"], **common),
        chat_template=CHAT_TEMPLATE,
    )


def build_config(spec: TinySpec, processor: ProcessorMixin, attn_implementation: str = "sdpa") -> Qwen3VLConfig:
    """Qwen3-VL config for `spec`; token ids from the processor. Interleaved M-RoPE, DeepStack."""
    tok = processor.tokenizer
    if sum(spec.mrope_section) * 2 != spec.head_dim:
        raise ValueError(f"mrope_section {spec.mrope_section} must sum to head_dim/2 = {spec.head_dim // 2}")
    ids = tok.convert_tokens_to_ids
    s = PROCESSOR_SETTINGS
    return Qwen3VLConfig(
        text_config={
            **text_common(spec, tok),
            "head_dim": spec.head_dim,
            "max_position_embeddings": 262144,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": spec.rope_theta,
                "mrope_section": list(spec.mrope_section),
                "mrope_interleaved": True,
            },
            "bos_token_id": ids("<|endoftext|>"),
            "eos_token_id": ids("<|im_end|>"),
            "pad_token_id": ids("<|endoftext|>"),
        },
        vision_config={
            "depth": spec.vision_num_layers,
            "hidden_size": spec.vision_hidden_size,
            "intermediate_size": spec.vision_intermediate_size,
            "num_heads": spec.vision_num_heads,
            "hidden_act": "gelu_pytorch_tanh",
            "in_channels": 3,
            "patch_size": s["patch_size"],
            "spatial_merge_size": s["merge_size"],
            "temporal_patch_size": s["temporal_patch_size"],
            "out_hidden_size": spec.text_hidden_size,
            "num_position_embeddings": spec.num_position_embeddings,
            "deepstack_visual_indexes": list(spec.deepstack_visual_indexes),
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
    return build_processor(TINY_SPECS["tiny-qwen3-vl"])  # the tiny processor's settings are the released ones


def shape_config(shape: ShapeSpec, processor: ProcessorMixin, num_layers: int | None = None) -> Qwen3VLConfig:
    """The released config with the offline tokenizer's ids; fewer layers keep the DeepStack taps that remain."""
    cfg = shape.released()
    ids = processor.tokenizer.convert_tokens_to_ids
    set_qwen_text_ids(cfg.text_config, processor.tokenizer)
    cfg.image_token_id, cfg.video_token_id = ids("<|image_pad|>"), ids("<|video_pad|>")
    cfg.vision_start_token_id, cfg.vision_end_token_id = ids("<|vision_start|>"), ids("<|vision_end|>")
    if num_layers is not None:
        cfg.text_config.num_hidden_layers = num_layers
        vision = cfg.vision_config
        vision.depth = num_layers
        taps = [i for i in vision.deepstack_visual_indexes if i < num_layers]
        vision.deepstack_visual_indexes = taps or [num_layers - 1]
    return cfg
