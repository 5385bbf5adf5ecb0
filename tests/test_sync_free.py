"""No host synchronisation inside the layer loop of a prefill block or a decode step.

On a GPU, reading a device value on the host (`.item()`, `int(t)`, `bool(t)`, `.tolist()`, `.cpu()`,
`nonzero()`, `unique()`, boolean-mask indexing, `torch.cuda.synchronize`) stalls the launch queue. The
engine prepares everything host-side once per block (`BlockPlan`), so from the first decoder layer to
the end of `run_layers` none of these may run, on any tensor. A `TorchFunctionMode` sees every tensor
operation, so this is checkable on CPU for every method.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tests.conftest import get_adapter
from visualkv.bench.launches import DEVICE_READS
from visualkv.bench.synthetic import image_media, video_media
from visualkv.runtime.engine import Engine
from visualkv.runtime.session import ChatSession, SessionConfig

_READS_DEVICE = DEVICE_READS  # the operations that read a device value back to the host


def _bool_index(args) -> bool:
    """t[mask] / t[mask] = v with a boolean tensor: the result size is data-dependent (a sync)."""
    idx = args[1] if len(args) > 1 else None
    items = idx if isinstance(idx, tuple) else (idx,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class SyncGuard(TorchFunctionMode):
    """Records every device-reading tensor operation while armed."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.hits: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.armed:
            name = getattr(func, "__name__", str(func))
            if func in _READS_DEVICE:
                self.hits.append(name)
            elif name in ("__getitem__", "__setitem__") and _bool_index(args):
                self.hits.append(f"{name}[bool mask]")
        return func(*args, **(kwargs or {}))


@pytest.fixture
def guard(monkeypatch):
    """Arms a SyncGuard from the first decoder layer of every `run_layers` call to its return."""
    g = SyncGuard()
    original = Engine.run_layers

    def run_layers(self, *args, **kwargs):
        handle = self.adapter.layers[0].register_forward_pre_hook(lambda *_: setattr(g, "armed", True))
        try:
            return original(self, *args, **kwargs)
        finally:
            g.armed = False
            handle.remove()

    monkeypatch.setattr(Engine, "run_layers", run_layers)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: g.hits.append("cuda.synchronize"))
    with g:
        yield g


CASES = [
    ("full", None, None),
    ("full", None, "blockwise"),
    ("blockwise-keydiff", 24, "blockwise"),
    ("blockwise-snapkv", 24, "hybrid"),
    ("post-snapkv", 24, None),
    ("salicache", None, None),
    ("salicache", None, "blockwise"),
    # composed: packed tiers scored and evicted too (counts are host ints)
    ("blockwise-keydiff+salicache", 24, "blockwise"),
    ("blockwise-snapkv+salicache", 24, None),
    ("lightkv", None, None),
    ("lightkv", None, "blockwise"),
    ("blockwise-snapkv+lightkv", 24, "blockwise"),
]


@pytest.mark.parametrize("family", ["tiny-qwen2.5-vl", "tiny-smolvlm2"])
@pytest.mark.parametrize(("method", "budget", "prefill"), CASES)
def test_no_host_sync_in_layer_loop(guard, family, method, budget, prefill):
    adapter = get_adapter(family)
    media = (
        video_media(4, 224, 168, fps=1.0, seed=3) if "salicache" in method.split("+") else image_media(448, 336, seed=1)
    )
    session = ChatSession(
        adapter, SessionConfig(method=method, budget=budget, prefill=prefill, block_size=48, max_new_tokens=3)
    )
    session.ask("What is in the picture?", media)  # prefill blocks + decode steps
    session.ask("And the colours?")  # a follow-up turn: text extend + decode steps
    assert guard.hits == [], f"{method}/{prefill}: host syncs in the layer loop: {sorted(set(guard.hits))}"


