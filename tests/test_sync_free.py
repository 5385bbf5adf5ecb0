"""No host synchronisation inside the layer loop of a prefill block or a decode step.

On a GPU, reading a device value on the host (`.item()`, `int(t)`, `bool(t)`, `.tolist()`, `.cpu()`,
`nonzero()`, `unique()`, boolean-mask indexing, data-dependent results such as `bincount`, `equal`, `allclose` or
`repeat_interleave` without `output_size`, a blocking `.to(device)` copy, `torch.cuda.synchronize`) stalls the
launch queue (`visualkv.bench.launches.host_read`). The
engine prepares everything host-side once per block (`BlockPlan`), so from the first decoder layer to
the end of `run_layers` none of these may run, on any tensor. A `TorchFunctionMode` sees every tensor
operation, so this is checkable on CPU for every method.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from tests.conftest import get_adapter
from visualkv.bench.launches import host_read
from visualkv.bench.synthetic import image_media, video_media
from visualkv.runtime.engine import Engine
from visualkv.runtime.session import ChatSession, SessionConfig


class SyncGuard(TorchFunctionMode):
    """Records every device-reading tensor operation (`host_read`) while armed. `device_only`: only those on a
    tensor that lives on a GPU (over the pretend GPU, where the host tables are told from the device's)."""

    def __init__(self, device_only: bool = False) -> None:
        super().__init__()
        self.armed = False
        self.device_only = device_only
        self.hits: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.armed:
            read = host_read(func, args, kwargs or {})
            if read is not None and (not self.device_only or "copy" in read or _on_device(args)):
                self.hits.append(read)
        return func(*args, **(kwargs or {}))


def _on_device(args) -> bool:
    tensors = [a for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor)]
    return any(t.device.type != "cpu" for t in tensors)


@pytest.fixture
def guard(monkeypatch):
    """Arms a SyncGuard from the first decoder layer of every `run_layers` call to its return."""
    g = _armed(monkeypatch)
    with g:
        yield g


@pytest.fixture
def gpu_guard(monkeypatch):
    """The guard over the pretend GPU (`tests/fake_cuda.py`): entered above it, so that it sees which tensors
    live on the device and which on the host, and a `torch.cuda.synchronize` is reported there too."""
    from tests.fake_cuda import fake_cuda

    with fake_cuda():
        g = _armed(monkeypatch, device_only=True)
        with g:
            yield g


def _armed(monkeypatch, device_only: bool = False) -> SyncGuard:
    g = SyncGuard(device_only)
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
    return g


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
    # rows dropped before the layers (EVS reads the device once per block there, never inside them)
    ("evs", None, None),
    ("blockwise-keydiff+evs", 24, "blockwise"),
]

#: methods whose work is on video: their cases run on a clip
ON_VIDEO = {"salicache", "evs"}


@pytest.mark.parametrize("family", ["tiny-qwen2.5-vl", "tiny-smolvlm2"])
@pytest.mark.parametrize(("method", "budget", "prefill"), CASES)
def test_no_host_sync_in_layer_loop(guard, family, method, budget, prefill):
    adapter = get_adapter(family)
    media = (
        video_media(4, 224, 168, fps=1.0, seed=3)
        if ON_VIDEO & set(method.split("+"))
        else image_media(448, 336, seed=1)
    )
    session = ChatSession(
        adapter, SessionConfig(method=method, budget=budget, prefill=prefill, block_size=48, max_new_tokens=3)
    )
    session.ask("What is in the picture?", media)  # prefill blocks + decode steps
    session.ask("And the colours?")  # a follow-up turn: text extend + decode steps
    assert guard.hits == [], f"{method}/{prefill}: host syncs in the layer loop: {sorted(set(guard.hits))}"


#: one case per way of running the layers: blocks, hybrid, a packed tier, LightKV's merges, a composition, rows
#: dropped before the layers
GPU_CASES = [CASES[1], CASES[3], CASES[6], CASES[7], CASES[10], CASES[-1]]


@pytest.mark.parametrize("family", ["tiny-qwen2.5-vl", "tiny-smolvlm2"])
@pytest.mark.parametrize(("method", "budget", "prefill"), GPU_CASES)
def test_no_blocking_copy_in_layer_loop_on_a_pretend_gpu(gpu_guard, family, method, budget, prefill):
    """On the pretend GPU (`tests/fake_cuda.py`) the host tensors are told from the device ones, so a copy
    between them that waits for the stream (`.to(device)` of a host tensor, not pinned and non-blocking) is
    seen too: none may run in the layer loop of a block or a decode step."""
    from tests.fake_cuda import fake_cuda_adapter

    adapter = fake_cuda_adapter(family)
    media = (
        video_media(4, 224, 168, fps=1.0, seed=3)
        if ON_VIDEO & set(method.split("+"))
        else image_media(448, 336, seed=1)
    )
    config = SessionConfig(method=method, budget=budget, prefill=prefill, block_size=48, max_new_tokens=3)
    session = ChatSession(adapter, config)
    session.ask("What is in the picture?", media)
    session.ask("And the colours?")
    assert gpu_guard.hits == [], f"{method}/{prefill}: host syncs in the layer loop: {sorted(set(gpu_guard.hits))}"


