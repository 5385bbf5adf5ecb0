"""Unit tests of the pure pieces: scorers, block planning, cache bookkeeping."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from visualkv.attention.step import Step, running
from visualkv.kv.cache import TIER_FULL, TIER_INT4, TIER_INT8, CompressibleCache, split_tiers
from visualkv.kv.quant import QuantSpec, dequantize, packed_bytes_per_token
from visualkv.layout import VisualUnit, plan_blocks
from visualkv.scoring import keydiff_scores, snapkv_scores


def test_keydiff_prefers_distinctive_keys():
    base = torch.tensor([1.0, 0.0, 0.0, 0.0])
    keys = torch.stack([base, base * 2, base * 0.5, torch.tensor([0.0, 1.0, 0.0, 0.0])])[None, None]
    scores = keydiff_scores(keys)
    assert scores.shape == (1, 1, 4)
    assert int(scores.argmax()) == 3  # the only key pointing elsewhere
    assert torch.allclose(scores[0, 0, 0], scores[0, 0, 1])  # scale does not matter (cosine)


def test_keydiff_is_minus_cosine_to_the_mean_unit_key():
    """KeyDiff by its definition (F.cosine_similarity against the mean of the L2-normalised keys)."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(2, 3, 17, 8, generator=gen) * torch.rand(2, 3, 17, 1, generator=gen) * 5
    keys[0, 0, 4] = 0  # a zero key scores 0
    normed = F.normalize(keys, dim=-1)
    expected = -F.cosine_similarity(normed, normed.mean(dim=2, keepdim=True), dim=-1)
    assert torch.allclose(keydiff_scores(keys), expected, atol=1e-6)
    assert torch.equal(keydiff_scores(keys).argsort(-1), expected.argsort(-1))


def test_snapkv_groups_query_heads_onto_kv_heads():
    torch.manual_seed(0)
    keys = torch.randn(1, 2, 10, 8)
    queries = torch.zeros(1, 4, 3, 8)  # 4 query heads -> 2 KV heads (groups of 2)
    queries[0, 0:2] = keys[0, 0, 7] * 10  # group of KV head 0 looks at key 7
    queries[0, 2:4] = keys[0, 1, 2] * 10  # group of KV head 1 looks at key 2
    scores = snapkv_scores(queries, keys, kernel_size=1)
    assert scores.shape == (1, 2, 10)
    assert int(scores[0, 0].argmax()) == 7 and int(scores[0, 1].argmax()) == 2
    assert torch.allclose(scores.sum(-1), torch.ones(1, 2), atol=1e-5)  # averaged softmax
    pooled = snapkv_scores(queries, keys, kernel_size=5)
    assert pooled[0, 0, 6] > scores[0, 0, 6]  # pooling spreads onto neighbours
    with pytest.raises(ValueError):
        snapkv_scores(torch.zeros(1, 3, 1, 8), keys)


def _units(n_units: int, size: int, gap: int = 0, start: int = 5) -> list[VisualUnit]:
    units, pos = [], start
    for i in range(n_units):
        units.append(VisualUnit("rows", 0, pos, pos + size, row=i))
        pos += size + gap
    return units


@pytest.mark.parametrize("mode", ["blockwise", "hybrid"])
def test_blocks_never_cut_units_and_cover_the_sequence(mode):
    units = _units(10, 30, gap=2)
    seq_len = units[-1].seq_end + 7
    blocks = plan_blocks(seq_len, units, mode, block_size=70, budget=100)
    assert blocks[0].start == 0 and blocks[-1].end == seq_len
    assert all(a.end == b.start for a, b in itertools.pairwise(blocks))
    assert sum(len(b.units) for b in blocks) == len(units)
    for b in blocks:
        for u in b.units:
            assert b.start <= u.seq_start and u.seq_end <= b.end
        if b.kind != "bulk" and len(b.units) > 1:
            assert b.n_visual <= 70
    if mode == "hybrid":
        assert blocks[0].kind == "bulk" and blocks[0].n_visual <= 100
    else:
        assert blocks[0].kind == "text"


def test_hybrid_is_one_bulk_forward_when_everything_fits():
    units = _units(3, 30)
    blocks = plan_blocks(200, units, "hybrid", block_size=30, budget=1000)
    assert len(blocks) == 1 and blocks[0].kind == "bulk"


