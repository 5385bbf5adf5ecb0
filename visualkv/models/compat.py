"""Every use VisualKV makes of a transformers or accelerate internal, in one place.

transformers is pinned (requirements.txt). What VisualKV relies on that transformers does not publish as an API
is reached only through this module, each item with the reason it is needed (`INTERNALS`). tests/test_compat.py
checks each against the installed version and names the internal that changed; it also searches the package and
fails on an internal used anywhere else. Public routes are used where they exist: the decoder's attention
functions are registered through transformers' `AttentionInterface` / `AttentionMaskInterface`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin
from transformers.models.auto.image_processing_auto import DEFAULT_TO_PIL_BACKEND_IMAGE_PROCESSORS
from transformers.models.got_ocr2.image_processing_got_ocr2 import get_optimal_tiled_canvas
from transformers.models.qwen2_vl.video_processing_qwen2_vl import smart_resize
from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as qwen3_smart_resize


@dataclass(frozen=True)
class Internal:
    """One transformers / accelerate internal: the name as spelled where it is used, and why it is used."""

    name: str
    reason: str


INTERNALS = (
    Internal("_attn_implementation", "the decoder's attention kernel is read from (and named on) its configs"),
    Internal("eager_attention_forward", "eager attention is a function of each model file, not registered"),
    Internal("apply_rotary_pos_emb", "scoring recomputes post-RoPE keys / queries with the model's own RoPE"),
    Internal("cu_seq_lens_q", "the Qwen vision attention passes a layer's chunks in one call to a 'flash' name"),
    Internal("get_rope_index", "Qwen2.5-VL's 3-D positions of a prompt come from the model, not the processor"),
    Internal("rotary_emb", "the layer loop runs decoder layers itself and needs their cos / sin tables"),
    Internal("CacheLayerMixin", "the compressible cache is a transformers cache made of its own layers"),
    Internal("_from_config", "random-weight test models are built from a config without loading weights"),
    Internal("_set_model_specific_special_tokens", "a built InternVL tokenizer names its media tokens"),
    Internal("transformers.models.", "processor helpers (frame sizes, tiling) match the processors exactly"),
    Internal("sys.modules[", "a modeling file's own functions are found from a module of that file"),
)

#: the config attribute behind transformers' `config._attn_implementation` property (the property's setter
#: also rewrites sub-configs, so the decoder's configs are changed through this attribute alone)
ATTN_IMPLEMENTATION_FIELD = "_attn_implementation_internal"

#: the module functions of a modeling file VisualKV calls (`model_file_function`)
EAGER_ATTENTION, TEXT_ROPE = "eager_attention_forward", "apply_rotary_pos_emb"

#: transformers' Qwen vision attention gives a layer's chunk boundaries to the attention function in one call
#: (as these keyword arguments) when the function's registered name contains this marker, and otherwise calls it
#: once per chunk (`transformers.modeling_utils.is_flash_attention_requested`)
VARLEN_NAME_MARKER = "flash"
VARLEN_BOUNDARIES = "cu_seq_lens_q"
VARLEN_OTHERS = ("cu_seq_lens_k", "max_length_q", "max_length_k")

CacheLayerBase = CacheLayerMixin
__all__ = [
    "DEFAULT_TO_PIL_BACKEND_IMAGE_PROCESSORS",
    "get_optimal_tiled_canvas",
    "qwen3_smart_resize",
    "smart_resize",
]


def attention_implementation(config: Any) -> str | None:
    """The attention kernel a config names ("sdpa", "eager", ...)."""
    return config._attn_implementation


def model_file_function(module: torch.nn.Module | type, name: str) -> Callable:
    """Function `name` of the modeling file that defines `module`'s class (e.g. its eager attention)."""
    cls = module if isinstance(module, type) else type(module)
    return getattr(sys.modules[cls.__module__], name)


def rotary_tables(language_model: torch.nn.Module, hidden: torch.Tensor, positions: torch.Tensor):
    """(cos, sin) of the decoder's rotary embedding for `positions` (in the model's position-id layout)."""
    return language_model.rotary_emb(hidden, positions)


def rope_index(model: torch.nn.Module, input_ids: torch.Tensor, **grids: Any) -> tuple[torch.Tensor, Any]:
    """Qwen2.5-VL's (3, batch, seq) position ids and deltas of a prompt (`grids`: the processor's outputs)."""
    return model.model.get_rope_index(input_ids, **grids)


def model_from_config(cls: type, config: Any, **kwargs: Any) -> torch.nn.Module:
    """A model of `cls` with fresh random weights (the public route, `from_pretrained`, loads weights)."""
    return cls._from_config(config, **kwargs)


def set_special_token_names(tokenizer: Any, names: dict[str, str]) -> None:
    """Name model-specific special tokens on a tokenizer (`tokenizer.start_image_token`, ...), as loading a
    released tokenizer config does."""
    tokenizer._set_model_specific_special_tokens(names)
