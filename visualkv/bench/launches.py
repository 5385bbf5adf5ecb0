"""Counting what a piece of PyTorch code dispatches, as a CPU-side measure of GPU launch overhead.

On a GPU each dispatched ATen operation is (about) one kernel launch, and a host read of a tensor value
(`tolist`, `item`, `int()`) is a synchronisation. Both can be counted on a CPU, where no GPU is at hand, and
depend on the model's structure and the input, not on its widths: scripts/vision_launches.py and
scripts/prefill_launches.py count them on released configurations with widths scaled down.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

#: operations that only make a new view of existing memory: dispatched (host time) but no kernel on a GPU
_NO_KERNEL = {torch.ops.aten._unsafe_view.default}
#: operations that allocate without touching the memory (no traffic)
_NO_TRAFFIC = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default}
#: operations whose first argument is only written (its bytes count once, as their output; so does an `out=`)
_WRITE_ONLY_TARGET = {torch.ops.aten.copy_.default}


class OpCounter(TorchDispatchMode):
    """Counts dispatched ATen operations (each costs host time), those of them that launch a kernel on
    a GPU (everything but views: `view`, `slice`, `transpose`, `expand`, ...) and attention calls.

    `bytes_moved`: what the kernel-launching operations read and write, counted as the bytes of their tensor
    inputs and outputs (a broadcast dimension counted once): the memory traffic of a memory-bound GPU step,
    as far as each operation touches its operands once (a matmul's inputs are re-read from cache, not memory)
    and casts an operand of another dtype as it reads it (CUDA kernels do; a CPU makes a temporary copy).

    `kernels_by_part`: the kernel launches inside the modules named with `count_inside` (e.g. the vision
    tower, the decoder layers), the rest under "rest".
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.kernels = 0
        self.attention = 0
        self.bytes_moved = 0
        self.kernels_by_part: Counter[str] = Counter()
        self._parts = ["rest"]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        kernel = not (getattr(func, "is_view", False) or func in _NO_KERNEL)
        if kernel:
            self.kernels += 1
            self.kernels_by_part[self._parts[-1]] += 1
        if "scaled_dot_product" in str(func):
            self.attention += 1
        out = func(*args, **(kwargs or {}))
        if kernel and func not in _NO_TRAFFIC:
            read = args[1:] if func in _WRITE_ONLY_TARGET else args
            read_kwargs = {k: v for k, v in (kwargs or {}).items() if k != "out"}  # `out` is written: it is returned
            self.bytes_moved += sum(_extent_bytes(t) for t in tree_leaves((read, read_kwargs, out)))
        return out

    @contextmanager
    def count_inside(self, modules: Iterable[torch.nn.Module], part: str) -> Iterator[None]:
        """Within the block, kernels launched inside any of `modules`' forward count under `part`."""

        def enter(*_) -> None:  # hooks return None: a forward hook's return value would replace the output
            self._parts.append(part)

        def leave(*_) -> None:
            self._parts.pop()

        handles = []
        for module in modules:
            handles.append(module.register_forward_pre_hook(enter))
            handles.append(module.register_forward_hook(leave))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


def _extent_bytes(t) -> int:
    """Bytes a tensor's elements span in memory, a broadcast (stride 0) dimension counted once; 0 for non-tensors."""
    if not isinstance(t, torch.Tensor):
        return 0
    elements = 1
    for size, stride in zip(t.shape, t.stride(), strict=True):
        elements *= size if stride else 1
    return elements * t.element_size()


class HostReads(TorchFunctionMode):
    """Counts reads of tensor values on the host (`tolist`, `item`, `int()`...): each a sync on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0
        self.kinds = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__int__, torch.Tensor.__index__}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.reads += func in self.kinds
        return func(*args, **(kwargs or {}))
