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
from dataclasses import dataclass
from typing import Any

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


#: tensor operations that read a value back to the host: a synchronisation when the tensor is on a GPU
DEVICE_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.nonzero,
    torch.nonzero,
    torch.argwhere,
    torch.Tensor.unique,
    torch.unique,
    torch.unique_consecutive,
    torch.masked_select,
    torch.Tensor.masked_select,
    # data-dependent results: their size or value is known only after reading the input
    torch.bincount,
    torch.Tensor.bincount,
    torch.equal,
    torch.Tensor.equal,
    torch.allclose,
    torch.Tensor.allclose,
}

_MOVES = {"to", "cuda"}  # `Tensor` methods that may copy between the host and a device


def _bool_index(func, args) -> bool:
    """t[mask] / t[mask] = v with a boolean tensor: the result's size is data-dependent (a read)."""
    if getattr(func, "__name__", "") not in ("__getitem__", "__setitem__") or len(args) < 2:
        return False
    items = args[1] if isinstance(args[1], tuple) else (args[1],)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _sized_repeat(func, args, kwargs) -> bool:
    """`repeat_interleave` with tensor repeats reads them to size its output unless `output_size` is given."""
    if func not in (torch.repeat_interleave, torch.Tensor.repeat_interleave):
        return True
    repeats = kwargs.get("repeats", args[1] if len(args) > 1 else args[0] if args else None)
    return not isinstance(repeats, torch.Tensor) or repeats.numel() == 1 or kwargs.get("output_size") is not None


def _blocking_move(func, args, kwargs) -> bool:
    """`.to(...)` / `.cuda()` between the host and a GPU without `non_blocking=True`: the copy waits for the
    stream (`visualkv.devices.to_device` pins and copies without waiting). A move within a device is none."""
    name = getattr(func, "__name__", "")
    if name not in _MOVES or not args or not isinstance(args[0], torch.Tensor) or kwargs.get("non_blocking"):
        return False
    target = kwargs.get("device")
    rest = args[1:]
    if target is None and rest and isinstance(rest[0], torch.Tensor):
        target = rest[0].device
    elif target is None and rest and isinstance(rest[0], (str, torch.device, int)) and not isinstance(rest[0], bool):
        target = rest[0]
    if target is None:
        target = "cuda" if name == "cuda" else None
    if target is None:
        return False  # a dtype change only
    kinds = {args[0].device.type, torch.device(target).type if not isinstance(target, int) else "cuda"}
    return len(kinds) == 2 and "cpu" in kinds


def host_read(func, args, kwargs) -> str | None:
    """The name of the host read (a GPU synchronisation) `func(*args, **kwargs)` makes, or None."""
    name = getattr(func, "__name__", str(func))
    if func in DEVICE_READS:
        return name
    if _bool_index(func, args):
        return f"{name}[bool mask]"
    if not _sized_repeat(func, args, kwargs or {}):
        return "repeat_interleave without output_size"
    if _blocking_move(func, args, kwargs or {}):
        return f"{name} (blocking copy)"
    return None


class DeviceReads(TorchFunctionMode):
    """Counts every operation that reads tensor values on the host (`DEVICE_READS`, boolean-mask indexing), under
    the part `ops` (an `OpCounter`) is counting when it runs. On a CPU every tensor is a host tensor: a read
    is a synchronisation only where the tensor would live on the GPU (the tower's and the layers' tensors do)."""

    def __init__(self, ops: OpCounter) -> None:
        super().__init__()
        self.ops = ops
        self.by_part: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if host_read(func, args, kwargs) is not None:
            self.by_part[self.ops._parts[-1]] += 1
        return func(*args, **(kwargs or {}))


@dataclass
class BlockCount:
    """What one prefill block dispatched: the vision tower on its media, the rest of its embeddings, and the layer
    loop (decoder layers with the method's scoring and eviction). kernels: launches on a GPU (`OpCounter`);
    reads: host reads of tensor values (`DeviceReads`) inside the tower and from the first decoder layer on, where
    the tensors live on the model's device (a GPU sync each). plan_reads: those of the block's host-side plan
    before the first layer (`BlockPlan`, on host tensors: no sync)."""

    tokens: int
    visual_tokens: int
    vision_kernels: int
    vision_attention_calls: int
    vision_reads: int
    embedding_kernels: int
    layer_kernels: int
    layer_reads: int
    plan_reads: int


@contextmanager
def counting_blocks(engine: Any) -> Iterator[list[BlockCount]]:
    """Within the block, every prefill block `engine` runs (its `block_embeddings`, then its `run_layers`) appends
    a `BlockCount` to the list yielded. Other layer passes (a text pass, a follow-up's extend) are not counted.
    The wrappers live on the engine instance for the block only; the model is not touched (the tower is
    watched through forward hooks, removed on leaving)."""
    counts: list[BlockCount] = []
    ops = OpCounter()
    reads = DeviceReads(ops)
    pending: dict[str, int] = {}
    embeddings, run_layers = engine.block_embeddings, engine.run_layers

    def snapshot() -> dict[str, int]:
        return {
            "kernels": ops.kernels,
            "vision": ops.kernels_by_part["vision"],
            "attention": ops.attention,
            "reads": sum(reads.by_part.values()),
            "vision_reads": reads.by_part["vision"],
        }

    def counted_embeddings(prepared, block, *args, **kwargs):
        before = snapshot()
        out = embeddings(prepared, block, *args, **kwargs)
        after = snapshot()
        pending.clear()
        pending.update(
            {k: after[k] - before[k] for k in after}, visual=int(prepared.visual_mask[block.start : block.end].sum())
        )
        return out

    def counted_layers(hidden, *args, **kwargs):
        if not pending:  # not a prefill block's layers
            return run_layers(hidden, *args, **kwargs)
        before = snapshot()
        first_layer: dict[str, int] = {}
        hook = engine.adapter.layers[0].register_forward_pre_hook(lambda *_: first_layer.update(snapshot()))
        try:
            out = run_layers(hidden, *args, **kwargs)
        finally:
            hook.remove()
        after = snapshot()
        counts.append(
            BlockCount(
                tokens=int(hidden.shape[1]),
                visual_tokens=pending["visual"],
                vision_kernels=pending["vision"],
                vision_attention_calls=pending["attention"],
                vision_reads=pending["vision_reads"],
                embedding_kernels=pending["kernels"] - pending["vision"],
                layer_kernels=after["kernels"] - before["kernels"],
                layer_reads=after["reads"] - first_layer["reads"],
                plan_reads=first_layer["reads"] - before["reads"],
            )
        )
        pending.clear()
        return out

    tower = getattr(engine.adapter, "visual", None)
    engine.block_embeddings, engine.run_layers = counted_embeddings, counted_layers
    try:
        with ops.count_inside([tower] if tower is not None else [], "vision"), reads, ops:
            yield counts
    finally:
        del engine.block_embeddings, engine.run_layers  # the class's methods again
