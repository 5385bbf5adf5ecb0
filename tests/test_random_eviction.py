"""blockwise-random: the chance baseline at the same budget and block schedule as KeyDiff and SnapKV."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import get_adapter
from visualkv.errors import ConfigError
from visualkv.methods import METHODS, make_method, method_traits
from visualkv.runtime.session import ChatSession, SessionConfig

PROMPT = "What is in the picture?"
BUDGET = 24


def _kept(adapter, media, method, **options) -> list[frozenset[int]]:
    """Per layer, the visual token indices the first KV head holds after a block-wise prefill."""
    config = SessionConfig(
        method=method,
        budget=BUDGET,
        block_size=32,
        prefill="blockwise",
        max_new_tokens=1,
        method_options=options,
    )
    session = ChatSession(adapter, config)
    session.ask(PROMPT, media)
    visual = set(session.prepared.layout.seq_index.tolist())
    return [frozenset(set(layer.token_index[0, 0].tolist()) & visual) for layer in session.cache.layers]


@pytest.fixture(scope="module")
def qwen():
    return get_adapter("tiny-qwen2.5-vl")


def test_random_keeps_budget_and_differs_from_keydiff_and_snapkv(qwen, small_image):
    random_sets = _kept(qwen, small_image, "blockwise-random")
    assert all(len(s) == BUDGET for s in random_sets)
    for other in ("blockwise-keydiff", "blockwise-snapkv"):
        assert _kept(qwen, small_image, other) != random_sets


def test_same_seed_same_kept_set_other_seed_another(qwen, small_image):
    first = _kept(qwen, small_image, "blockwise-random", seed=7)
    assert _kept(qwen, small_image, "blockwise-random", seed=7) == first
    assert _kept(qwen, small_image, "blockwise-random", seed=8) != first
    assert _kept(qwen, small_image, "blockwise-random") == _kept(qwen, small_image, "blockwise-random", seed=0)


def test_kept_set_is_the_top_priorities_whatever_the_block_size(qwen, small_image):
    """Fixed priorities: the survivors of every block-wise eviction are the M highest priorities of all the
    visual tokens (a uniform sample), so the block size does not change them."""
    sets = []
    for block in (16, 64):
        config = SessionConfig(
            method="blockwise-random", budget=BUDGET, block_size=block, prefill="blockwise", max_new_tokens=1
        )
        session = ChatSession(qwen, config)
        session.ask(PROMPT, small_image)
        sets.append([frozenset(layer.token_index[0, 0].tolist()) for layer in session.cache.layers])
    assert sets[0] == sets[1]
    n = session.prepared.seq_len + 1  # the priorities as the method draws them, redrawn here from the seed
    priorities = torch.rand((qwen.num_layers, n), generator=torch.Generator().manual_seed(0))
    visual = torch.from_numpy(session.prepared.layout.seq_index).long()
    for layer_idx, kept in enumerate(sets[0]):
        top = visual[priorities[layer_idx, visual].topk(BUDGET).indices]
        assert set(top.tolist()) <= kept


def test_random_is_listed_and_refuses_bad_seeds_and_composition():
    assert METHODS["blockwise-random"].needs_budget
    with pytest.raises(ConfigError, match="seed"):
        make_method("blockwise-random", seed=-1)
    with pytest.raises(ConfigError, match="does not compose"):
        method_traits("blockwise-random+salicache")
