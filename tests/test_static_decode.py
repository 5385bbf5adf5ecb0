"""Fixed-shape decoding (visualkv.runtime.static_decode), the step a CUDA graph replays, checked on CPU.

"static" runs exactly the step that "graph" captures, as plain PyTorch. It must give the answers of the plain
("eager") decode token for token, leave the cache as the plain decode does (the next turn too), and read no
device value inside the step. The CUDA graph itself is checked in tests/test_cuda.py.
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tests.conftest import get_adapter
from tests.fake_cuda import FakeCudaTensor, fake_cuda, fake_cuda_adapter
from tests.test_sync_free import SyncGuard
from visualkv.attention import packed as packed_attention
from visualkv.bench.synthetic import image_media, video_media
from visualkv.errors import ConfigError
from visualkv.kv.cache import CompressibleLayer
from visualkv.runtime.session import ChatSession, SessionConfig
from visualkv.runtime.static_decode import GROUPED_MIN_ENTRIES, StaticDecoder, decode_attention, graph_unsupported

ALL_FAMILIES = ["tiny-qwen2.5-vl", "tiny-smolvlm2", "tiny-qwen3-vl", "tiny-llava-onevision", "tiny-internvl3.5"]
METHODS = [
    ("full", None),
    ("blockwise-keydiff", 24),
    ("salicache", None),  # packed tiers: attended per segment beside the window (visualkv.attention.packed)
    ("blockwise-keydiff+salicache", 24),
    ("lightkv", None),  # merged entries: layers hold different counts
]


def _run(
    adapter,
    method: str,
    budget: int | None,
    decode: str,
    media,
    stop_after: int | None = None,
    attention: str = "auto",
):
    """Two turns; returns (token ids per turn, logits per sampled token, final cache bookkeeping, session)."""
    config = SessionConfig(
        method=method, budget=budget, block_size=48, max_new_tokens=10, decode=decode, decode_attention=attention
    )
    session = ChatSession(adapter, config)
    logits: list[torch.Tensor] = []
    sample = session._sample

    def recording(lg, generator):
        logits.append(lg.detach().clone())
        return sample(lg, generator)

    session._sample = recording
    first = []
    for piece in session.stream("What is in it?", media):
        first.append(piece)
        if stop_after is not None and len(session.turns[-1].token_ids) >= stop_after:
            break  # the caller stops reading: the entries written so far must still be counted
    session.ask("And what else?")
    index = [layer.all_token_index().clone() for layer in session.cache.layers]
    return [t.token_ids for t in session.turns], logits, (session.cache.entries_per_layer(), index), session


@pytest.mark.parametrize("method,budget", METHODS)
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_static_decode_matches_eager(family, method, budget):
    adapter = get_adapter(family)
    media = video_media(4, 224, 168, fps=1.0, seed=3) if "salicache" in method else image_media(448, 336, seed=1)
    eager_ids, eager_logits, eager_cache, eager = _run(adapter, method, budget, "eager", media)
    assert [t.decode_mode for t in eager.turns] == ["eager"] * 2
    assert [t.decode_attention for t in eager.turns] == [""] * 2
    for attention in ("model", "grouped"):  # the model's masked SDPA / eager function, or one_query's matmuls
        static_ids, static_logits, static_cache, static = _run(
            adapter, method, budget, "static", media, attention=attention
        )
        assert [t.decode_mode for t in static.turns] == ["static"] * 2
        assert [t.decode_attention for t in static.turns] == [attention] * 2
        assert static_ids == eager_ids
        # float32 on CPU: the same sums with masked slots added as exact zeros; only the kernels' order differs
        assert max((a - b).abs().max().item() for a, b in zip(eager_logits, static_logits)) < 1e-4
        assert static_cache[0] == eager_cache[0]  # entries per layer after two turns
        assert all(torch.equal(a, b) for a, b in zip(static_cache[1], eager_cache[1]))  # same tokens, same order


def test_static_decode_counts_a_stopped_answer():
    """Stopping the stream mid-answer: the written entries are counted, and the next turn sees them."""
    adapter = get_adapter("tiny-qwen2.5-vl")
    media = image_media(448, 336, seed=1)
    eager = _run(adapter, "blockwise-keydiff", 24, "eager", media, stop_after=4)
    static = _run(adapter, "blockwise-keydiff", 24, "static", media, stop_after=4)
    assert static[0] == eager[0] and static[2][0] == eager[2][0]
    assert all(torch.equal(a, b) for a, b in zip(static[2][1], eager[2][1]))


class HostToDevice(TorchFunctionMode):
    """Records copies from host memory to the (pretend) GPU while armed: a CUDA graph cannot capture them."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.hits: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if self.armed:
            src = args[0] if args and isinstance(args[0], torch.Tensor) else None
            host_src = src is not None and not isinstance(src, FakeCudaTensor) and src.numel() > 0
            wants_cuda = any(
                isinstance(a, (str, torch.device)) and torch.device(a).type == "cuda"
                for a in (*args[1:2], kwargs.get("device"))
            )
            if name in ("to", "cuda", "copy_") and host_src and (wants_cuda or name in ("cuda", "copy_")):
                self.hits.append(f"{name} from host")
            elif name in ("tensor", "as_tensor") and wants_cuda:
                self.hits.append(f"torch.{name} to cuda")
        return func(*args, **kwargs)


