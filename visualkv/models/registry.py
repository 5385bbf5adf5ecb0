"""Model families, model aliases, and loading by alias, Hub id or local path.

Each family is one `ModelFamily` entry in `FAMILIES`: its adapter, its transformers class and the module of its
offline builds (`visualkv.models.synthetic.<family>`: tiny and shape specs, processor and config builders).
Offline aliases build tiny random-weight models in code (no download). Real checkpoints load with
transformers' own classes (`AutoProcessor`, `AutoModelForImageTextToText`), `trust_remote_code` off.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from transformers import (
    InternVLForConditionalGeneration,
    LlavaOnevisionForConditionalGeneration,
    PreTrainedModel,
    Qwen2_5_VLForConditionalGeneration,
    Qwen3VLForConditionalGeneration,
    SmolVLMForConditionalGeneration,
)

from visualkv.errors import ModelLoadError
from visualkv.models.attention_support import refuse_unsupported_attention
from visualkv.models.base import ModelAdapter
from visualkv.models.hub import hub_reachable
from visualkv.models.internvl import InternVLAdapter
from visualkv.models.llava_onevision import LlavaOnevisionAdapter
from visualkv.models.qwen2_5_vl import Qwen25VLAdapter
from visualkv.models.qwen3_vl import Qwen3VLAdapter
from visualkv.models.smolvlm import SmolVLMAdapter
from visualkv.models.synthetic import internvl as internvl_builds
from visualkv.models.synthetic import llava_onevision as llava_onevision_builds
from visualkv.models.synthetic import qwen2_5_vl as qwen2_5_vl_builds
from visualkv.models.synthetic import qwen3_vl as qwen3_vl_builds
from visualkv.models.synthetic import smolvlm as smolvlm_builds
from visualkv.models.synthetic.specs import FamilyBuilds, ShapeSpec, TinySpec


@dataclass(frozen=True)
class ModelFamily:
    """One model family.

    name: the released checkpoints' `config.model_type` (and `TinySpec.family`); adapter: the class that drives
    it; model_class: the transformers class its tiny and shape builds instantiate; builds: the module of its
    offline builds; model_types: further `config.model_type` values the same adapter serves.
    """

    name: str
    adapter: type[ModelAdapter]
    model_class: type[PreTrainedModel]
    builds: FamilyBuilds
    model_types: tuple[str, ...] = ()


FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily("qwen2_5_vl", Qwen25VLAdapter, Qwen2_5_VLForConditionalGeneration, qwen2_5_vl_builds, ("qwen2_vl",)),
    ModelFamily("smolvlm", SmolVLMAdapter, SmolVLMForConditionalGeneration, smolvlm_builds, ("idefics3",)),
    ModelFamily("qwen3_vl", Qwen3VLAdapter, Qwen3VLForConditionalGeneration, qwen3_vl_builds),
    ModelFamily(
        "llava_onevision", LlavaOnevisionAdapter, LlavaOnevisionForConditionalGeneration, llava_onevision_builds
    ),
    ModelFamily("internvl", InternVLAdapter, InternVLForConditionalGeneration, internvl_builds),
)

#: config.model_type -> the adapter class that drives it
ADAPTER_BY_MODEL_TYPE: dict[str, type[ModelAdapter]] = {
    model_type: family.adapter for family in FAMILIES for model_type in (family.name, *family.model_types)
}


def family_named(name: str) -> ModelFamily:
    """The FAMILIES entry called `name` (a `TinySpec.family` / `ShapeSpec.family`)."""
    for family in FAMILIES:
        if family.name == name:
            return family
    raise ValueError(f"unknown family {name!r}; known: {', '.join(f.name for f in FAMILIES)}")


@dataclass(frozen=True)
class ModelChoice:
    name: str
    offline: bool
    note: str


DEMO_MODEL = "visualkv-demo"  # the bundled trained checkpoint (assets/visualkv-demo)
FALLBACK_MODEL = "tiny-qwen2.5-vl"  # built in code: always there
#: what a shape model is good for, said beside every shape alias
SHAPE_NOTE = "memory and speed only: random weights, answers are noise"


def tiny_specs() -> dict[str, TinySpec]:
    """Every family's tiny and bench aliases (tiny-* first), in the order of `FAMILIES`."""
    specs = [(alias, spec) for family in FAMILIES for alias, spec in family.builds.TINY_SPECS.items()]
    return dict(sorted(specs, key=lambda item: item[0].startswith("bench-")))


