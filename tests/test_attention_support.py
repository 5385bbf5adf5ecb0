"""A model whose decoder uses what VisualKV's attention path drops (a sliding window, logit soft-capping,
attention sinks) is refused when it is loaded, in one line naming its family; the families served load."""

from __future__ import annotations

import pytest
import torch

from visualkv.errors import ModelLoadError
from visualkv.models.registry import _adapter
from visualkv.models.synthetic.tiny import build_tiny

FAMILIES = {
    "tiny-qwen2.5-vl": "qwen2_5_vl",
    "tiny-qwen3-vl": "qwen3_vl",
    "tiny-smolvlm2": "smolvlm",
    "tiny-internvl3.5": "internvl",
    "tiny-llava-onevision": "llava_onevision",
}


def _decoder_attentions(model) -> list[torch.nn.Module]:
    return [m for name, m in model.named_modules() if name.endswith("self_attn") and "layers" in name]


def _with(feature: str, model) -> None:
    """Give `model`'s last decoder layer `feature`, as a family using it would have it."""
    attention = _decoder_attentions(model)[-1]
    if feature == "sliding window":
        attention.sliding_window = 16
    elif feature == "soft-capping":
        attention.attn_logit_softcapping = 50.0
    else:
        attention.sinks = torch.nn.Parameter(torch.zeros(4))


@pytest.mark.parametrize("alias", sorted(FAMILIES))
def test_every_served_family_loads(alias):
    assert _adapter(*build_tiny(alias, seed=0), alias).layers


@pytest.mark.parametrize("feature", ["sliding window", "soft-capping", "sinks"])
@pytest.mark.parametrize("alias", ["tiny-qwen2.5-vl", "tiny-smolvlm2"])
def test_an_unsupported_attention_feature_is_refused_at_load_in_one_line(alias, feature):
    model, processor = build_tiny(alias, seed=0)
    _with(feature, model)
    with pytest.raises(ModelLoadError, match=f"^{FAMILIES[alias]} uses .*{feature.split()[0]}") as err:
        _adapter(model, processor, alias)
    assert "\n" not in str(err.value) and "not support" in str(err.value)


def test_sliding_layers_named_by_the_config_are_refused():
    model, processor = build_tiny("tiny-internvl3.5", seed=0)
    config = _decoder_attentions(model)[0].config
    config.layer_types = ["sliding_attention"] * len(config.layer_types)
    with pytest.raises(ModelLoadError, match="^internvl uses a sliding attention window \\(layer 0\\)"):
        _adapter(model, processor, "tiny-internvl3.5")
