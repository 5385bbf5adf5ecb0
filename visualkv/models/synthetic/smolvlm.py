"""SmolVLM2 offline builds: the tiny and bench models, the released 2.2B shape, the released processor."""

from __future__ import annotations

from transformers import (
    ProcessorMixin,
    SmolVLMConfig,
    SmolVLMImageProcessor,
    SmolVLMImageProcessorPil,
    SmolVLMProcessor,
    SmolVLMVideoProcessor,
)
from transformers.image_utils import IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD, PILImageResampling

from visualkv.models import compat
from visualkv.models.synthetic.specs import ShapeSpec, TinySpec, text_common, with_depth
from visualkv.models.synthetic.tokenizer_build import SMOLVLM_CHAT_TEMPLATE, build_smolvlm_tokenizer

# Processor settings of HuggingFaceTB/SmolVLM2-500M-Video-Instruct.
PROCESSOR_SETTINGS: dict[str, object] = {
    "image_size": {"longest_edge": 4 * 512},  # resize target before tiling
    "max_image_size": {"longest_edge": 512},  # tile side / vision encoder input
    "video_size": {"longest_edge": 512},
    "video_fps": 1,
    "video_max_frames": 64,
    "image_seq_len": 64,  # (512 / 16) ** 2 / 4 ** 2
    "scale_factor": 4,
    "patch_size": 16,
    "image_mean": IMAGENET_STANDARD_MEAN,
    "image_std": IMAGENET_STANDARD_STD,
    "resample": PILImageResampling.LANCZOS,
}

TINY_SPECS: dict[str, TinySpec] = {
    "tiny-smolvlm2": TinySpec(
        family="smolvlm",
        text_hidden_size=64,
        text_num_layers=2,
        text_num_heads=4,
        text_num_kv_heads=2,
        text_intermediate_size=128,
        vision_hidden_size=32,
        vision_num_layers=2,
        vision_num_heads=2,
        vision_intermediate_size=64,
        note="random weights, SmolVLM2 architecture (tests)",
        description="SmolVLM2, Llama LLM 64x2L (4q/2kv heads, head_dim 16), SigLIP 32x2L 512px/16",
    ),
    # a bigger LLM with a small vision tower, so LLM compute dominates a CPU prefill (benchmarks)
    "bench-smolvlm2": TinySpec(
        family="smolvlm",
        text_hidden_size=512,
        text_num_layers=16,
        text_num_heads=8,
        text_num_kv_heads=2,
        text_intermediate_size=1536,
        vision_hidden_size=64,
        vision_num_layers=2,
        vision_num_heads=2,
        vision_intermediate_size=128,
        note="random weights, larger LLM for benchmarks",
        description="SmolVLM2, Llama LLM 512x16L (8q/2kv heads, head_dim 64), SigLIP 64x2L 512px/16",
    ),
}

# HuggingFaceTB/SmolVLM2-2.2B-Instruct: Llama LLM 24 layers, hidden 2048, head_dim 64 (32 heads, 32 KV heads),
# MLP 8192, vocab 49280 (mlx-vlm's test of this config), rope_theta 130000, 8192 positions; SigLIP so400m
# vision tower: 27 layers, hidden 1152, 16 heads, MLP 4304, 384-px input, patch 14; pixel shuffle 3 (81 tokens
# per 384-px tile); images resized to a longest edge of 4 x 384 = 1536 px before tiling.
SHAPE_SPECS: dict[str, ShapeSpec] = {
    "shape-smolvlm2-2.2b": ShapeSpec(
        "HuggingFaceTB/SmolVLM2-2.2B-Instruct",
        "smolvlm",
        "SmolVLM2-2.2B",
        TinySpec("smolvlm", 2048, 24, 32, 32, 8192, 1152, 27, 16, 4304, rope_theta=130000.0),
        vocab_size=49280,
        tie_word_embeddings=False,
        max_position_embeddings=8192,
        vision={"image_size": 384, "patch_size": 14, "scale_factor": 3, "longest_edge": 4 * 384},
    ),
}


def image_processor_class() -> type:
    """The backend AutoImageProcessor picks for SmolVLM, so a built processor equals a saved-and-reloaded one.

    SmolVLM resizes with Lanczos, which torchvision has only from 0.27: below that, transformers loads the PIL
    backend instead (the torchvision one would fall back to bicubic). GPU images often carry an older
    torchvision (the H200 image: 0.26).
    """
    if "SmolVLMImageProcessor" in compat.DEFAULT_TO_PIL_BACKEND_IMAGE_PROCESSORS:
        return SmolVLMImageProcessorPil
    return SmolVLMImageProcessor


def generation_ids(tokenizer) -> tuple[int, int, int]:
    """The tokenizer's own bos / eos / pad, as the released generation config."""
    return tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id