@pytest.mark.parametrize("attention, grouped_calls", [("model", 0), ("grouped", 2 * 9 * 2)])
def test_decode_attention_routes_the_window(monkeypatch, attention, grouped_calls):
    """ "grouped" sends every layer's one-query call of a fixed-shape step through `one_query` (no packed parts);
    "model" leaves them to the model's function. tiny-smolvlm2: 2 layers; 10 tokens = 9 steps; two turns."""
    calls = []
    original = packed_attention.one_query

    def spy(query, key, value, mask, parts, scaling):
        calls.append(len(parts))
        return original(query, key, value, mask, parts, scaling)

    monkeypatch.setattr(packed_attention, "one_query", spy)
    adapter = get_adapter("tiny-smolvlm2")
    assert adapter.num_layers == 2
    _run(adapter, "full", None, "static", image_media(448, 336, seed=1), attention=attention)
    assert calls == [0] * grouped_calls
    calls.clear()
    _run(adapter, "full", None, "eager", image_media(448, 336, seed=1), attention=attention)
    assert calls == []  # plain steps never: the switch is the fixed-shape step's own


def test_auto_decode_attention_is_grouped_on_long_cuda_windows():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert decode_attention("auto", cuda, GROUPED_MIN_ENTRIES) == "grouped"
    assert decode_attention("auto", cuda, GROUPED_MIN_ENTRIES - 1) == "model"
    assert decode_attention("auto", cpu, 10 * GROUPED_MIN_ENTRIES) == "model"
    assert decode_attention("model", cuda, 10 * GROUPED_MIN_ENTRIES) == "model"
    assert decode_attention("grouped", cpu, 1) == "grouped"


@pytest.mark.parametrize("attention", ["model", "grouped"])
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_static_step_is_capturable(monkeypatch, family, attention):
    """The step a CUDA graph captures (on the pretend GPU of tests/fake_cuda.py): no device value read on the
    host (`.item()`, `.cpu()`, `nonzero()`, boolean indexing...), no copy from host memory, no device mix-up."""
    reads, copies = SyncGuard(), HostToDevice()
    original = StaticDecoder._run

    def armed(self):
        reads.armed = copies.armed = True
        try:
            return original(self)
        finally:
            reads.armed = copies.armed = False

    monkeypatch.setattr(StaticDecoder, "_run", armed)
    adapter = fake_cuda_adapter(family)
    with fake_cuda(), reads, copies:
        config = SessionConfig(method="salicache", max_new_tokens=6, decode="static", decode_attention=attention)
        session = ChatSession(adapter, config)
        session.ask("What is in it?", video_media(4, 224, 168, fps=1.0, seed=3))
        session.ask("And then?")
    assert [t.decode_mode for t in session.turns] == ["static"] * 2
    assert [t.decode_attention for t in session.turns] == [attention] * 2
    assert all(len(t.token_ids) == 6 for t in session.turns)
    assert reads.hits == [] and copies.hits == []


def test_masked_slots_are_zeroed(monkeypatch):
    """Slots past the written ones are masked, yet attention still multiplies their values by zero: garbage
    there (an `empty` buffer may hold NaN) must not reach the output."""
    original = CompressibleLayer.static_window

    def poisoned(self, steps):
        self.reserve(steps)  # the buffers the window will use, then NaN in their free capacity
        for buf in self._rows.buffers[:2]:
            buf[:, :, self._rows.n :].fill_(float("nan"))
        return original(self, steps)

    adapter = get_adapter("tiny-smolvlm2")
    eager = ChatSession(adapter, SessionConfig(max_new_tokens=6, decode="eager")).ask("Hi?")
    monkeypatch.setattr(CompressibleLayer, "static_window", poisoned)
    static = ChatSession(adapter, SessionConfig(max_new_tokens=6, decode="static")).ask("Hi?")
    assert static.decode_mode == "static"
    assert static.token_ids == eager.token_ids  # NaN logits would argmax to token 0


def test_decode_mode_is_validated():
    adapter = get_adapter("tiny-qwen2.5-vl")
    with pytest.raises(ConfigError, match="decode must be one of"):
        ChatSession(adapter, SessionConfig(decode="fast"))
    with pytest.raises(ConfigError, match="decode_attention must be one of auto, model, grouped, got 'flash'"):
        ChatSession(adapter, SessionConfig(decode_attention="flash"))
    with pytest.raises(ConfigError, match="decode 'graph' is not possible here: CUDA graphs need"):
        ChatSession(adapter, SessionConfig(decode="graph"))
    assert graph_unsupported(adapter) is not None
    session = ChatSession(adapter, SessionConfig(max_new_tokens=3))  # auto on CPU: plain steps
    session.ask("Hi?")
    assert session.turns[-1].decode_mode == "eager"