def test_oversized_unit_gets_its_own_block():
    units = _units(3, 50)
    blocks = plan_blocks(200, units, "blockwise", block_size=20, budget=None)
    assert [len(b.units) for b in blocks if b.units] == [1, 1, 1]


def test_cache_tiers_are_packed_and_counted_exactly():
    cache = CompressibleCache(num_layers=2)
    b, h, d = 1, 2, 64
    k = torch.randn(b, h, 6, d)
    tiers = torch.tensor([TIER_FULL, TIER_INT8, TIER_INT4, TIER_INT8, TIER_FULL, TIER_INT4])
    with running(Step(token_index=torch.arange(6), tiers=split_tiers(tiers))):
        keys, _values = cache.update(k, k.clone(), 0)
    assert keys.shape == (1, 2, 6, d)  # the block attends to all its own entries
    layer = cache.layers[0]
    expected = (
        2
        * h
        * (
            2 * d * 4
            + 2 * packed_bytes_per_token(d, QuantSpec(8), torch.float32)
            + 2 * packed_bytes_per_token(d, QuantSpec(4), torch.float32)
        )
    )
    assert layer.kv_bytes() == expected
    assert layer.tier_counts() == {TIER_FULL: 4, TIER_INT8: 4, TIER_INT4: 4}  # summed over 2 heads
    # next block: the full-precision entries are returned; the packed ones go to the attention call beside them
    with running(Step(token_index=torch.tensor([6]))):
        keys2, _ = cache.update(torch.randn(b, h, 1, d), torch.randn(b, h, 1, d), 0)
    assert keys2.shape[2] == 3 and layer.kv_bytes() == expected + 2 * h * d * 4
    segments = layer.packed_segments()  # what the attention call reading keys2 adds (INT8, then INT4)
    assert [s.token_index[0, 0].tolist() for s in segments] == [[1, 3], [2, 5]]
    assert torch.allclose(dequantize(segments[0].keys)[0], k[0, :, [1, 3]], atol=0.05)
    assert cache.peak_kv_bytes == cache.kv_bytes()


def test_keep_full_gathers_per_head():
    cache = CompressibleCache(num_layers=1)
    k = torch.arange(2 * 5 * 4, dtype=torch.float32).view(1, 2, 5, 4)
    with running(Step(token_index=torch.arange(5))):
        cache.update(k, k.clone(), 0)
    layer = cache.layers[0]
    layer.keep_full(torch.tensor([[[4, 1], [0, 2]]]))
    assert layer.token_index.tolist() == [[[1, 4], [0, 2]]]
    assert torch.equal(layer.keys[0, 0], k[0, 0, [1, 4]])
    assert layer.kv_bytes() == 2 * 2 * 2 * 4 * 4


def test_grid_pooling_is_avg_pool_when_nothing_is_evicted_and_skips_gaps_after():
    """pool_along_grid: neighbours are by original token order within a tile/frame, not by cache slot."""
    import torch.nn.functional as F

    from visualkv.scoring import grid_keys, pool_along_grid

    def pool_along_grid_of(scores, coord, group, kernel_size):
        return pool_along_grid(scores, grid_keys(coord, group), kernel_size=kernel_size)

    torch.manual_seed(0)
    scores = torch.rand(1, 2, 12)
    coord = torch.arange(12).expand(1, 2, 12)
    one_frame = torch.zeros(1, 2, 12, dtype=torch.long)
    pooled = pool_along_grid_of(scores, coord, one_frame, kernel_size=5)
    ref = F.avg_pool1d(scores.view(2, 1, 12), 5, stride=1, padding=2, count_include_pad=False).view(1, 2, 12)
    assert torch.allclose(pooled, ref, atol=1e-6)
    # two frames: no pooling across their boundary
    frames = (torch.arange(12) >= 6).long().expand(1, 2, 12)
    split = pool_along_grid_of(scores, coord, frames, kernel_size=5)
    assert torch.allclose(split[..., 5], scores[..., 3:6].mean(-1), atol=1e-6)
    # the same with each frame's coordinates counted from 0: still no pooling across the boundary
    restart = pool_along_grid_of(scores, coord % 6, frames, kernel_size=5)
    assert torch.allclose(restart, split, atol=1e-6)
    # after eviction: entries 1 and 2 are gone; entry 3 (coord 3) pools with coords 4, 5 only (0 is 3 away)
    keep = torch.tensor([0, 3, 4, 5, 6, 7])
    gapped = pool_along_grid_of(scores[..., keep], coord[..., keep], one_frame[..., keep], kernel_size=5)
    assert torch.allclose(gapped[..., 1], scores[..., [3, 4, 5]].mean(-1), atol=1e-6)
    # protected entries (group -1) pool with nobody and nobody pools with them
    text = one_frame.clone()
    text[..., 0] = -1
    alone = pool_along_grid_of(scores, coord, text, kernel_size=5)
    assert torch.allclose(alone[..., 0], scores[..., 0]) and torch.allclose(alone[..., 1], scores[..., 1:4].mean(-1))


