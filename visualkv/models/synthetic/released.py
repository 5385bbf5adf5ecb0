"""Released configurations of the newer families, for `shape-...` aliases (random weights, real shapes).

Each function returns the transformers config of a released checkpoint, written out here so that a
shape model can be built offline (on the GPU, in the target dtype) to measure memory and speed. The
token ids are the released tokenizer's; a shape model pairs the config with any processor of the
family configured like the release (the tiny alias's processor is: its settings are the release's).
Values are copied from the checkpoints' config.json as quoted by public sources (cited per function).
"""

from __future__ import annotations

from transformers import InternVLConfig, LlavaOnevisionConfig, PretrainedConfig, Qwen3VLConfig


def qwen3_vl_8b_instruct_config(attn_implementation: str = "sdpa") -> Qwen3VLConfig:
    """Qwen/Qwen3-VL-8B-Instruct config.json.

    Source: the checkpoint's config.json as reproduced in public code (e.g. the Qwen3-VL-8B test
    fixtures of TensorRT-LLM and mlx-swift ports, found with the code search): LLM 36 x 4096, 32 query /
    8 KV heads of 128, MLP 12288, interleaved M-RoPE [24, 20, 20], theta 5e6; vision 27 x 1152, 16 heads,
    patch 16, merge 2, DeepStack from vision blocks 8, 16, 24, 2304 learned positions.
    Cross-checked value by value (2026-11-30) against two verbatim copies of the config.json: TensorRT-LLM's
    Qwen3-VL-8B-Instruct test config (`_name_or_path` .../Qwen3-VL-8B-Instruct; 4 layers there "for
    testing, 36 layers for full model") and a Swift port's test fixture: every number above and every token
    id (151643/151645, 151652/151653, 151655/151656), vocab 151936, untied, all agree.
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


def llava_onevision_qwen2_7b_ov_config(attn_implementation: str = "sdpa") -> LlavaOnevisionConfig:
    """llava-hf/llava-onevision-qwen2-7b-ov-hf config.json.

    Source: transformers' `LlavaOnevisionConfig`, whose defaults are this checkpoint's (its docstring names
    it: SigLIP-so400m tower cut to 26 layers, 384 px / 14, "full" features of the last kept layer,
    anyres_max_9, token ids 151646 / 151647, the 36 grid pinpoints), and the Qwen2-7B LLM of the checkpoint:
    28 x 3584, 28 query / 4 KV heads, MLP 18944, vocabulary 152128, RoPE theta 1e6.
    Cross-checked (2026-11-30, no copy of the -hf config.json itself was found in the code index) against
    (a) transformers' conversion script that made the -hf checkpoint
    (models/llava_onevision/convert_llava_onevision_weights_to_hf.py): text config = Qwen/Qwen2-7B-Instruct's,
    SiglipVisionConfig(1152, 384 px, MLP 4304, 16 heads, 26 layers "drop the last layer", patch 14, no head),
    vocabulary resized to 152064 + 2 (<image>, <video>) padded to a multiple of 64 = 152128; and (b) the
    original lmms-lab/llava-onevision-qwen2-7b-ov config.json quoted in PaddleMIX's tests: 28 layers, hidden
    3584, 28 / 4 heads, MLP 18944, 32768 positions, theta 1e6, untied, image token 151646, anyres_max_9.
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


def internvl3_5_8b_config(attn_implementation: str = "sdpa") -> InternVLConfig:
    """OpenGVLab/InternVL3_5-8B-HF: InternViT-300M-448px (24 x 1024, 16 heads, MLP 4096, 448 px / 14, pixel
    shuffle 0.5: 256 tokens per tile) and the Qwen3-8B LLM (36 x 4096, 32 query / 8 KV heads of 128, MLP
    12288, vocabulary 151936).

    Source: the InternVL3.5-8B model card (vision part InternViT-300M-448px-V2.5, language part Qwen3-8B)
    and those two models' published configs; transformers' `InternVLVisionConfig` defaults are
    InternViT-300M's except the attention bias. No copy of the -HF config.json itself was found, so it is
    assembled; cross-checked (2026-11-30) against xtuner's `InternVL3P5Dense8BConfig` (the trainer that
    writes these checkpoints; model/compose/internvl/internvl_config.py): InternViT 24 x 1024, 16 heads, MLP
    4096, 448 px / 14, qkv bias on (`attention_bias: True`; also visible in InternVL3's model print,
    `qkv: Linear(1024, 3072, bias=True)`), layer norm, GELU, downsample 0.5, image token 151671 (also in an
    InternVL3.5 -HF config.json quoted by a C++ port's test), 1..12 tiles + thumbnail; and its
    `Qwen3Dense8BConfig`: 36 x 4096, 32 / 8 heads of 128, MLP 12288, vocab 151936, 40960 positions, theta
    1e6, untied.
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


#: shape alias -> (released Hub id, config builder, tiny alias whose processor has the release's settings)
RELEASED_CONFIGS: dict[str, tuple[str, object, str]] = {
    "shape-qwen3-vl-8b": ("Qwen/Qwen3-VL-8B-Instruct", qwen3_vl_8b_instruct_config, "tiny-qwen3-vl"),
    "shape-internvl3.5-8b": ("OpenGVLab/InternVL3_5-8B-HF", internvl3_5_8b_config, "tiny-internvl3.5"),
    "shape-llava-onevision-7b": (
        "llava-hf/llava-onevision-qwen2-7b-ov-hf",
        llava_onevision_qwen2_7b_ov_config,
        "tiny-llava-onevision",
    ),
}


def released_config(alias: str) -> PretrainedConfig:
    """The released config behind a shape alias (KeyError listing the known ones otherwise)."""
    try:
        return RELEASED_CONFIGS[alias][1]()
    except KeyError:
        raise KeyError(f"unknown shape alias {alias!r}; known: {sorted(RELEASED_CONFIGS)}") from None