@pytest.mark.parametrize("family", ["tiny-qwen2.5-vl", "tiny-smolvlm2"])
def test_lightkv_after_salicache_reads_once_per_merge(guard, family):
    """Merging mixes precision tiers, so how many entries of each tier survive is data-dependent: one read of
    those counts per merge stage and block (then the tier positions are selected on the device), nothing else."""
    session = ChatSession(
        get_adapter(family),
        SessionConfig(method="lightkv+salicache", prefill="blockwise", block_size=48, max_new_tokens=3),
    )
    session.ask("What is in the picture?", video_media(4, 224, 168, fps=1.0, seed=3))
    session.ask("And the colours?")
    stages = session.report()["lightkv"]["stages"]
    merged = sum(s["tokens_in"] - s["tokens_out"] for s in stages)
    n_blocks = sum(1 for b in session.blocks if b.visual_tokens_in > 1)
    assert merged > 0 and set(guard.hits) == {"tolist"}
    assert len(guard.hits) <= n_blocks * len(stages)


def test_guard_catches_a_sync(guard):
    """The guard itself: a `.item()` inside the layer loop is reported."""
    adapter = get_adapter("tiny-qwen2.5-vl")

    def read_back(module, inputs, output) -> None:
        (output[0] if isinstance(output, tuple) else output).sum().item()

    hook = adapter.layers[1].register_forward_hook(read_back)
    try:
        ChatSession(adapter, SessionConfig(max_new_tokens=1)).ask("Hi?")
    finally:
        hook.remove()
    assert "item" in guard.hits


@pytest.fixture
def four_layers():
    """4-layer variants of the tiny models (same classes), so three LightKV stages fit before the last layer."""
    import dataclasses

    from visualkv.models.registry import load_model
    from visualkv.models.synthetic import tiny

    names = {"tiny-qwen2.5-vl": "sync4-qwen2.5-vl", "tiny-smolvlm2": "sync4-smolvlm2"}
    for base, deep in names.items():
        tiny.TINY_SPECS[deep] = dataclasses.replace(tiny.TINY_SPECS[base], text_num_layers=4)
    try:
        yield {base: load_model(deep) for base, deep in names.items()}
    finally:
        for deep in names.values():
            tiny.TINY_SPECS.pop(deep, None)


def _blocks_with_cut_windows(session: ChatSession, coarse: int, fine: int) -> int:
    """Blocks in which some `coarse`-per-side window spans two `fine`-per-side windows (by each token's
    original row / col in its own tile or frame grid)."""
    layout = session.prepared.layout
    cut = 0
    for block in session.prefill_result.context.blocks:
        inside = (layout.seq_index >= block.start) & (layout.seq_index < block.end)
        parent: dict[tuple, tuple] = {}
        for v in inside.nonzero()[0]:
            f, r, c = int(layout.frame[v]), int(layout.row[v]), int(layout.col[v])
            rows, cols = layout.frames[f].grid
            key = (f, r * coarse // rows, c * coarse // cols)
            if parent.setdefault(key, (f, r * fine // rows, c * fine // cols)) != (
                f,
                r * fine // rows,
                c * fine // cols,
            ):
                cut += 1
                break
    return cut


@pytest.mark.parametrize("family", ["tiny-qwen2.5-vl", "tiny-smolvlm2"])
@pytest.mark.parametrize("prefill", [None, "blockwise"])
def test_lightkv_reads_once_per_stage_whose_windows_cut_the_previous_ones(guard, four_layers, family, prefill):
    """Nested windows (4 -> 2 -> 1): every count is known on the host, no read. Windows that cut the
    previous stage's (6 -> 4 on a 12 x 16 Qwen grid; SmolVLM's 8 x 8 tiles nest even then): the survivors
    per window are data-dependent and read back, once per block, at that stage only."""
    adapter = four_layers[family]
    for windows in ((4, 2, 1), (6, 4, 2)):
        guard.hits.clear()
        options = {"layers": (0, 1, 2), "windows": windows}
        cfg = SessionConfig(method="lightkv", prefill=prefill, block_size=48, max_new_tokens=2, method_options=options)
        session = ChatSession(adapter, cfg)
        session.ask("What is in the picture?", image_media(448, 336, seed=1))
        stages = session.report()["lightkv"]["stages"]
        assert all(s["tokens_out"] < s["tokens_in"] for s in stages)  # every stage merged something
        expected = sum(_blocks_with_cut_windows(session, a, b) for a, b in itertools.pairwise(windows))
        assert guard.hits == ["tolist"] * expected
        if family == "tiny-qwen2.5-vl" and windows == (6, 4, 2):
            assert expected > 0  # the case is exercised