def shape_specs() -> dict[str, ShapeSpec]:
    """Every family's shape aliases (released configurations, random weights), in the order of `FAMILIES`."""
    return {alias: spec for family in FAMILIES for alias, spec in family.builds.SHAPE_SPECS.items()}


OFFLINE_MODELS = (
    ModelChoice(DEMO_MODEL, True, "trained offline on synthetic needle scenes (bundled in assets/)"),
    *(ModelChoice(alias, True, spec.note) for alias, spec in tiny_specs().items()),
    # built on the target device (visualkv/models/synthetic/shapes.py)
    *(ModelChoice(alias, True, f"{spec.label} shape; {SHAPE_NOTE}") for alias, spec in shape_specs().items()),
)
# Bundled checkpoints: alias -> folder (loaded with AutoModelForImageTextToText / AutoProcessor).
BUNDLED_MODELS = {
    DEMO_MODEL: os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "assets", DEMO_MODEL
    ),
}
HUB_MODELS = (
    ModelChoice("Qwen/Qwen2.5-VL-3B-Instruct", False, "needs the Hub or a local copy"),
    ModelChoice("Qwen/Qwen2.5-VL-7B-Instruct", False, "needs the Hub or a local copy"),
    ModelChoice("Qwen/Qwen3-VL-8B-Instruct", False, "needs the Hub or a local copy"),
    ModelChoice("OpenGVLab/InternVL3_5-8B-HF", False, "needs the Hub or a local copy"),
    ModelChoice("llava-hf/llava-onevision-qwen2-7b-ov-hf", False, "needs the Hub or a local copy"),
    ModelChoice("HuggingFaceTB/SmolVLM2-500M-Video-Instruct", False, "needs the Hub or a local copy"),
    ModelChoice("HuggingFaceTB/SmolVLM2-2.2B-Instruct", False, "needs the Hub or a local copy"),
)


def default_offline_model_name() -> str:
    """The bundled demo model when its checkpoint is present, else the tiny random-weight Qwen2.5-VL."""
    present = os.path.isfile(os.path.join(BUNDLED_MODELS[DEMO_MODEL], "config.json"))
    return DEMO_MODEL if present else FALLBACK_MODEL


def offline_aliases() -> list[str]:
    from visualkv.models.synthetic.shapes import SHAPE_SPECS
    from visualkv.models.synthetic.tiny import TINY_SPECS  # tests may add aliases to it

    return list(TINY_SPECS) + list(SHAPE_SPECS)


def load_model(
    name: str, device: str = "cpu", dtype: str = "auto", seed: int = 0, attn_implementation: str = "sdpa"
) -> ModelAdapter:
    """Load an adapter for `name`: an offline alias, a local folder or a Hub id.

    device: "cpu", "cuda", "auto" (device_map="auto", sharded over GPUs).
    dtype: "auto" (bfloat16 on CUDA, float32 on CPU), "float32", "bfloat16", "float16".
    Raises ModelLoadError with one line on any failure.
    """
    check_device(device)
    torch_dtype = _dtype(dtype, device)
    if name.startswith("shape-"):  # released configuration, random weights, built where it runs
        from visualkv.models.synthetic.shapes import build_shape

        return _adapter(*build_shape(name, *shape_placement(device, dtype), seed=seed), name)
    if name in BUNDLED_MODELS:  # a checkpoint shipped in the repo: load it like any local folder
        return _adapter(*_load_pretrained(BUNDLED_MODELS[name], device, torch_dtype, attn_implementation), name)
    if name in offline_aliases():
        from visualkv.models.synthetic.tiny import build_tiny

        model, processor = build_tiny(name, seed=seed, dtype=torch_dtype)
        if device == "auto" and torch.cuda.is_available():
            model = model.to("cuda")  # one small model: "auto" means the GPU when there is one
        elif device not in ("cpu", "auto"):
            model = model.to(device)
        return _adapter(model, processor, name)
    return _adapter(*_load_pretrained(name, device, torch_dtype, attn_implementation), name)


