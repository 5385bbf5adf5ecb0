"""Shape models: the released configurations of real checkpoints with random weights, built offline.

Memory and speed only: random weights, answers are noise. A shape model has exactly the layers, hidden size,
heads, KV heads, MLP width, vocabulary size and vision tower of the released checkpoint, and its processor
has the released pixel / tile settings, so the KV cache, the activations, the vision tower's cost and the
weights' memory are those of the real model: what a GPU benchmark needs, without a download. The tokenizer
is the small offline BPE of the tiny models (its ids fit the large vocabulary), so prompts are shorter than
with the real tokenizer (a few tokens of text next to thousands of visual tokens).

The model is built directly on the target device in the target dtype (`torch.device` context +
`_from_config(dtype=...)`): no float32 copy, no host round trip. On CPU the build is refused with one line
when the weights would not fit in the available memory (instead of swapping the machine to death).

Where the numbers come from (the released `config.json` / `preprocessor_config.json`; checked against
public copies, since this machine has no network):

- Qwen/Qwen2.5-VL-3B-Instruct: LLM 36 layers, hidden 2048, 16 heads, 2 KV heads, MLP 11008, vocab 151936,
  tied embeddings, rope_theta 1e6, mrope_section (16, 24, 24); vision 32 blocks, hidden 1280, 16 heads,
  MLP 3420, window 112, full attention in blocks 7/15/23/31, out 2048 (a copy of the released config.json,
  with its torchinfo print, in a public notes repository).
- Qwen/Qwen2.5-VL-7B-Instruct: LLM 28 layers, hidden 3584, 28 heads, 4 KV heads (k_proj 3584 -> 512), MLP
  18944, vocab 152064, untied; same vision tower, out 3584 (model print of the released checkpoint in
  acproject/duorou docs/qwen2.5vl_graph.md; also transformers' Qwen2_5_VLConfig defaults, which are the 7B).
  Both Qwen processors: min_pixels 3136, max_pixels 12845056, patch 14, merge 2, temporal patch 2
  (QWEN_PROCESSOR_SETTINGS in tiny.py).
- HuggingFaceTB/SmolVLM2-2.2B-Instruct: Llama LLM 24 layers, hidden 2048, head_dim 64 (32 heads, 32 KV
  heads), MLP 8192, vocab 49280 (mlx-vlm's test of this config), rope_theta 130000, 8192 positions; SigLIP
  so400m vision tower: 27 layers, hidden 1152, 16 heads, MLP 4304, 384-px input, patch 14; pixel shuffle 3
  (81 tokens per 384-px tile); images resized to a longest edge of 4 x 384 = 1536 px before tiling.
- Qwen/Qwen3-VL-8B-Instruct, llava-hf/llava-onevision-qwen2-7b-ov-hf, OpenGVLab/InternVL3_5-8B-HF: the
  configs are written out in visualkv/models/synthetic/released.py (sources cited there, per checkpoint); the
  processors are the tiny aliases' (tiny-qwen3-vl, tiny-llava-onevision, tiny-internvl3.5), whose settings
  are the released ones (tiny.py). The released configs carry the released tokenizer's ids (image token
  151655 / 151646 / 151671, ...); a shape model is paired with the small offline tokenizer, so those ids are
  replaced by the tokenizer's own (`_patch_token_ids`): the model then finds its image tokens in the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache

import psutil
import torch
from transformers import (
    PreTrainedModel,
    ProcessorMixin,
    Qwen2_5_VLForConditionalGeneration,
    SmolVLMConfig,
    SmolVLMForConditionalGeneration,
    SmolVLMProcessor,
    SmolVLMVideoProcessor,
)

from visualkv.errors import ModelLoadError
from visualkv.models.synthetic.released import RELEASED_CONFIGS
from visualkv.models.synthetic.tiny import (
    _MODEL_CLASSES,
    SMOLVLM_PROCESSOR_SETTINGS,
    TINY_SPECS,
    TinySpec,
    build_tiny_processor,
    qwen_config,
    smolvlm_image_processor_class,
)
from visualkv.models.synthetic.tokenizer_build import SMOLVLM_CHAT_TEMPLATE, build_smolvlm_tokenizer

SHAPE_NOTE = "memory and speed only: random weights, answers are noise"


@dataclass(frozen=True)
class ShapeSpec:
    """One released configuration. `sizes` reuses TinySpec's fields at full size; the newer families
    (`released` set) take their whole config from visualkv/models/synthetic/released.py instead (`sizes` None)."""

    hub_id: str
    sizes: TinySpec | None
    vocab_size: int
    tie_word_embeddings: bool
    #: SmolVLM only: vision input side, patch size, pixel-shuffle factor, image longest edge before tiling
    vision: dict = field(default_factory=dict)
    max_position_embeddings: int = 128000
    #: the tiny alias whose processor (released settings) a released.py shape pairs with; "" otherwise
    released: str = ""

    @property
    def family(self) -> str:
        return TINY_SPECS[self.released].family if self.released else self.sizes.family


_QWEN_VISION = {
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
        TinySpec("qwen2_5_vl", 2048, 36, 16, 2, 11008, **_QWEN_VISION),
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "shape-qwen2.5-vl-7b": ShapeSpec(
        "Qwen/Qwen2.5-VL-7B-Instruct",
        TinySpec("qwen2_5_vl", 3584, 28, 28, 4, 18944, **_QWEN_VISION),
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
    "shape-smolvlm2-2.2b": ShapeSpec(
        "HuggingFaceTB/SmolVLM2-2.2B-Instruct",
        TinySpec("smolvlm", 2048, 24, 32, 32, 8192, 1152, 27, 16, 4304, rope_theta=130000.0),
        vocab_size=49280,
        tie_word_embeddings=False,
        max_position_embeddings=8192,
        vision={"image_size": 384, "patch_size": 14, "scale_factor": 3, "longest_edge": 4 * 384},
    ),
}
# Qwen3-VL-8B, LLaVA-OneVision-7B, InternVL3.5-8B: configs in released.py (vocabulary and tying copied here
# so that every shape answers the same questions)
for _alias, (_hub_id, _builder, _tiny) in RELEASED_CONFIGS.items():
    _cfg = _builder()
    _text = _cfg.text_config
    SHAPE_SPECS[_alias] = ShapeSpec(
        _hub_id,
        None,
        vocab_size=_text.vocab_size,
        tie_word_embeddings=bool(_cfg.tie_word_embeddings),
        max_position_embeddings=_text.max_position_embeddings,
        released=_tiny,
    )


def shape_spec(alias: str) -> ShapeSpec:
    try:
        return SHAPE_SPECS[alias]
    except KeyError:
        raise ModelLoadError(f"unknown shape alias {alias!r}; known: {', '.join(SHAPE_SPECS)}") from None


# -- processors and configs ------------------------------------------------------------------------------------------
def build_shape_processor(alias: str) -> ProcessorMixin:
    """The family's processor class with the released pixel / tile settings and the offline tokenizer."""
    spec = shape_spec(alias)
    if spec.released:
        return build_tiny_processor(spec.released)  # tiny.py's processor settings are the released ones
    if spec.family == "qwen2_5_vl":
        return build_tiny_processor("tiny-qwen2.5-vl")  # tiny.py's Qwen settings are the released ones
    v = spec.vision
    s = SMOLVLM_PROCESSOR_SETTINGS
    common = {
        "max_image_size": {"longest_edge": v["image_size"]},
        "resample": s["resample"],
        "image_mean": s["image_mean"],
        "image_std": s["image_std"],
        "do_pad": True,
    }
    image_processor = smolvlm_image_processor_class()(
        do_image_splitting=True, size={"longest_edge": v["longest_edge"]}, **common
    )
    video_processor = SmolVLMVideoProcessor(
        size={"longest_edge": v["image_size"]}, fps=s["video_fps"], num_frames=s["video_max_frames"], **common
    )
    tokens_per_tile = (v["image_size"] // v["patch_size"]) ** 2 // v["scale_factor"] ** 2
    return SmolVLMProcessor(
        image_processor=image_processor,
        tokenizer=build_smolvlm_tokenizer(spec.sizes.bpe_vocab_size),
        video_processor=video_processor,
        image_seq_len=tokens_per_tile,
        chat_template=SMOLVLM_CHAT_TEMPLATE,
    )


def build_shape_config(alias: str, processor: ProcessorMixin, num_layers: int | None = None):
    """The released configuration; `num_layers` (scaled-down tests) sets both the LLM's and the vision tower's
    depth (full attention then in the vision tower's last block), every width stays as released."""
    spec = shape_spec(alias)
    if spec.released:
        return _released_shape_config(alias, processor, num_layers)
    sizes = spec.sizes
    if num_layers is not None:
        sizes = TinySpec(
            **{
                **sizes.__dict__,
                "text_num_layers": num_layers,
                "vision_num_layers": num_layers,
                "fullatt_block_indexes": (num_layers - 1,) if sizes.fullatt_block_indexes else (),
            }
        )
    if spec.family == "qwen2_5_vl":
        cfg = qwen_config(sizes, processor)
        cfg.text_config.vocab_size = spec.vocab_size
        cfg.text_config.max_position_embeddings = spec.max_position_embeddings
        cfg.text_config.sliding_window = 32768  # released value; unused (use_sliding_window is false)
        cfg.tie_word_embeddings = cfg.text_config.tie_word_embeddings = spec.tie_word_embeddings
        return cfg
    tok, v = processor.tokenizer, spec.vision
    return SmolVLMConfig(
        text_config={
            "model_type": "llama",
            "vocab_size": spec.vocab_size,
            "hidden_size": sizes.text_hidden_size,
            "intermediate_size": sizes.text_intermediate_size,
            "num_hidden_layers": sizes.text_num_layers,
            "num_attention_heads": sizes.text_num_heads,
            "num_key_value_heads": sizes.text_num_kv_heads,
            "head_dim": sizes.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": spec.max_position_embeddings,
            "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "default", "rope_theta": sizes.rope_theta},
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id,
            "tie_word_embeddings": spec.tie_word_embeddings,
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
        tie_word_embeddings=spec.tie_word_embeddings,
        attn_implementation="sdpa",
    )


def _released_shape_config(alias: str, processor: ProcessorMixin, num_layers: int | None):
    """released.py's config with the offline tokenizer's token ids; `num_layers` scales both depths down
    (DeepStack then taps the vision blocks that remain)."""
    cfg = RELEASED_CONFIGS[alias][1]()
    _patch_token_ids(cfg, processor)
    if num_layers is not None:
        cfg.text_config.num_hidden_layers = num_layers
        vision = cfg.vision_config
        if hasattr(vision, "depth"):  # Qwen3-VL
            vision.depth = num_layers
            taps = [i for i in vision.deepstack_visual_indexes if i < num_layers]
            vision.deepstack_visual_indexes = taps or [num_layers - 1]
        else:
            vision.num_hidden_layers = num_layers
    return cfg


def _patch_token_ids(cfg, processor: ProcessorMixin) -> None:
    """Replace the released tokenizer's ids in `cfg` by the offline tokenizer's (same tokens, other ids)."""
    tok = processor.tokenizer
    ids = tok.convert_tokens_to_ids
    text = cfg.text_config
    text.bos_token_id, text.eos_token_id, text.pad_token_id = (
        ids("<|endoftext|>"),
        ids("<|im_end|>"),
        ids("<|endoftext|>"),
    )
    family = cfg.model_type
    if family == "qwen3_vl":
        cfg.image_token_id, cfg.video_token_id = ids("<|image_pad|>"), ids("<|video_pad|>")
        cfg.vision_start_token_id, cfg.vision_end_token_id = ids("<|vision_start|>"), ids("<|vision_end|>")
    elif family == "llava_onevision":
        cfg.image_token_id, cfg.video_token_id = ids("<image>"), ids("<video>")
    elif family == "internvl":
        cfg.image_token_id = processor.image_token_id
    else:
        raise ValueError(f"no token ids to patch for {family!r}")


def _model_class(spec: ShapeSpec) -> type[PreTrainedModel]:
    if spec.released:
        return _MODEL_CLASSES[spec.family]
    return Qwen2_5_VLForConditionalGeneration if spec.family == "qwen2_5_vl" else SmolVLMForConditionalGeneration


@cache
def parameter_count(alias: str, num_layers: int | None = None) -> int:
    """Parameters of the shape, counted on the meta device (nothing allocated); cached, as the CLI's fit check
    and the build both ask."""
    spec = shape_spec(alias)
    processor = build_shape_processor(alias)
    with torch.device("meta"):
        model = _model_class(spec)._from_config(build_shape_config(alias, processor, num_layers))
    return sum(p.numel() for p in model.parameters())


def _check_memory(alias: str, n_bytes: int, device: torch.device) -> None:
    """Refuse (one line) a build whose weights would not fit; CPU: available RAM, CUDA: free device memory."""
    if device.type == "cpu":
        free, where = psutil.virtual_memory().available, "available RAM"
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        where = f"free memory on {device}"
    else:
        return
    if n_bytes > 0.9 * free:
        raise ModelLoadError(
            f"{alias} needs {n_bytes / 2**30:.1f} GiB for its weights but this machine has {free / 2**30:.1f} GiB "
            f"{where}; use a GPU (--device cuda) or a smaller shape"
        )


def check_fits(
    alias: str, device: str | torch.device, dtype: torch.dtype = torch.bfloat16, num_layers: int | None = None
) -> None:
    """Raise ModelLoadError (one line) when the shape's weights would not fit on `device`; nothing is built."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    _check_memory(alias, parameter_count(alias, num_layers) * itemsize, torch.device(device))


def build_shape(
    alias: str,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    num_layers: int | None = None,
) -> tuple[PreTrainedModel, ProcessorMixin]:
    """Build a shape model with random weights directly on `device` in `dtype` (never downloads).

    num_layers: fewer LLM and vision layers than released (scaled-down tests); None = the released depths.
    Raises ModelLoadError (one line) when the weights would not fit in memory.
    """
    spec = shape_spec(alias)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    check_fits(alias, device, dtype, num_layers)
    processor = build_shape_processor(alias)
    config = build_shape_config(alias, processor, num_layers)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.device(device):
        torch.manual_seed(seed)
        model = _model_class(spec)._from_config(config, dtype=dtype)
    model = model.eval()
    model.config.dtype = dtype
    model.config.name_or_path = f"{alias} ({spec.hub_id} configuration, random weights)"
    tok, gen = processor.tokenizer, model.generation_config
    if spec.family != "smolvlm":  # the Qwen chat tokens (all but SmolVLM have a Qwen LLM)
        end = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
        gen.bos_token_id, gen.eos_token_id, gen.pad_token_id = end[1], end, end[1]
    else:
        gen.bos_token_id, gen.eos_token_id, gen.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    gen.do_sample = False
    return model, processor
