"""Tiny random-weight vision-language models built fully offline.

Tests and benchmarks must exercise the same code paths as real checkpoints, so every
model here is an instance of transformers' own class for the family
(``Qwen2_5_VLForConditionalGeneration`` / ``SmolVLMForConditionalGeneration``) and every
processor is the family's own processor class, configured like the released checkpoints
(pixel limits, tiling, tokens per tile, chat template). Only the sizes are tiny and the
weights random (deterministic from a seed). The tokenizer is a byte-level BPE trained
in-process (see :mod:`visualkv.models.synthetic.tokenizer_build`). Nothing is downloaded.

Aliases (see :data:`TINY_SPECS`):

* ``tiny-qwen2.5-vl`` / ``tiny-smolvlm2``: smallest sensible dims, for unit tests.
* ``bench-qwen2.5-vl`` / ``bench-smolvlm2``: a bigger LLM (hidden 512, 16 layers) with a
  small vision tower, so LLM compute dominates a CPU prefill (for benchmarks).

Example::

    model, processor = build_tiny("tiny-qwen2.5-vl", seed=0)
    save_tiny("tiny-qwen2.5-vl", "/tmp/tiny")  # loadable with AutoModelForImageTextToText
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from transformers import (
    GotOcr2ImageProcessor,
    InternVLConfig,
    InternVLForConditionalGeneration,
    InternVLProcessor,
    InternVLVideoProcessor,
    LlavaOnevisionConfig,
    LlavaOnevisionForConditionalGeneration,
    LlavaOnevisionImageProcessor,
    LlavaOnevisionProcessor,
    LlavaOnevisionVideoProcessor,
    PreTrainedModel,
    ProcessorMixin,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2VLImageProcessor,
    Qwen2VLVideoProcessor,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLProcessor,
    Qwen3VLVideoProcessor,
    SmolVLMConfig,
    SmolVLMForConditionalGeneration,
    SmolVLMImageProcessor,
    SmolVLMImageProcessorPil,
    SmolVLMProcessor,
    SmolVLMVideoProcessor,
)
from transformers.image_utils import (
    IMAGENET_DEFAULT_MEAN,
    IMAGENET_DEFAULT_STD,
    IMAGENET_STANDARD_MEAN,
    IMAGENET_STANDARD_STD,
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    PILImageResampling,
)
from transformers.models.auto.image_processing_auto import DEFAULT_TO_PIL_BACKEND_IMAGE_PROCESSORS

from visualkv.models.synthetic.tokenizer_build import (
    INTERNVL_CHAT_TEMPLATE,
    LLAVA_ONEVISION_CHAT_TEMPLATE,
    QWEN3_VL_CHAT_TEMPLATE,
    QWEN_CHAT_TEMPLATE,
    SMOLVLM_CHAT_TEMPLATE,
    build_qwen_tokenizer,
    build_smolvlm_tokenizer,
)

__all__ = [
    "INTERNVL_PROCESSOR_SETTINGS",
    "LLAVA_ONEVISION_PROCESSOR_SETTINGS",
    "QWEN3_VL_PROCESSOR_SETTINGS",
    "QWEN_PROCESSOR_SETTINGS",
    "SMOLVLM_PROCESSOR_SETTINGS",
    "TINY_SPECS",
    "TinySpec",
    "build_tiny",
    "build_tiny_config",
    "build_tiny_processor",
    "qwen_config",
    "save_tiny",
]


@dataclass(frozen=True)
class TinySpec:
    """Sizes of one tiny model alias.

    Attributes:
        family: ``"qwen2_5_vl"``, ``"qwen3_vl"`` or ``"smolvlm"``.
        text_hidden_size: LLM hidden size.
        text_num_layers: Number of LLM decoder layers.
        text_num_heads: Number of query heads.
        text_num_kv_heads: Number of key/value heads (GQA when smaller than query heads).
        text_intermediate_size: LLM MLP width.
        vision_hidden_size: Vision-tower hidden size.
        vision_num_layers: Vision-tower depth.
        vision_num_heads: Vision-tower attention heads.
        vision_intermediate_size: Vision-tower MLP width.
        mrope_section: Qwen only: M-RoPE split of ``head_dim / 2`` into (t, h, w).
        fullatt_block_indexes: Qwen only: vision blocks with full (not windowed) attention.
        bpe_vocab_size: Size of the trained BPE vocabulary (special tokens come on top);
            the model's ``vocab_size`` equals ``len(tokenizer)``.
        rope_theta: LLM RoPE base.
        deepstack_visual_indexes: Qwen3-VL only: vision blocks whose features are added to the
            visual tokens' hidden states after the first LLM layers (one LLM layer per entry).
        num_position_embeddings: Qwen3-VL only: size of the learned (square) vision position table.
        description: One-line human description.
    """

    family: str
    text_hidden_size: int
    text_num_layers: int
    text_num_heads: int
    text_num_kv_heads: int
    text_intermediate_size: int
    vision_hidden_size: int
    vision_num_layers: int
    vision_num_heads: int
    vision_intermediate_size: int
    mrope_section: tuple[int, ...] = ()
    fullatt_block_indexes: tuple[int, ...] = ()
    bpe_vocab_size: int = 1024
    rope_theta: float = 1000000.0
    deepstack_visual_indexes: tuple[int, ...] = ()
    num_position_embeddings: int = 0
    description: str = ""

    @property
    def head_dim(self) -> int:
        """LLM attention head dimension."""
        return self.text_hidden_size // self.text_num_heads


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
        description="Qwen2.5-VL, LLM 64x2L (4q/2kv heads, head_dim 16), vision 32x2L (block 1 full-attn)",
    ),
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
        description="SmolVLM2, Llama LLM 64x2L (4q/2kv heads, head_dim 16), SigLIP 32x2L 512px/16",
    ),
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
        description="Qwen3-VL, LLM 64x2L (4q/2kv heads, head_dim 16, interleaved M-RoPE), "
        "vision 32x2L 16px patches, DeepStack from both vision blocks into LLM layers 0-1",
    ),
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
        description="LLaVA-OneVision, Qwen2 LLM 64x2L (4q/2kv heads, head_dim 16), SigLIP 32x2L 384px/14 "
        "(729 tokens per tile), anyres_max_9",
    ),
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
        description="InternVL3.5, Qwen3 LLM 64x2L (4q/2kv heads, head_dim 16), InternViT 32x2L 448px/14, "
        "pixel shuffle 0.5 (256 tokens per tile)",
    ),
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
        description="Qwen2.5-VL, LLM 512x16L (8q/2kv heads, head_dim 64), vision 64x2L (block 1 full-attn)",
    ),
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
        description="SmolVLM2, Llama LLM 512x16L (8q/2kv heads, head_dim 64), SigLIP 64x2L 512px/16",
    ),
}

# Processor settings of Qwen/Qwen2.5-VL-*-Instruct (preprocessor_config.json); the released
# repos ship no separate video config, so the video processor gets the same values.
QWEN_PROCESSOR_SETTINGS: dict[str, object] = {
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": OPENAI_CLIP_MEAN,
    "image_std": OPENAI_CLIP_STD,
    "resample": PILImageResampling.BICUBIC,
}

# Processor settings of Qwen/Qwen3-VL-*-Instruct: preprocessor_config.json (image, Qwen2VLImageProcessorFast)
# and video_preprocessor_config.json (Qwen3VLVideoProcessor); pixel limits are totals (image: 256^2..4096^2
# px; video: all frames together). Both normalise with mean = std = 0.5.
QWEN3_VL_PROCESSOR_SETTINGS: dict[str, object] = {
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

# Processor settings of llava-hf/llava-onevision-qwen2-7b-ov-hf (preprocessor_config.json,
# processor_config.json): 384-px SigLIP tiles, the anyres grid pinpoints (384..2304 px per side; the
# image processor's default list is the released one), 729 tokens per tile ("full" strategy keeps every
# patch), anyres_max_9 (features beyond ~9 tiles are downsampled). CLIP mean/std.
LLAVA_ONEVISION_PROCESSOR_SETTINGS: dict[str, object] = {
    "tile_size": 384,
    "num_image_tokens": 729,
    "vision_feature_select_strategy": "full",
    "vision_aspect_ratio": "anyres_max_9",
    "patch_size": 14,
    "image_mean": OPENAI_CLIP_MEAN,
    "image_std": OPENAI_CLIP_STD,
    "resample": PILImageResampling.BICUBIC,
}

# Processor settings of OpenGVLab/InternVL3_5-*-HF (GotOcr2 image processor with crop_to_patches, InternVL
# video processor): 448-px tiles, 1..12 tiles chosen by aspect ratio plus a thumbnail, 256 tokens per tile
# (32 x 32 patches, pixel shuffle 0.5), ImageNet mean/std.
INTERNVL_PROCESSOR_SETTINGS: dict[str, object] = {
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

# Processor settings of HuggingFaceTB/SmolVLM2-500M-Video-Instruct.
SMOLVLM_PROCESSOR_SETTINGS: dict[str, object] = {
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


def _spec(alias: str) -> TinySpec:
    try:
        return TINY_SPECS[alias]
    except KeyError:
        raise KeyError(f"unknown tiny alias {alias!r}; known: {sorted(TINY_SPECS)}") from None


def smolvlm_image_processor_class() -> type:
    """The backend AutoImageProcessor picks for SmolVLM, so a built processor equals a saved-and-reloaded one.

    SmolVLM resizes with Lanczos, which torchvision has only from 0.27: below that, transformers loads the PIL
    backend instead (the torchvision one would fall back to bicubic). GPU images often carry an older
    torchvision (the H200 image: 0.26).
    """
    if "SmolVLMImageProcessor" in DEFAULT_TO_PIL_BACKEND_IMAGE_PROCESSORS:
        return SmolVLMImageProcessorPil
    return SmolVLMImageProcessor


def build_tiny_processor(alias: str) -> ProcessorMixin:
    """Assemble the family's real processor class around a locally built tokenizer."""
    spec = _spec(alias)
    if spec.family == "qwen2_5_vl":
        s = QWEN_PROCESSOR_SETTINGS
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
    if spec.family == "qwen3_vl":
        s = QWEN3_VL_PROCESSOR_SETTINGS
        common = {
            k: s[k] for k in ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std", "resample")
        }
        tokenizer = build_qwen_tokenizer(spec.bpe_vocab_size)
        tokenizer.chat_template = QWEN3_VL_CHAT_TEMPLATE
        return Qwen3VLProcessor(
            image_processor=Qwen2VLImageProcessor(size=dict(s["image_size"]), **common),
            tokenizer=tokenizer,
            video_processor=Qwen3VLVideoProcessor(size=dict(s["video_size"]), fps=s["video_fps"], **common),
            chat_template=QWEN3_VL_CHAT_TEMPLATE,
        )
    if spec.family == "internvl":
        s = INTERNVL_PROCESSOR_SETTINGS
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
        tokenizer._set_model_specific_special_tokens(names)
        tokenizer.chat_template = INTERNVL_CHAT_TEMPLATE
        return InternVLProcessor(
            image_processor=GotOcr2ImageProcessor(
                crop_to_patches=True, min_patches=s["min_patches"], max_patches=s["max_patches"], **common
            ),
            tokenizer=tokenizer,
            video_processor=InternVLVideoProcessor(**common),
            image_seq_length=s["image_seq_length"],
            chat_template=INTERNVL_CHAT_TEMPLATE,
        )
    if spec.family == "llava_onevision":
        s = LLAVA_ONEVISION_PROCESSOR_SETTINGS
        tile = {"height": s["tile_size"], "width": s["tile_size"]}
        common = {"size": tile, "image_mean": s["image_mean"], "image_std": s["image_std"], "resample": s["resample"]}
        tokenizer = build_qwen_tokenizer(spec.bpe_vocab_size)
        tokenizer.add_tokens(["<image>", "<video>"], special_tokens=True)
        tokenizer.chat_template = LLAVA_ONEVISION_CHAT_TEMPLATE
        return LlavaOnevisionProcessor(
            image_processor=LlavaOnevisionImageProcessor(do_pad=True, **common),
            tokenizer=tokenizer,
            video_processor=LlavaOnevisionVideoProcessor(**common),
            num_image_tokens=s["num_image_tokens"],
            vision_feature_select_strategy=s["vision_feature_select_strategy"],
            vision_aspect_ratio=s["vision_aspect_ratio"],
            chat_template=LLAVA_ONEVISION_CHAT_TEMPLATE,
        )
    if spec.family == "smolvlm":
        s = SMOLVLM_PROCESSOR_SETTINGS
        image_processor = smolvlm_image_processor_class()(
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
    raise ValueError(f"unknown family {spec.family!r}")


def _text_common(spec: TinySpec, tok) -> dict:
    """LLM config entries shared by both families."""
    return {
        "vocab_size": len(tok),
        "hidden_size": spec.text_hidden_size,
        "intermediate_size": spec.text_intermediate_size,
        "num_hidden_layers": spec.text_num_layers,
        "num_attention_heads": spec.text_num_heads,
        "num_key_value_heads": spec.text_num_kv_heads,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "use_cache": True,
    }


def qwen_config(spec: TinySpec, processor: ProcessorMixin, attn_implementation: str = "sdpa") -> Qwen2_5_VLConfig:
    """Qwen2.5-VL config for `spec` (also used by scripts/train_demo.py); token ids from the processor."""
    tok = processor.tokenizer
    if sum(spec.mrope_section) * 2 != spec.head_dim:
        raise ValueError(f"mrope_section {spec.mrope_section} must sum to head_dim/2 = {spec.head_dim // 2}")
    ids = tok.convert_tokens_to_ids
    s = QWEN_PROCESSOR_SETTINGS
    return Qwen2_5_VLConfig(
        text_config={
            **_text_common(spec, tok),
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


def qwen3_vl_config(spec: TinySpec, processor: ProcessorMixin, attn_implementation: str = "sdpa") -> Qwen3VLConfig:
    """Qwen3-VL config for `spec`; token ids from the processor. Interleaved M-RoPE, DeepStack."""
    tok = processor.tokenizer
    if sum(spec.mrope_section) * 2 != spec.head_dim:
        raise ValueError(f"mrope_section {spec.mrope_section} must sum to head_dim/2 = {spec.head_dim // 2}")
    ids = tok.convert_tokens_to_ids
    s = QWEN3_VL_PROCESSOR_SETTINGS
    return Qwen3VLConfig(
        text_config={
            **_text_common(spec, tok),
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


def llava_onevision_config(
    spec: TinySpec, processor: ProcessorMixin, attn_implementation: str = "sdpa"
) -> LlavaOnevisionConfig:
    """LLaVA-OneVision config for `spec` (Qwen2 LLM, SigLIP tower); token ids from the processor."""
    tok = processor.tokenizer
    ids = tok.convert_tokens_to_ids
    s = LLAVA_ONEVISION_PROCESSOR_SETTINGS
    return LlavaOnevisionConfig(
        text_config={
            **_text_common(spec, tok),
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


def internvl_config(spec: TinySpec, processor: ProcessorMixin, attn_implementation: str = "sdpa") -> InternVLConfig:
    """InternVL3.5 config for `spec` (Qwen3 LLM, InternViT tower, pixel shuffle); token ids from the processor."""
    tok = processor.tokenizer
    ids = tok.convert_tokens_to_ids
    s = INTERNVL_PROCESSOR_SETTINGS
    return InternVLConfig(
        text_config={
            **_text_common(spec, tok),
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


def build_tiny_config(
    alias: str,
    processor: ProcessorMixin | None = None,
    attn_implementation: str = "sdpa",
) -> Qwen2_5_VLConfig | SmolVLMConfig:
    """Build the model config of ``alias``; token ids are taken from the processor's tokenizer."""
    spec = _spec(alias)
    processor = processor if processor is not None else build_tiny_processor(alias)
    if spec.family == "qwen2_5_vl":
        return qwen_config(spec, processor, attn_implementation)
    if spec.family == "qwen3_vl":
        return qwen3_vl_config(spec, processor, attn_implementation)
    if spec.family == "llava_onevision":
        return llava_onevision_config(spec, processor, attn_implementation)
    if spec.family == "internvl":
        return internvl_config(spec, processor, attn_implementation)
    tok = processor.tokenizer
    s = SMOLVLM_PROCESSOR_SETTINGS
    return SmolVLMConfig(
        text_config={
            **_text_common(spec, tok),
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


def build_tiny(
    alias: str,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
) -> tuple[PreTrainedModel, ProcessorMixin]:
    """Build a tiny random-weight VLM and its processor, offline and deterministically.

    Weights are drawn in float32 under ``torch.manual_seed(seed)`` (inside a forked RNG so
    the caller's global RNG state is untouched), then cast to ``dtype``; the same seed
    therefore gives identical weights for any dtype before casting.

    Args:
        alias: A key of :data:`TINY_SPECS`.
        seed: Seed for the random weights.
        dtype: Parameter dtype of the returned model.
        attn_implementation: ``"sdpa"`` (default) or ``"eager"``.

    Returns:
        ``(model, processor)``; the model is in ``eval()`` mode.
    """
    spec = _spec(alias)
    processor = build_tiny_processor(alias)
    config = build_tiny_config(alias, processor, attn_implementation=attn_implementation)
    model_cls = _MODEL_CLASSES[spec.family]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model = model.to(dtype=dtype).eval()
    model.config.dtype = dtype  # as a loaded checkpoint reports it
    tok = processor.tokenizer
    gen = model.generation_config
    if spec.family in ("qwen2_5_vl", "qwen3_vl", "llava_onevision", "internvl"):
        gen.bos_token_id = tok.convert_tokens_to_ids("<|endoftext|>")
        gen.eos_token_id = [
            tok.convert_tokens_to_ids("<|im_end|>"),
            tok.convert_tokens_to_ids("<|endoftext|>"),
        ]
        gen.pad_token_id = tok.convert_tokens_to_ids("<|endoftext|>")
    else:
        gen.bos_token_id = tok.bos_token_id
        gen.eos_token_id = tok.eos_token_id
        gen.pad_token_id = tok.pad_token_id
    gen.do_sample = False
    return model, processor


_MODEL_CLASSES: dict[str, type[PreTrainedModel]] = {
    "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
    "qwen3_vl": Qwen3VLForConditionalGeneration,
    "llava_onevision": LlavaOnevisionForConditionalGeneration,
    "internvl": InternVLForConditionalGeneration,
    "smolvlm": SmolVLMForConditionalGeneration,
}


def save_tiny(
    alias: str,
    path: str | os.PathLike[str],
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> str:
    """Build ``alias`` and write model + processor with ``save_pretrained`` into ``path``.

    The directory then loads like a real local checkpoint with
    ``AutoModelForImageTextToText.from_pretrained(path)`` and
    ``AutoProcessor.from_pretrained(path)``.

    Returns:
        ``str(path)``.
    """
    model, processor = build_tiny(alias, seed=seed, dtype=dtype)
    path = os.fspath(path)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path
