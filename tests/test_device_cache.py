"""The device-built cache (in-place appends and eviction, exact bytes), Sali-Cache's packed tiers attended per
segment through the attention call's own arguments (no dequantized copy kept) and incremental detokenization."""

from __future__ import annotations

import pytest
import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from tests.conftest import get_adapter
from visualkv.attention.step import Step, running
from visualkv.bench.synthetic import video_media
from visualkv.kv import quant
from visualkv.kv.cache import TIER_FULL, TIER_INT4, TIER_INT8, CompressibleCache, CompressibleLayer, split_tiers
from visualkv.kv.quant import dequantize
from visualkv.runtime.detokenize import IncrementalDetokenizer
from visualkv.runtime.session import ChatSession, SessionConfig


def _kv(q: int, seed: int, heads: int = 2, dim: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, heads, q, dim, generator=g), torch.randn(1, heads, q, dim, generator=g)


def test_appends_write_in_place_and_read_views():
    cache = CompressibleCache(1)
    cache.set_capacity_hint(64)
    k0, v0 = _kv(10, 0)
    with running(Step(token_index=torch.arange(10))):
        out_k, _ = cache.update(k0, v0, 0)
    layer = cache.layers[0]
    ptr = layer.keys.data_ptr()
    for step in range(5):  # decode-like steps: one entry each
        k, v = _kv(1, step + 1)
        with running(Step(token_index=torch.tensor([10 + step]))):
            out_k, out_v = cache.update(k, v, 0)
        assert out_k.data_ptr() == ptr  # a view of the same buffer: nothing was reallocated or concatenated
        assert torch.equal(out_k[:, :, -1:], k) and torch.equal(out_v[:, :, -1:], v)
    assert torch.equal(layer.keys[:, :, :10], k0)
    assert layer.token_index[0, 0].tolist() == list(range(15))
    # bytes: entries held vs the buffer really allocated (capacity 64)
    entry = 2 * 2 * 8 * 4  # K + V, 2 heads, head_dim 8, float32
    assert layer.kv_bytes() == 15 * entry == layer.keys.nbytes + layer.values.nbytes
    assert layer.allocated_bytes() == 64 * entry
    assert cache.peak_device_bytes >= cache.allocated_bytes() >= cache.kv_bytes()


def test_growth_is_geometric_and_counted():
    cache = CompressibleCache(1)
    layer = cache.layers[0]
    sizes = []
    for step in range(40):
        k, v = _kv(16, step)
        with running(Step(token_index=torch.arange(16) + 16 * step)):
            cache.update(k, v, 0)
        sizes.append(layer._rows.capacity)
    assert len(set(sizes)) < 15  # not one reallocation per append
    assert layer.n_full == 640 and sizes[-1] >= 640
    assert cache.peak_device_bytes > cache.allocated_bytes()  # a growth held old + new buffers at once


def test_eviction_compacts_in_place():
    cache = CompressibleCache(1)
    cache.set_capacity_hint(32)
    k, v = _kv(12, 3)
    with running(Step(token_index=torch.arange(12))):
        cache.update(k, v, 0)
    layer = cache.layers[0]
    ptr = layer.keys.data_ptr()
    keep = torch.tensor([[[11, 0, 5, 7], [1, 2, 3, 10]]])  # per head, unsorted
    layer.keep_full(keep)
    want = keep.sort(dim=-1).values
    assert layer.keys.data_ptr() == ptr and layer.n_full == 4
    for h in range(2):
        assert torch.equal(layer.keys[0, h], k[0, h, want[0, h]])
        assert torch.equal(layer.values[0, h], v[0, h, want[0, h]])
        assert layer.token_index[0, h].tolist() == want[0, h].tolist()


def test_split_tiers_is_host_side():
    assert split_tiers(None) is None and split_tiers(torch.zeros(5, dtype=torch.long)) is None
    split = split_tiers(torch.tensor([0, 1, 0, 1]))
    assert split[TIER_FULL].tolist() == [0, 2] and split[TIER_INT8].tolist() == [1, 3]


