"""README.md's front matter is a Hugging Face Space configuration the Hub accepts, suited to ZeroGPU."""

from __future__ import annotations

from pathlib import Path

import gradio
import yaml
from huggingface_hub import SpaceHardware

from visualkv.runtime.access import default_allowed_models

ROOT = Path(__file__).resolve().parents[1]


def _front_matter() -> dict:
    text = (ROOT / "README.md").read_text()
    assert text.startswith("---\n"), "README.md must start with the Space's front matter"
    return yaml.safe_load(text.split("---\n", 2)[1])


def test_suggested_hardware_is_the_zero_gpu_flavor():
    hardware = _front_matter()["suggested_hardware"]
    assert hardware in {flavor.value for flavor in SpaceHardware}, hardware
    assert hardware == SpaceHardware.ZERO_A10G.value  # ZeroGPU: a slice of a shared GPU per call


def test_front_matter_names_the_app_the_tested_gradio_and_loadable_models():
    config = _front_matter()
    assert config["sdk"] == "gradio" and config["sdk_version"] == gradio.__version__
    assert (ROOT / config["app_file"]).is_file()
    assert set(config["models"]) <= set(default_allowed_models())  # a shared Space loads only listed models
