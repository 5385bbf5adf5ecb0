"""transformers' public `Cache` API on VisualKV's cache: each method works on it (tested here) or raises one
`NotImplementedError` saying why, and a method transformers adds fails this test until it is decided."""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers.cache_utils import Cache

from visualkv.kv.cache import CompressibleCache

HEADS, DIM = 2, 8


def _filled(layers: int = 2, entries: int = 6) -> CompressibleCache:
    cache = CompressibleCache(layers)
    g = torch.Generator().manual_seed(0)
    for i in range(layers):
        cache.pending_token_index = torch.arange(entries)
        k, v = torch.randn(2, 1, HEADS, entries, DIM, generator=g)
        cache.update(k, v, i)
    return cache


#: the methods that raise NotImplementedError, with a word their message must hold
REFUSED = {
    "offload": (lambda c: c.offload(0), "stays on its layers' devices"),
    "prefetch": (lambda c: c.prefetch(0), "stays on its layers' devices"),
    "early_initialization": (
        lambda c: c.early_initialization(1, HEADS, DIM, torch.float32, "cpu"),
        "sizes its buffers at its first update",
    ),
    "has_previous_state": (lambda c: c.has_previous_state(0), "linear-attention"),
    "get_conv_state": (lambda c: c.get_conv_state(0), "linear-attention"),
    "update_conv_state": (lambda c: c.update_conv_state(torch.zeros(1), 0), "linear-attention"),
    "get_recurrent_state": (lambda c: c.get_recurrent_state(0), "linear-attention"),
    "update_recurrent_state": (lambda c: c.update_recurrent_state(torch.zeros(1), 0), "linear-attention"),
    "update_indexer": (lambda c: c.update_indexer(torch.zeros(1), 0), "indexer"),
}

#: the methods and properties that work, each checked by `test_the_working_methods_do_what_transformers_says`
WORKS = {
    "update", "get_seq_length", "get_max_length", "get_mask_sizes", "get_query_offset", "reset", "crop",
    "reorder_cache", "batch_repeat_interleave", "batch_select_indices", "activate_past_recording",
    "is_recording_past", "batch_size", "is_compileable", "is_croppable", "is_initialized", "is_sliding",
    "is_linear", "is_dummy",
}  # fmt: skip


def test_every_public_cache_method_is_decided():
    public = {name for name, _ in inspect.getmembers(Cache) if not name.startswith("_")}
    undecided = public - set(REFUSED) - WORKS
    assert not undecided, f"transformers' Cache has new public methods: make them work or refuse them: {undecided}"
    assert not (set(REFUSED) | WORKS) - public, "a decided name is no longer in transformers' Cache"


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_refused_method_raises_one_clear_line(name):
    call, reason = REFUSED[name]
    cache = _filled()
    before = cache.entries_per_layer()
    with pytest.raises(NotImplementedError, match=reason) as err:
        call(cache)
    assert "\n" not in str(err.value) and cache.entries_per_layer() == before


def test_the_layers_offload_and_beam_reorder_are_refused_too():
    layer = _filled().layers[0]
    for call in (layer.offload, layer.prefetch, lambda: layer.reorder_cache(torch.tensor([0, 0]))):
        with pytest.raises(NotImplementedError, match="stays on its layers' devices|one sequence, not 2 rows"):
            call()


def test_the_working_methods_do_what_transformers_says():
    cache = _filled(entries=6)
    keys = cache.layers[1].keys.clone()
    assert cache.get_seq_length() == cache.get_query_offset() == 6 and cache.get_max_length() == -1
    assert cache.get_mask_sizes(3, 0) == (9, 0)
    assert cache.is_initialized and cache.is_sliding == [False, False] and cache.is_linear == [False, False]
    assert cache.is_dummy == [False, False] and not cache.is_compileable and cache.batch_size == -1
    cache.activate_past_recording()
    assert not cache.is_recording_past(0)
    # one sequence: the batch operations on one row leave it as it was
    cache.reorder_cache(torch.tensor([0]))
    cache.batch_repeat_interleave(1)
    cache.batch_select_indices(torch.tensor([0]))
    assert torch.equal(cache.layers[1].keys, keys)
    for refused in (
        lambda: cache.reorder_cache(torch.tensor([0, 0])),
        lambda: cache.batch_repeat_interleave(3),
        lambda: cache.batch_select_indices(torch.tensor([0, 0])),
    ):
        with pytest.raises(NotImplementedError, match="holds one sequence"):
            refused()
    # crop drops the newest entries of every layer; the bytes follow
    assert cache.is_croppable
    cache.crop(2)
    assert cache.entries_per_layer() == [4, 4] and torch.equal(cache.layers[1].keys, keys[:, :, :4])
    assert cache.layers[1].token_index[0, 0].tolist() == [0, 1, 2, 3]
    assert cache.kv_bytes() == 2 * 4 * (2 * HEADS * DIM * 4)  # layers x entries x (K + V, heads, dim, float32)
    cache.reset()
    assert cache.get_seq_length() == 0 and not cache.is_initialized and cache.kv_bytes() == 0