def _packed_layer(n_full: int = 5, n_int8: int = 7, n_int4: int = 6, dtype=torch.float32):
    """A layer holding full-precision entries and INT8 / INT4 segments (2 KV heads, head_dim 32)."""
    layer = CompressibleLayer()
    k, v = _kv(n_full + n_int8 + n_int4, seed=4, dim=32)
    codes = torch.tensor([TIER_FULL] * n_full + [TIER_INT8] * n_int8 + [TIER_INT4] * n_int4)
    layer.update(k.to(dtype), v.to(dtype), torch.arange(codes.numel()), split_tiers(codes))
    return layer


def _reference(query, layer, keys, values, mask, scale):
    """Attention over [dequantized packed | keys] as one concatenation: what the wrapper must equal."""
    parts = list(layer.quant.values())
    k_all = torch.cat([dequantize(s.keys) for s in parts] + [keys], dim=2)
    v_all = torch.cat([dequantize(s.values) for s in parts] + [values], dim=2)
    group = query.shape[1] // k_all.shape[1]
    k_all, v_all = k_all.repeat_interleave(group, dim=1), v_all.repeat_interleave(group, dim=1)
    if mask is None and query.shape[2] > 1:  # no mask: causal among the queries, which are the last entries
        q = query.shape[2]
        mask = torch.ones(q, k_all.shape[2], dtype=torch.bool)
        mask[:, -q:] = torch.ones(q, q, dtype=torch.bool).tril()
        mask = mask[None, None]
    if mask is not None and mask.shape[-1] < k_all.shape[2]:
        visible = torch.ones if mask.dtype == torch.bool else torch.zeros
        pad = visible((*mask.shape[:-1], k_all.shape[2] - mask.shape[-1]), dtype=mask.dtype)
        mask = torch.cat([pad, mask], dim=-1)
    out = torch.nn.functional.scaled_dot_product_attention(query, k_all, v_all, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


@pytest.mark.parametrize("queries", [1, 3])
@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
def test_packed_segments_are_attended_like_a_dequantized_concatenation(queries, mask_kind):
    """The wrapped attention (one query: one softmax over the parts; several: one concatenation for the call)
    equals SDPA over [dequantized packed | full] with grouped-query heads and the engine's masks."""
    layer = _packed_layer()
    segments = layer.packed_segments()  # what the runner puts in the layer call's step, taken before it runs
    k_new, v_new = _kv(queries, seed=5, dim=32)
    keys, values = layer.update(k_new, v_new, torch.arange(18, 18 + queries))  # full entries + the new ones
    query = torch.randn(1, 4, queries, 32, generator=torch.Generator().manual_seed(6))  # 4 heads over 2 KV heads
    n_past = layer.total_entries_per_head() - queries
    mask = None
    if mask_kind is not None:  # the engine's: every past entry visible, the new ones causal; some hidden too
        allowed = torch.ones(queries, n_past + queries, dtype=torch.bool)
        allowed[:, n_past:] = torch.ones(queries, queries, dtype=torch.bool).tril()
        allowed[:, -queries - 2] = False  # a full-precision entry hidden (a fixed-shape window's unwritten slot)
        mask = allowed[None, None]
        if mask_kind == "float":
            mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    attention = ALL_ATTENTION_FUNCTIONS["visualkv_sdpa"]
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True  # what transformers' sdpa reads from an attention module
    with running(Step(segments=segments)):  # the engine's step for the layer call
        out, _ = attention(module, query, keys, values, mask, scaling=0.2, dropout=0.0)
    want = _reference(query, layer, keys, values, mask, 0.2)
    assert len(segments) == 2 and out.shape == want.shape == (1, queries, 4, 32)
    assert torch.allclose(out, want, atol=1e-5), (out - want).abs().max()
    # and the segments matter: without them the same call attends the full entries only
    alone, _ = attention(module, query, keys, values, mask[..., -keys.shape[2] :] if mask is not None else None)
    assert not torch.allclose(alone, want, atol=1e-3)


def _held_tensors(obj, seen: set | None = None) -> list[torch.Tensor]:
    """Every tensor reachable from `obj` through attributes, lists, tuples and dicts (what it keeps alive)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, (str, bytes, int, float, type, torch.dtype, torch.device)):
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        children = list(obj)
    else:
        children = list(getattr(obj, "__dict__", {}).values())
    return [t for child in children for t in _held_tensors(child, seen)]


def _is_index(t: torch.Tensor) -> bool:
    return t.dtype in (torch.int32, torch.int64)  # token indices (packed codes are uint8)


def test_salicache_keeps_no_dequantized_copy_and_decodes_what_it_stores(monkeypatch):
    """After a Sali-Cache turn the device holds the full-precision entries (+ room) and the packed bytes only,
    and each decode step dequantizes the packed tiers for its own attention call (per layer, then dropped)."""
    adapter = get_adapter("tiny-qwen2.5-vl")
    calls = []
    real = quant.dequantize  # what packed attention's `quant.dequantize_all` calls per segment
    monkeypatch.setattr(quant, "dequantize", lambda p, out=None: calls.append(1) or real(p, out=out))
    session = ChatSession(adapter, SessionConfig(method="salicache", max_new_tokens=6, decode="eager"))
    session.ask("What moves?", video_media(4, 224, 168, fps=1.0, seed=3))
    cache = session.cache
    segments = [len(layer.quant) for layer in cache.layers]
    assert min(segments) > 0
    head_dim = cache.layers[0].keys.shape[-1]  # the model's
    for layer in cache.layers:  # every K/V byte the layer holds is counted, and none is a dequantized copy
        held = _held_tensors(layer)
        kv = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held if not _is_index(t)}
        assert sum(kv.values()) == layer.allocated_bytes()
        wide = {t.untyped_storage().data_ptr() for t in held if t.is_floating_point() and t.shape[-1] == head_dim}
        assert len(wide) == 2  # the full-precision K and V buffers: no head_dim-wide float copy of a packed tier
    # the question block, then every decoded token but the last one fed: each layer's attention dequantizes
    steps = 1 + len(session.turns[-1].token_ids) - 1
    assert len(calls) == 2 * sum(segments) * steps
    # the attention call's transient is counted in the device peak: every packed entry dequantized (K and V, the
    # model dtype), the last tensor's codes, and the float32 scores and probabilities of the decode step
    assert cache.layers[0].query_group == adapter.query_group == 2
    for layer in cache.layers:
        dequantized = sum(2 * dequantize(s.keys).nbytes for s in layer.quant.values())
        assert layer.packed_working_bytes(1) > dequantized
    assert cache.peak_device_bytes >= cache.allocated_bytes() + max(
        layer.packed_working_bytes(1) for layer in cache.layers
    )


@pytest.mark.parametrize(
    "alias", ["tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-smolvlm2", "tiny-internvl3.5", "tiny-llava-onevision"]
)
def test_packed_segments_reach_attention_through_the_step_channel(alias, monkeypatch):
    """Every family's decoder layer runs its attention inside the engine's step: each decode step, plain or
    fixed-shape, attends every layer's packed tiers (one `one_query` call with one dequantized part per layer
    holding any), and both decoders give the same logits."""
    from visualkv.attention import packed as packed_attention

    adapter = get_adapter(alias)
    parts = []
    original = packed_attention.one_query
    monkeypatch.setattr(
        packed_attention, "one_query", lambda q, k, v, m, p, s: parts.append(len(p)) or original(q, k, v, m, p, s)
    )
    logits = []
    for decode in ("eager", "static"):
        parts.clear()
        session = ChatSession(adapter, SessionConfig(method="salicache", max_new_tokens=3, decode=decode))
        seen: list[torch.Tensor] = []
        session._sample = lambda lg, gen, seen=seen, sample=session._sample: seen.append(lg.clone()) or sample(lg, gen)
        session.ask("What moves?", video_media(4, 224, 168, fps=1.0, seed=3))
        packed_layers = sum(bool(layer.quant) for layer in session.cache.layers)
        record = session.turns[-1]
        steps = len(record.token_ids) - (record.stopped != "eos")  # tokens fed back (not a last one kept pending)
        assert packed_layers and steps > 0
        assert parts == [1] * packed_layers * steps, (decode, parts)
        logits.append(torch.stack(seen))
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-5)


def test_incremental_detokenizer_matches_full_decode():
    tok = get_adapter("tiny-qwen2.5-vl").tokenizer
    text = "Zwei Äpfel, 三个苹果 and 🍎🍏 — naïve café ... done."
    ids = tok(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(i) for i in ids]
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True) == detok.text
    assert all("\ufffd" not in p for p in pieces)
    assert sum(1 for p in pieces if p) > len(ids) // 3  # streamed as it goes, not all at the end


def test_decoding_never_grows_a_buffer():
    """The first allocation leaves room for the answer: a bulk prefill + decode allocates once per layer."""
    adapter = get_adapter("tiny-qwen2.5-vl")
    session = ChatSession(adapter, SessionConfig(method="full", max_new_tokens=7))
    session.ask("Hi there?")
    for layer in session.cache.layers:
        assert layer._rows.capacity == session.prepared.seq_len + 8  # prompt + max_new_tokens + 1, never grown
        assert layer.n_full == session.prepared.seq_len + len(session.turns[-1].token_ids) - 1


def test_packed_tiers_under_eager_attention_match_sdpa():
    """The eager wrapper calls the model file's own eager function: Sali-Cache answers alike under both kernels."""
    from visualkv.models.registry import _adapter
    from visualkv.models.synthetic.tiny import build_tiny

    eager = _adapter(*build_tiny("tiny-qwen2.5-vl", seed=0, attn_implementation="eager"), "tiny-qwen2.5-vl")
    sdpa = get_adapter("tiny-qwen2.5-vl")
    video = video_media(4, 224, 168, fps=1.0, seed=3)
    logits = []
    for adapter in (sdpa, eager):
        session = ChatSession(adapter, SessionConfig(method="salicache", max_new_tokens=4, decode="eager"))
        seen: list[torch.Tensor] = []
        session._sample = lambda lg, gen, seen=seen, sample=session._sample: seen.append(lg.clone()) or sample(lg, gen)
        session.ask("What moves?", video)
        assert sum(len(layer.quant) for layer in session.cache.layers) > 0
        logits.append(torch.stack(seen))
    assert eager.attn_implementation == "eager" == eager.text_config._attn_implementation  # the model's own again
    assert torch.allclose(logits[0], logits[1], atol=1e-4), (logits[0] - logits[1]).abs().max()


def test_tiers_under_an_unwrapped_attention_kernel_refuse_in_one_line(monkeypatch):
    """Flash attention takes no explicit mask and is not wrapped: a tiered method says so before any layer runs,
    and the session is left as it was."""
    from visualkv.errors import ConfigError

    adapter = get_adapter("tiny-qwen2.5-vl")
    config = adapter.text_config
    monkeypatch.setattr(config, "_attn_implementation_internal", "flash_attention_2")
    session = ChatSession(adapter, SessionConfig(method="salicache", max_new_tokens=2))
    with pytest.raises(ConfigError, match="need sdpa or eager attention") as err:
        session.ask("What moves?", video_media(4, 224, 168, fps=1.0, seed=3))
    assert "\n" not in str(err.value) and session.cache is None and not session.turns