def test_grid_pooling_matches_its_definition_on_random_evictions():
    """pool_along_grid against its definition, pair by pair: an entry averages itself with every entry of
    the same tile/frame (group >= 0) whose original coordinate is within kernel_size // 2 of its own."""
    from visualkv.scoring import grid_keys, pool_along_grid

    gen = torch.Generator().manual_seed(3)
    for trial in range(60):
        n, heads, kernel = 1 + trial % 23, 2, (1, 3, 5, 7)[trial % 4]
        coord = torch.stack([torch.randperm(80, generator=gen)[:n].sort().values for _ in range(heads)])[None]
        group = coord // int(torch.randint(3, 30, (), generator=gen))
        group[torch.rand(group.shape, generator=gen) < 0.2] = -1  # protected entries
        scores = torch.rand(1, heads, n, generator=gen)
        pooled = pool_along_grid(scores, grid_keys(coord, group), kernel_size=kernel)
        for h in range(heads):
            c, g, s = coord[0, h], group[0, h], scores[0, h]
            near = (g[:, None] == g[None, :]) & (g[:, None] >= 0) & ((c[:, None] - c[None, :]).abs() <= kernel // 2)
            near |= torch.eye(n, dtype=torch.bool)
            expected = (near.float() @ s) / near.sum(1)
            assert torch.allclose(pooled[0, h], expected, atol=1e-6), (trial, h)


def test_snapkv_proxy_window_is_the_question_only():
    """Block-wise SnapKV's proxy queries cover the question + assistant prompt, as post-prefill's window."""
    from tests.conftest import get_adapter
    from visualkv.bench.synthetic import image_media
    from visualkv.kv.cache import CompressibleCache
    from visualkv.methods.base import PrefillContext
    from visualkv.methods.blockwise import proxy_queries
    from visualkv.runtime.engine import Engine

    adapter = get_adapter("tiny-qwen2.5-vl")
    prepared = adapter.prepare(image_media(224, 168, seed=3), "Where is the red star?")
    ctx = PrefillContext(adapter, CompressibleCache(adapter.num_layers), prepared, 64, 64, "blockwise")
    ctx.text_pass = lambda ids, positions, observer: Engine(adapter).text_pass(ids, positions, observer, ctx)
    queries = proxy_queries(ctx, window=64)
    n_question = prepared.seq_len - prepared.suffix_start
    text_pass = prepared.seq_len - prepared.layout.n_visual  # [prefix + question] of the text-only pass
    assert n_question < min(64, text_pass)  # a plain "last 64 tokens" window would reach into the prefix
    assert all(q.shape[2] == n_question for q in queries)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux only: /proc/self/clear_refs")
def test_rss_peak_since_reset_forgets_an_earlier_peak():
    """The per-measurement RSS peak the scripts read: a transient after the reset shows; one before it does not."""
    from visualkv.report.telemetry import reset_peak_rss, rss_bytes, rss_peak_since_reset

    size = 256 * 2**20
    transient = torch.ones(size // 4)  # touched, so resident
    del transient
    assert reset_peak_rss()
    before = rss_bytes()
    assert rss_peak_since_reset() < before + size // 2  # the earlier 256 MiB no longer counts
    transient = torch.ones(size // 4)
    del transient
    assert rss_peak_since_reset() >= before + size // 2
