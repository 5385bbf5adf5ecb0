"""LLaVA-OneVision offline builds: the tiny model, the released 7B shape, the released processor and template."""

from __future__ import annotations

from transformers import (
    LlavaOnevisionConfig,
    LlavaOnevisionImageProcessor,
    LlavaOnevisionProcessor,
    LlavaOnevisionVideoProcessor,
    ProcessorMixin,
)
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, PILImageResampling

from visualkv.models.synthetic.specs import ShapeSpec, TinySpec, text_common
from visualkv.models.synthetic.tokenizer_build import build_qwen_tokenizer, qwen_generation_ids, set_qwen_text_ids

# Processor settings of llava-hf/llava-onevision-qwen2-7b-ov-hf (preprocessor_config.json,
# processor_config.json): 384-px SigLIP tiles, the anyres grid pinpoints (384..2304 px per side; the
# image processor's default list is the released one), 729 tokens per tile ("full" strategy keeps every
# patch), anyres_max_9 (features beyond ~9 tiles are downsampled). CLIP mean/std.
PROCESSOR_SETTINGS: dict[str, object] = {
    "tile_size": 384,
    "num_image_tokens": 729,
    "vision_feature_select_strategy": "full",
    "vision_aspect_ratio": "anyres_max_9",
    "patch_size": 14,
    "image_mean": OPENAI_CLIP_MEAN,
    "image_std": OPENAI_CLIP_STD,
    "resample": PILImageResampling.BICUBIC,
}

# Chat template of llava-hf/llava-onevision-qwen2-*-ov-hf (chat_template.json): images, then videos,
# then each text on its own line, after "<|im_start|>ROLE "; no newline after <|im_end|>.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + ' ' }}"
    "{% if message['content'] is string %}{{ '\n' + message['content'] }}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}{{ '<video>' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ '\n' + content['text'] }}"
    "{% endfor %}{% endif %}{{ '<|im_end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TINY_SPECS: dict[str, TinySpec] = {
    "tiny-llava-onevision": TinySpec(
        family="llava_onevision",
        text_hidden_size=64,
        text_num_layers=2,
        text_num_heads=4,
        text_num_kv_heads=2,
        text_intermediate_size=128,
        vision_hidden_size=32,
        vision_num_layers=2,
        vision_num_heads=2,
        vision_intermediate_size=64,
        note="random weights, LLaVA-OneVision architecture (tests)",
        description="LLaVA-OneVision, Qwen2 LLM 64x2L (4q/2kv heads, head_dim 16), SigLIP 32x2L 384px/14 "
        "(729 tokens per tile), anyres_max_9",
    ),
}


def llava_onevision_qwen2_7b_ov_config(attn_implementation: str = "sdpa") -> LlavaOnevisionConfig:
    """llava-hf/llava-onevision-qwen2-7b-ov-hf config.json.

    transformers' `LlavaOnevisionConfig` defaults are this checkpoint's (SigLIP-so400m tower cut to 26 layers,
    384 px / 14, "full" features, anyres_max_9, token ids 151646 / 151647, the 36 grid pinpoints); the LLM is
    its Qwen2-7B: 28 x 3584, 28 query / 4 KV heads, MLP 18944, vocabulary 152128 (152064 + <image>, <video>,
    padded to a multiple of 64), RoPE theta 1e6. Checked against transformers' conversion script that made the
    -hf checkpoint and the original lmms-lab config.json quoted in PaddleMIX's tests.
    """
    return LlavaOnevisionConfig(
        text_config={
            "model_type": "qwen2",
            "vocab_size": 152128,
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "hidden_act": "silu",
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "tie_word_embeddings": False,
            "bos_token_id": 151643,
            "eos_token_id": 151645,
        },
        attn_implementation=attn_implementation,
    )


SHAPE_SPECS: dict[str, ShapeSpec] = {
    "shape-llava-onevision-7b": ShapeSpec(
        "llava-hf/llava-onevision-qwen2-7b-ov-hf",
        "llava_onevision",
        "LLaVA-OneVision-7B",
        released=llava_onevision_qwen2_7b_ov_config,
    ),
}

generation_ids = qwen_generation_ids


def build_processor(spec: TinySpec) -> ProcessorMixin:
    """LlavaOnevisionProcessor with the released settings around the offline Qwen tokenizer."""
    s = PROCESSOR_SETTINGS
    tile = {"height": s["tile_size"], "width": s["tile_size"]}
    common = {"size": tile, "image_mean": s["image_mean"], "image_std": s["image_std"], "resample": s["resample"]}
    tokenizer = build_qwen_tokenizer(spec.bpe_vocab_size)
    tokenizer.add_tokens(["<image>", "<video>"], special_tokens=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    return LlavaOnevisionProcessor(
        image_processor=LlavaOnevisionImageProcessor(do_pad=True, **common),
        tokenizer=tokenizer,
        video_processor=LlavaOnevisionVideoProcessor(**common),
        num_image_tokens=s["num_image_tokens"],
        vision_feature_select_strategy=s["vision_feature_select_strategy"],
        vision_aspect_ratio=s["vision_aspect_ratio"],
        chat_template=CHAT_TEMPLATE,
    )


def build_config(spec: TinySpec, processor: ProcessorMixin, attn_implementation: str = "sdpa") -> LlavaOnevisionConfig:
    """LLaVA-OneVision config for `spec` (Qwen2 LLM, SigLIP tower); token ids from the processor."""
    tok = processor.tokenizer
    ids = tok.convert_tokens_to_ids
    s = PROCESSOR_SETTINGS
    return LlavaOnevisionConfig(
        text_config={
            **text_common(spec, tok),
            "model_type": "qwen2",
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
            "bos_token_id": ids("<|endoftext|>"),
            "eos_token_id": ids("<|im_end|>"),
            "pad_token_id": ids("<|endoftext|>"),
            "tie_word_embeddings": False,
        },
        vision_config={
            "model_type": "siglip_vision_model",
            "hidden_size": spec.vision_hidden_size,
            "intermediate_size": spec.vision_intermediate_size,
            "num_hidden_layers": spec.vision_num_layers,
            "num_attention_heads": spec.vision_num_heads,
            "image_size": s["tile_size"],
            "patch_size": s["patch_size"],
            "vision_use_head": False,
            "hidden_act": "gelu_pytorch_tanh",
            "layer_norm_eps": 1e-6,
        },
        image_token_index=ids("<image>"),
        video_token_index=ids("<video>"),
        vision_feature_select_strategy=s["vision_feature_select_strategy"],
        vision_feature_layer=-1,
        vision_aspect_ratio=s["vision_aspect_ratio"],
        image_grid_pinpoints=[list(p) for p in processor.image_processor.image_grid_pinpoints],
        tie_word_embeddings=False,
        attn_implementation=attn_implementation,
    )


def shape_processor(shape: ShapeSpec) -> ProcessorMixin:
    return build_processor(TINY_SPECS["tiny-llava-onevision"])  # the tiny processor's settings are the released ones


def shape_config(shape: ShapeSpec, processor: ProcessorMixin, num_layers: int | None = None) -> LlavaOnevisionConfig:
    """The released config with the offline tokenizer's ids; `num_layers` sets both depths."""
    cfg = shape.released()
    ids = processor.tokenizer.convert_tokens_to_ids
    set_qwen_text_ids(cfg.text_config, processor.tokenizer)
    cfg.image_token_id, cfg.video_token_id = ids("<image>"), ids("<video>")
    if num_layers is not None:
        cfg.text_config.num_hidden_layers = num_layers
        cfg.vision_config.num_hidden_layers = num_layers
    return cfg
