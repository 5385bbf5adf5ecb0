"""Shape models: the released configurations of real checkpoints with random weights, built offline.

Memory and speed only: random weights, answers are noise. A shape model has the released checkpoint's layers,
widths, heads, vocabulary and vision tower, and its processor the released pixel / tile settings, so its KV
cache, activations, tower cost and weight memory are the real model's, without a download. The tokenizer is
the tiny models' offline BPE (its ids fit the large vocabulary; the released configs' token ids are replaced
by its own). The model is built on the target device in the target dtype; a build whose weights would not
fit is refused with one line. Each family's shapes, with their sources, are in its
`visualkv.models.synthetic.<family>` module.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import psutil
import torch
from transformers import PretrainedConfig, PreTrainedModel, ProcessorMixin

from visualkv.errors import ModelLoadError
from visualkv.models import compat
from visualkv.models.registry import ModelFamily, family_named, shape_specs
from visualkv.models.synthetic.specs import ShapeSpec

#: every shape alias of every family
SHAPE_SPECS: dict[str, ShapeSpec] = shape_specs()


def shape_spec(alias: str) -> ShapeSpec:
    try:
        return SHAPE_SPECS[alias]
    except KeyError:
        raise ModelLoadError(f"unknown shape alias {alias!r}; known: {', '.join(SHAPE_SPECS)}") from None


def _family(alias: str) -> tuple[ShapeSpec, ModelFamily]:
    spec = shape_spec(alias)
    return spec, family_named(spec.family)


def build_shape_processor(alias: str) -> ProcessorMixin:
    """The family's processor class with the released pixel / tile settings and the offline tokenizer."""
    spec, family = _family(alias)
    return family.builds.shape_processor(spec)


def build_shape_config(alias: str, processor: ProcessorMixin, num_layers: int | None = None) -> PretrainedConfig:
    """The released configuration; `num_layers` (scaled-down tests) sets both the LLM's and the vision tower's
    depth (full attention then in the vision tower's last block), every width stays as released."""
    spec, family = _family(alias)
    return family.builds.shape_config(spec, processor, num_layers)


def _model_class(spec: ShapeSpec) -> type[PreTrainedModel]:
    return family_named(spec.family).model_class


@cache
def parameter_count(alias: str, num_layers: int | None = None) -> int:
    """Parameters of the shape, counted on the meta device (nothing allocated); cached, as the CLI's fit check
    and the build both ask."""
    spec = shape_spec(alias)
    processor = build_shape_processor(alias)
    with torch.device("meta"):
        model = compat.model_from_config(_model_class(spec), build_shape_config(alias, processor, num_layers))
    return sum(p.numel() for p in model.parameters())


#: torch's random initialisers, which module constructors (Linear, Embedding, Conv) call on their new weights
_TORCH_RANDOM_INITS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "xavier_uniform_",
    "xavier_normal_",
)


@contextmanager
def _constructors_fill_nan() -> Iterator[None]:
    """Module constructors fill their weights with NaN instead of drawing them at random.

    transformers' `init_weights`, run once the model is constructed, draws every weight of a shape model again
    (with its own references to torch's initialisers), so the constructors' draws were half of a CPU build's
    time for nothing. NaN, not uninitialised memory: a weight the model's init ever missed shows at once.
    """
    import torch.nn.init as torch_init

    def fill_nan(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        with torch.no_grad():
            return tensor.fill_(float("nan"))

    originals = {name: getattr(torch_init, name) for name in _TORCH_RANDOM_INITS}
    try:
        for name in originals:
            setattr(torch_init, name, fill_nan)
        yield
    finally:
        for name, function in originals.items():
            setattr(torch_init, name, function)


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
        with _constructors_fill_nan():
            model = compat.model_from_config(_model_class(spec), config, dtype=dtype)
    model = model.eval()
    model.config.dtype = dtype
    model.config.name_or_path = f"{alias} ({spec.hub_id} configuration, random weights)"
    gen = model.generation_config
    gen.bos_token_id, gen.eos_token_id, gen.pad_token_id = family_named(spec.family).builds.generation_ids(
        processor.tokenizer
    )
    gen.do_sample = False
    return model, processor