def shape_placement(device: str, dtype: str) -> tuple[str, torch.dtype]:
    """Where and in what dtype a shape model is built: "auto" is the GPU when there is one, and the dtype is the
    released one (bfloat16) unless asked otherwise, also on CPU."""
    target = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    return target, torch.bfloat16 if dtype == "auto" else _dtype(dtype, target)


def check_device(device: str) -> None:
    """Raise ModelLoadError (one line) when `device` names a GPU that PyTorch cannot see.

    Without this a CPU-only machine fails deep inside the first `.to("cuda")` with a driver message.
    """
    if not device.startswith("cuda"):
        return
    if not torch.cuda.is_available():
        build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ModelLoadError(
            f"device {device!r} asked for, but PyTorch sees no CUDA GPU (torch {torch.__version__}, {build}); "
            "use device cpu or auto, or run where a GPU and its driver are visible"
        )
    index = torch.device(device).index
    if index is not None and index >= torch.cuda.device_count():
        raise ModelLoadError(
            f"device {device!r} asked for, but PyTorch sees {torch.cuda.device_count()} GPU(s) "
            f"(cuda:0 to cuda:{torch.cuda.device_count() - 1}); pick one of those or cuda"
        )


def _load_pretrained(name: str, device: str, dtype: torch.dtype, attn: str):
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one-line CLI output; the app shows its own progress

    local = os.path.expanduser(name)  # "~/models/x" is a folder too
    is_local = os.path.isdir(local)
    if not is_local and os.path.exists(local):
        raise ModelLoadError(
            f"model path {name!r} is a file, not a model folder; give the folder that holds its config.json"
        )
    if not is_local and (name.startswith((".", "/", "~")) or os.sep in name.strip("/").replace("/", "", 1)):
        where = "" if os.path.isabs(local) else f" (a relative path is read from {os.getcwd()})"
        raise ModelLoadError(f"model path {name!r} does not exist{where}")
    name = local if is_local else name
    # a Hub id with the Hub unreachable: the local cache only, at once (no half minute of retries)
    cached_only = not is_local and not hub_reachable()
    common = {"trust_remote_code": False, "local_files_only": cached_only}
    try:
        config = AutoConfig.from_pretrained(name, **common)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types here
        if is_local:
            hint = ""
        elif cached_only:
            hint = "; it is not an offline alias, not in the local Hugging Face cache, and the Hub cannot be reached"
        else:
            hint = "; it is not an offline alias (check the id on the Hub)"
        raise ModelLoadError(f"cannot load model {name!r}: {_first_line(exc)}{hint}") from None
    if config.model_type not in ADAPTER_BY_MODEL_TYPE:
        raise ModelLoadError(
            f"model {name!r} is a {config.model_type!r}; supported families: {', '.join(sorted(ADAPTER_BY_MODEL_TYPE))}"
        )
    try:
        processor = AutoProcessor.from_pretrained(name, **common)
        kwargs = {"dtype": dtype, "attn_implementation": attn, **common}
        if device != "cpu":  # "auto" shards over the GPUs; "cuda[:N]" reads the weights straight onto that GPU
            kwargs["device_map"] = device
        model = AutoModelForImageTextToText.from_pretrained(name, **kwargs)
    except Exception as exc:  # noqa: BLE001
        raise ModelLoadError(f"cannot load model {name!r}: {_first_line(exc)}") from None
    return model, processor


def _adapter(model, processor, name: str) -> ModelAdapter:
    family = model.config.model_type
    if family not in ADAPTER_BY_MODEL_TYPE:
        raise ModelLoadError(f"unsupported model family {family!r}")
    adapter = ADAPTER_BY_MODEL_TYPE[family](model, processor, name)
    refuse_unsupported_attention(family, list(adapter.layers), adapter.text_config)
    return adapter


def _dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device in ("cuda", "auto") and torch.cuda.is_available() else torch.float32
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    except KeyError:
        raise ModelLoadError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200].rstrip(".") if text else type(exc).__name__  # callers append "; …"