@pytest.mark.parametrize("family", ["tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-smolvlm2", "tiny-internvl3.5"])
def test_a_blocks_embedding_and_rotary_make_no_host_read_on_a_pretend_gpu(family, monkeypatch):
    """Around the layer loop, per block: the embeddings of its kept tokens, the kept visual rows written in
    (host-built indices) and the rotary tables (host positions, pinned copies). The vision tower's own code
    (transformers') is left out."""
    from tests.fake_cuda import fake_cuda, fake_cuda_adapter

    adapter = fake_cuda_adapter(family)
    guard = SyncGuard(device_only=True)

    def armed(run):
        def wrapper(*args, **kwargs):
            before, guard.armed = guard.armed, True
            try:
                return run(*args, **kwargs)
            finally:
                guard.armed = before

        return wrapper

    def disarmed(run):
        def wrapper(*args, **kwargs):
            before, guard.armed = guard.armed, False
            try:
                return run(*args, **kwargs)
            finally:
                guard.armed = before

        return wrapper

    monkeypatch.setattr(Engine, "block_embeddings", armed(Engine.block_embeddings))
    monkeypatch.setattr(Engine, "run_layers", armed(Engine.run_layers))
    monkeypatch.setattr(adapter, "encode_units_with_layer_features", disarmed(adapter.encode_units_with_layer_features))
    config = SessionConfig(method="blockwise-keydiff", budget=24, prefill="blockwise", block_size=48, max_new_tokens=2)
    try:
        with fake_cuda(), guard:
            ChatSession(adapter, config).ask("What is in the picture?", image_media(448, 336, seed=1))
    finally:
        monkeypatch.undo()  # the adapter is shared by the pretend-GPU tests
    assert guard.hits == [], f"{family}: host reads around the layer loop: {sorted(set(guard.hits))}"


@pytest.mark.parametrize(
    ("plant", "read"),
    [
        (lambda h: h.sum().item(), "item"),
        (lambda h: torch.bincount(h.flatten().argmax(-1, keepdim=True)), "bincount"),
        (lambda h: torch.equal(h, h), "equal"),
        (lambda h: h.allclose(h), "allclose"),
        (lambda h: h[h > 0], "__getitem__[bool mask]"),
        (lambda h: h.repeat_interleave(torch.ones_like(h[0, :, 0], dtype=torch.long), dim=1), "without output_size"),
        (lambda h: torch.arange(h.shape[1]).to(h.device), "to (blocking copy)"),
        (lambda h: h.to("cpu"), "to (blocking copy)"),
    ],
    ids=["item", "bincount", "equal", "allclose", "bool-mask", "repeat_interleave", "to-device", "to-host"],
)
def test_the_guard_catches_each_planted_read(plant, read, monkeypatch):
    """Each kind of host read, planted in a decoder layer of a turn on the pretend GPU, is reported; the same
    operation in its synchronisation-free form is not."""
    assert any(read in hit for hit in _planted(plant, monkeypatch)), read


def test_the_synchronisation_free_forms_are_not_reported(monkeypatch):
    from visualkv.devices import to_device

    def plant(h):
        h.repeat_interleave(torch.ones(h.shape[1], dtype=torch.long, device=h.device), dim=1, output_size=h.shape[1])
        to_device(torch.arange(h.shape[1]), h.device)  # pinned, non-blocking
        h.to(h.device)  # already there
        h.float()

    assert _planted(plant, monkeypatch) == []


def _planted(plant, monkeypatch) -> list[str]:
    """The guard's hits over a one-token turn on the pretend GPU with `plant(hidden)` after decoder layer 1."""
    from tests.fake_cuda import fake_cuda, fake_cuda_adapter

    adapter = fake_cuda_adapter("tiny-qwen2.5-vl")

    def planted(module, inputs, out) -> None:  # returns None: the layer's output is left as it was
        plant(out[0] if isinstance(out, tuple) else out)

    hook = adapter.layers[1].register_forward_hook(planted)
    try:
        with fake_cuda():
            g = _armed(monkeypatch, device_only=True)
            with g:
                ChatSession(adapter, SessionConfig(max_new_tokens=1)).ask("Hi?")
    finally:
        hook.remove()
    return g.hits


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