def build_processor(spec: TinySpec) -> ProcessorMixin:
    """SmolVLMProcessor with the released settings around the offline SmolLM2-style tokenizer."""
    s = PROCESSOR_SETTINGS
    image_processor = image_processor_class()(
        do_image_splitting=True,
        size=dict(s["image_size"]),
        max_image_size=dict(s["max_image_size"]),
        resample=s["resample"],
        image_mean=s["image_mean"],
        image_std=s["image_std"],
        do_pad=True,
    )
    video_processor = SmolVLMVideoProcessor(
        size=dict(s["video_size"]),
        max_image_size=dict(s["max_image_size"]),
        resample=s["resample"],
        image_mean=s["image_mean"],
        image_std=s["image_std"],
        fps=s["video_fps"],
        num_frames=s["video_max_frames"],
        do_pad=True,
    )
    tokenizer = build_smolvlm_tokenizer(spec.bpe_vocab_size)
    return SmolVLMProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        image_seq_len=s["image_seq_len"],
        chat_template=SMOLVLM_CHAT_TEMPLATE,
    )


def build_config(spec: TinySpec, processor: ProcessorMixin, attn_implementation: str = "sdpa") -> SmolVLMConfig:
    """SmolVLM config for `spec` (Llama LLM, SigLIP tower, pixel shuffle); token ids from the processor."""
    tok = processor.tokenizer
    s = PROCESSOR_SETTINGS
    return SmolVLMConfig(
        text_config={
            **text_common(spec, tok),
            "model_type": "llama",
            "head_dim": spec.head_dim,
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id,
            "tie_word_embeddings": False,
        },
        vision_config={
            "hidden_size": spec.vision_hidden_size,
            "intermediate_size": spec.vision_intermediate_size,
            "num_hidden_layers": spec.vision_num_layers,
            "num_attention_heads": spec.vision_num_heads,
            "num_channels": 3,
            "image_size": s["max_image_size"]["longest_edge"],
            "patch_size": s["patch_size"],
            "hidden_act": "gelu_pytorch_tanh",
            "layer_norm_eps": 1e-6,
            "initializer_range": 0.02,
        },
        scale_factor=s["scale_factor"],
        image_token_id=processor.image_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        attn_implementation=attn_implementation,
    )


def shape_processor(shape: ShapeSpec) -> ProcessorMixin:
    """The released tile geometry (`shape.vision`) with the tiny model's other settings and tokenizer."""
    v = shape.vision
    s = PROCESSOR_SETTINGS
    common = {
        "max_image_size": {"longest_edge": v["image_size"]},
        "resample": s["resample"],
        "image_mean": s["image_mean"],
        "image_std": s["image_std"],
        "do_pad": True,
    }
    image_processor = image_processor_class()(
        do_image_splitting=True, size={"longest_edge": v["longest_edge"]}, **common
    )
    video_processor = SmolVLMVideoProcessor(
        size={"longest_edge": v["image_size"]}, fps=s["video_fps"], num_frames=s["video_max_frames"], **common
    )
    tokens_per_tile = (v["image_size"] // v["patch_size"]) ** 2 // v["scale_factor"] ** 2
    return SmolVLMProcessor(
        image_processor=image_processor,
        tokenizer=build_smolvlm_tokenizer(shape.sizes.bpe_vocab_size),
        video_processor=video_processor,
        image_seq_len=tokens_per_tile,
        chat_template=SMOLVLM_CHAT_TEMPLATE,
    )


def shape_config(shape: ShapeSpec, processor: ProcessorMixin, num_layers: int | None = None) -> SmolVLMConfig:
    sizes = with_depth(shape.sizes, num_layers)
    tok, v = processor.tokenizer, shape.vision
    return SmolVLMConfig(
        text_config={
            "model_type": "llama",
            "vocab_size": shape.vocab_size,
            "hidden_size": sizes.text_hidden_size,
            "intermediate_size": sizes.text_intermediate_size,
            "num_hidden_layers": sizes.text_num_layers,
            "num_attention_heads": sizes.text_num_heads,
            "num_key_value_heads": sizes.text_num_kv_heads,
            "head_dim": sizes.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": shape.max_position_embeddings,
            "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "default", "rope_theta": sizes.rope_theta},
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id,
            "tie_word_embeddings": shape.tie_word_embeddings,
            "use_cache": True,
        },
        vision_config={
            "hidden_size": sizes.vision_hidden_size,
            "intermediate_size": sizes.vision_intermediate_size,
            "num_hidden_layers": sizes.vision_num_layers,
            "num_attention_heads": sizes.vision_num_heads,
            "num_channels": 3,
            "image_size": v["image_size"],
            "patch_size": v["patch_size"],
            "hidden_act": "gelu_pytorch_tanh",
            "layer_norm_eps": 1e-6,
        },
        scale_factor=v["scale_factor"],
        image_token_id=processor.image_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=shape.tie_word_embeddings,
        attn_implementation="sdpa",
    )
