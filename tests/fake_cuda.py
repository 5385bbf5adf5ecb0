"""A pretend CUDA device on a CPU-only machine, to catch device mix-ups without a GPU.

`fake_cuda()` is a context manager (a `TorchFunctionMode`) under which:

- tensors created with `device="cuda"` (or moved with `.to("cuda")` / `.cuda()`) are really CPU tensors of
  the subclass `FakeCudaTensor`, whose `.device` answers `cuda:0`; `.cpu()` / `.to("cpu")` (or a non-blocking `copy_` into
  a host tensor) turn them back into plain CPU tensors, and everything computed from them stays "on CUDA";
- an operation that mixes a "CUDA" tensor with a CPU tensor of one or more dimensions raises, as PyTorch
  does on a real GPU ("Expected all tensors to be on the same device"). PyTorch's own exceptions are
  mirrored: 0-dim CPU tensors mix freely, CPU index tensors may index a CUDA tensor (but not the reverse),
  and `torch.Generator` / `torch.multinomial` must share the probabilities' device; `.numpy()` (and
  `np.asarray`) of a "CUDA" tensor raises PyTorch's TypeError;
- `torch.cuda.synchronize` / `is_available` / memory counters answer as a GPU machine would;
- threads started inside it (the app runs each turn in a worker thread) run under the same rules.

So a model moved "to CUDA" runs the real engine on CPU numbers, and every tensor that a step creates on the
host without saying so, or forgets to move, fails the run the way it would on a GPU. Not covered: kernels
that only exist on CUDA (flash attention) and real CUDA memory figures (the counters report 0).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

CUDA = torch.device("cuda", 0)
_REAL_GENERATOR = torch.Generator  # `fake_cuda()` patches torch.Generator


class FakeCudaTensor(torch.Tensor):
    """A CPU tensor that says it lives on cuda:0 (see the module docstring)."""


def _is_cuda(device) -> bool:
    if device is None:
        return False
    if isinstance(device, int):  # torch accepts an ordinal for cuda
        return True
    return torch.device(device).type == "cuda"


def _non_blocking(args, kwargs) -> bool:
    return bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False))


def _fake(t):
    if isinstance(t, torch.Tensor) and not isinstance(t, FakeCudaTensor):
        return t.as_subclass(FakeCudaTensor)
    return t


def _plain(t):
    if isinstance(t, FakeCudaTensor):
        return t.as_subclass(torch.Tensor)
    return t


# Generators made with device="cuda" are real CPU generators (torch's argument parser accepts nothing else),
# remembered here by id (kept alive, so ids are not reused).
_CUDA_GENERATORS: dict[int, torch.Generator] = {}


_TO_NAMES = {"to", "cuda", "cpu", "type_as", "new_tensor"}
# functions that only read metadata (no computation mixing devices)
_METADATA_ONLY = {"_has_compatible_shallow_copy_type", "__repr__", "__format__", "is_same_size", "__len__"}


class _Mode(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.mixes: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", str(func))
        owner = getattr(func, "__self__", None)  # property getters arrive as a fresh method-wrapper each time
        if owner is torch.Tensor.device:
            return CUDA if isinstance(args[0], FakeCudaTensor) else func(*args)
        if owner is torch.Tensor.is_cuda:
            return isinstance(args[0], FakeCudaTensor)
        if name in _TO_NAMES and args and isinstance(args[0], torch.Tensor):
            return self._move(func, name, args, kwargs)
        if name in ("numpy", "__array__") and args and isinstance(args[0], FakeCudaTensor):
            # PyTorch's own refusal: a CUDA tensor's memory is not host memory (np.asarray goes through __array__)
            raise TypeError(
                "can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
                "to host memory first."
            )
        if name == "pin_memory" and args and isinstance(args[0], torch.Tensor):
            return args[0]  # page-locked host memory needs a driver; the tensor stays a host tensor either way
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False  # likewise for a factory asked for page-locked memory
        to_cuda = _is_cuda(kwargs.get("device"))
        if "device" in kwargs and to_cuda:
            kwargs["device"] = "cpu"
        if "generator" in kwargs and isinstance(kwargs["generator"], _REAL_GENERATOR):
            kwargs["generator"] = self._generator(kwargs["generator"], args, name)
        self._check_mix(func, name, args, kwargs)
        out = func(*args, **kwargs)
        if to_cuda:
            out = tree_map(_fake, out)
        return out

    # -- moves --------------------------------------------------------------------------------
    def _move(self, func, name, args, kwargs):
        src = args[0]
        if name == "cpu":
            return _plain(func(*args, **kwargs))
        if name == "cuda":
            return _fake(func(_plain(src), *args[1:], **kwargs))
        if name == "type_as":
            out = func(_plain(src), _plain(args[1]))
            return _fake(out) if isinstance(args[1], FakeCudaTensor) else out
        if name == "new_tensor":
            out = func(*args, **kwargs)
            return _fake(out) if isinstance(src, FakeCudaTensor) else _plain(out)
        # Tensor.to(device?, dtype?, ...) / to(other) / to(dtype)
        rest = list(args[1:])
        target = None
        if "device" in kwargs:
            target, kwargs["device"] = kwargs["device"], None
        if rest and isinstance(rest[0], (str, torch.device, int)) and not isinstance(rest[0], bool):
            target, rest[0] = rest[0], None
        elif rest and isinstance(rest[0], torch.Tensor):
            other = rest[0]
            target = CUDA if isinstance(other, FakeCudaTensor) else other.device
            rest[0] = other.dtype
        out = func(_plain(src), *rest, **kwargs)
        if target is None:
            return _fake(out) if isinstance(src, FakeCudaTensor) else out
        return _fake(out) if _is_cuda(target) else _plain(out)

    def _generator(self, gen, args, name):
        data = next((a for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor)), None)
        gen_cuda = id(gen) in _CUDA_GENERATORS
        if data is not None and gen_cuda != isinstance(data, FakeCudaTensor):
            self._fail(
                name,
                f"generator on {'cuda' if gen_cuda else 'cpu'} but tensor on "
                f"{'cuda' if isinstance(data, FakeCudaTensor) else 'cpu'}",
            )
        return gen

    # -- mixing rules ---------------------------------------------------------------------------
    def _check_mix(self, func, name, args, kwargs):
        if name in _METADATA_ONLY:
            return
        if name == "copy_" and not isinstance(args[0], FakeCudaTensor) and _non_blocking(args, kwargs):
            return  # an asynchronous copy into a host tensor: a move to the host (a blocking one would sync)
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        if not any(isinstance(t, FakeCudaTensor) for t in tensors):
            return
        if name in ("__getitem__", "__setitem__", "index_put_", "index_put"):
            # self may be CUDA and its indices CPU; a CUDA index into a CPU tensor fails (as on a GPU)
            self_t = args[0]
            if not isinstance(self_t, FakeCudaTensor):
                idx = [t for t in tree_flatten(args[1])[0] if isinstance(t, torch.Tensor) and t.dim() > 0]
                if any(isinstance(t, FakeCudaTensor) for t in idx):
                    self._fail(name, "indices should be either on cpu or on the same device as the indexed tensor")
            else:
                # the value written by __setitem__ must be on the tensor's device unless it is 0-dim
                if name == "__setitem__" and len(args) > 2 and isinstance(args[2], torch.Tensor):
                    v = args[2]
                    if v.dim() > 0 and not isinstance(v, FakeCudaTensor):
                        self._fail(name, "value on cpu written into a cuda tensor")
            return
        cpu = [t for t in tensors if not isinstance(t, FakeCudaTensor) and t.dim() > 0]
        if cpu:
            self._fail(name, f"a cpu tensor of shape {tuple(cpu[0].shape)} mixed with cuda tensors")

    def _fail(self, name, why):
        msg = f"Expected all tensors to be on the same device (fake_cuda, {name}): {why}"
        self.mixes.append(msg)
        raise RuntimeError(msg)


@contextlib.contextmanager
def fake_cuda() -> Iterator[_Mode]:
    """Run the body as if a CUDA GPU were present (see the module docstring)."""
    mode = _Mode()

    def generator(device="cpu"):
        if not _is_cuda(device):
            return _REAL_GENERATOR(device)
        gen = _REAL_GENERATOR()
        _CUDA_GENERATORS[id(gen)] = gen
        return gen

    thread_run = threading.Thread.run

    def run_in_mode(thread: threading.Thread) -> None:
        with mode:  # torch function modes are per thread: a worker (the app's turn thread) joins this one
            thread_run(thread)

    patches = [
        mock.patch.object(threading.Thread, "run", run_in_mode),
        mock.patch.object(torch, "Generator", generator),
        mock.patch.object(torch.cuda, "is_available", lambda: True),
        mock.patch.object(torch.cuda, "synchronize", lambda device=None: None),
        mock.patch.object(torch.cuda, "memory_allocated", lambda device=None: 0),
        mock.patch.object(torch.cuda, "max_memory_allocated", lambda device=None: 0),
        mock.patch.object(torch.cuda, "reset_peak_memory_stats", lambda device=None: None),
        mock.patch.object(torch.cuda, "device_count", lambda: 1),
    ]
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        stack.enter_context(mode)
        yield mode


def to_fake_cuda(model: torch.nn.Module) -> torch.nn.Module:
    """Move a model's parameters and buffers "to CUDA" (call inside `fake_cuda()`).

    Parameters are replaced (not given new `.data`), so they keep the `FakeCudaTensor` class.
    """
    before = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        return model.to("cuda")
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(before)


_ADAPTERS: dict = {}


def fake_cuda_adapter(alias: str):
    """An adapter of `alias` of its own (conftest's shared ones stay on the CPU), loaded and moved to the pretend GPU
    once per test process and shared by the modules that ask for it."""
    from visualkv.models.registry import load_model

    if alias not in _ADAPTERS:
        adapter = load_model(alias)
        with fake_cuda():
            to_fake_cuda(adapter.model)
        _ADAPTERS[alias] = adapter
    return _ADAPTERS[alias]
