"""What VisualKV's attention path supports: causal softmax attention over every entry the cache keeps.

A sliding window, logit soft-capping or attention sinks change which entries a query sees or how it weighs them.
The cache's eviction, the packed tiers and the block and decode attention do not carry them (transformers would
pass them as keyword arguments that the direct path drops), so a model using one is refused when it is loaded,
not answered wrongly.
"""

from __future__ import annotations

from typing import Any

from visualkv.errors import ModelLoadError


def _sliding(attention: Any, config: Any, layer: int) -> bool:
    layer_types = getattr(config, "layer_types", None) or ()
    windowed = layer < len(layer_types) and "sliding" in str(layer_types[layer])
    return windowed or bool(getattr(attention, "sliding_window", None))


def _softcap(attention: Any, config: Any) -> bool:
    return bool(getattr(attention, "attn_logit_softcapping", None) or getattr(config, "attn_logit_softcapping", None))


def _sinks(attention: Any) -> bool:
    return getattr(attention, "sinks", None) is not None


def unsupported_attention(layers: list[Any], text_config: Any) -> str | None:
    """The first attention feature of `layers` (the decoder layers) the direct path does not support, or None."""
    for i, layer in enumerate(layers):
        attention = getattr(layer, "self_attn", None)
        if attention is None:
            continue
        config = getattr(attention, "config", None) or text_config
        if _sliding(attention, config, i):
            return f"a sliding attention window (layer {i})"
        if _softcap(attention, config):
            return f"attention logit soft-capping (layer {i})"
        if _sinks(attention):
            return f"attention sinks (layer {i})"
    return None


def refuse_unsupported_attention(family: str, layers: list[Any], text_config: Any) -> None:
    """Raise ModelLoadError (one line naming the family) when the decoder uses what the direct path drops."""
    feature = unsupported_attention(layers, text_config)
    if feature is not None:
        raise ModelLoadError(
            f"{family} uses {feature}, which VisualKV's attention does not support: choose a model without it"
        )
