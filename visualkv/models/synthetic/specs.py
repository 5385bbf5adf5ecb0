"""What a family's offline builds are made of: the tiny and shape specs and the interface of a builds module.

Each family has one module in this package (`qwen2_5_vl.py`, `smolvlm.py`, ...) that satisfies
:class:`FamilyBuilds`; `tiny.py` and `shapes.py` build any alias through it, found via the family's entry in
`visualkv.models.registry.FAMILIES`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

from transformers import PretrainedConfig, ProcessorMixin


@dataclass(frozen=True)
class TinySpec:
    """Sizes of one tiny model alias.

    Attributes:
        family: The family's registry name (``"qwen2_5_vl"``, ``"smolvlm"``, ...).
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
        fullatt_block_indexes: Qwen2.5-VL only: vision blocks with full (not windowed) attention.
        bpe_vocab_size: Size of the trained BPE vocabulary (special tokens come on top);
            the model's ``vocab_size`` equals ``len(tokenizer)``.
        rope_theta: LLM RoPE base.
        deepstack_visual_indexes: Qwen3-VL only: vision blocks whose features are added to the
            visual tokens' hidden states after the first LLM layers (one LLM layer per entry).
        num_position_embeddings: Qwen3-VL only: size of the learned (square) vision position table.
        description: One-line human description of the sizes.
        note: What the model list (`python -m visualkv models`, the app) says of the alias.
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
    note: str = ""

    @property
    def head_dim(self) -> int:
        """LLM attention head dimension."""
        return self.text_hidden_size // self.text_num_heads


@dataclass(frozen=True)
class ShapeSpec:
    """One released configuration, built with random weights (memory and speed only).

    Either `sizes` (TinySpec's fields at full size, plus the vocabulary, tying, positions and, for SmolVLM, the
    `vision` input geometry) or `released`, a function returning the checkpoint's config written out in full.
    """

    hub_id: str
    family: str
    #: the released model's short name in the model list ("Qwen2.5-VL-3B")
    label: str
    sizes: TinySpec | None = None
    vocab_size: int = 0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 128000
    #: SmolVLM only: vision input side, patch size, pixel-shuffle factor, image longest edge before tiling
    vision: dict = field(default_factory=dict)
    released: Callable[..., PretrainedConfig] | None = None


class FamilyBuilds(Protocol):
    """The module of one family's offline builds (a module satisfies this structurally)."""

    #: tiny and bench aliases -> sizes
    TINY_SPECS: dict[str, TinySpec]
    #: shape aliases -> released configuration
    SHAPE_SPECS: dict[str, ShapeSpec]

    def build_processor(self, spec: TinySpec) -> ProcessorMixin:
        """The family's processor class with the released settings around the offline tokenizer."""

    def build_config(self, spec: TinySpec, processor: ProcessorMixin, attn_implementation: str) -> PretrainedConfig:
        """The model config of a tiny spec; token ids from the processor's tokenizer."""

    def shape_processor(self, shape: ShapeSpec) -> ProcessorMixin:
        """The processor a shape model is paired with (released pixel / tile settings, offline tokenizer)."""

    def shape_config(self, shape: ShapeSpec, processor: ProcessorMixin, num_layers: int | None) -> PretrainedConfig:
        """The released config with the offline tokenizer's ids; `num_layers` scales both depths down."""

    def generation_ids(self, tokenizer) -> tuple[int, int | list[int], int]:
        """(bos, eos, pad) token ids of the generation config."""


def text_common(spec: TinySpec, tok) -> dict:
    """LLM config entries shared by every family's tiny build."""
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


def with_depth(sizes: TinySpec, num_layers: int | None) -> TinySpec:
    """`sizes` with `num_layers` LLM and vision layers (full vision attention then in the last block); None: as is."""
    if num_layers is None:
        return sizes
    return replace(
        sizes,
        text_num_layers=num_layers,
        vision_num_layers=num_layers,
        fullatt_block_indexes=(num_layers - 1,) if sizes.fullatt_block_indexes else (),
    )
