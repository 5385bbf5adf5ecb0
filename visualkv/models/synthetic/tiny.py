"""Tiny random-weight vision-language models built fully offline.

Tests and benchmarks must exercise the same code paths as real checkpoints, so every model here is an
instance of transformers' own class for the family and every processor is the family's own processor
class, configured like the released checkpoints (pixel limits, tiling, tokens per tile, chat template).
Only the sizes are tiny and the weights random (deterministic from a seed); the tokenizer is a byte-level
BPE trained in-process (:mod:`visualkv.models.synthetic.tokenizer_build`). Nothing is downloaded. The
aliases and their builders live in each family's module (`visualkv.models.synthetic.<family>`):
``tiny-*`` aliases have the smallest sensible dims (unit tests), ``bench-*`` a bigger LLM (hidden 512,
16 layers) with a small vision tower, so LLM compute dominates a CPU prefill (benchmarks).

Example::

    model, processor = build_tiny("tiny-qwen2.5-vl", seed=0)
    save_tiny("tiny-qwen2.5-vl", "/tmp/tiny")  # loadable with AutoModelForImageTextToText
"""

from __future__ import annotations

import os

import torch
from transformers import PretrainedConfig, PreTrainedModel, ProcessorMixin

from visualkv.models.registry import family_named, tiny_specs
from visualkv.models.synthetic.specs import TinySpec

__all__ = ["TINY_SPECS", "TinySpec", "build_tiny", "build_tiny_config", "build_tiny_processor", "save_tiny"]

#: every tiny and bench alias of every family
TINY_SPECS: dict[str, TinySpec] = tiny_specs()


def _spec(alias: str) -> TinySpec:
    try:
        return TINY_SPECS[alias]
    except KeyError:
        raise KeyError(f"unknown tiny alias {alias!r}; known: {sorted(TINY_SPECS)}") from None


def build_tiny_processor(alias: str) -> ProcessorMixin:
    """Assemble the family's real processor class around a locally built tokenizer."""
    spec = _spec(alias)
    return family_named(spec.family).builds.build_processor(spec)


def build_tiny_config(
    alias: str,
    processor: ProcessorMixin | None = None,
    attn_implementation: str = "sdpa",
) -> PretrainedConfig:
    """Build the model config of ``alias``; token ids are taken from the processor's tokenizer."""
    spec = _spec(alias)
    processor = processor if processor is not None else build_tiny_processor(alias)
    return family_named(spec.family).builds.build_config(spec, processor, attn_implementation)


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
    family = family_named(_spec(alias).family)
    processor = build_tiny_processor(alias)
    config = build_tiny_config(alias, processor, attn_implementation=attn_implementation)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = family.model_class(config)
    model = model.to(dtype=dtype).eval()
    model.config.dtype = dtype  # as a loaded checkpoint reports it
    gen = model.generation_config
    gen.bos_token_id, gen.eos_token_id, gen.pad_token_id = family.builds.generation_ids(processor.tokenizer)
    gen.do_sample = False
    return model, processor


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
