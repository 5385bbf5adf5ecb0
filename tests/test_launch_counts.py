"""Kernel launches and host reads per prefill block do not grow with the number of blocks.

`visualkv.bench.launches.counting_blocks` counts, on CPU, what each prefill block dispatches (ATen operations
that would launch a GPU kernel) and reads back to the host, split into the vision tower, the rest of the block's
embeddings and the layer loop (decoder layers with the method's scoring and eviction). A video of 2, 4 and 8
temporal patches, one per block: the blocks are alike, so every block after the first (which fills the cache
below the budget) must cost exactly what it costs in the shortest video, whatever the number of blocks before
it. The vision tower makes one attention call per layer and two host reads per call (its two chunk layouts);
the layer loop reads nothing.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.conftest import get_adapter
from visualkv.bench.launches import BlockCount, counting_blocks
from visualkv.bench.synthetic import video_media
from visualkv.runtime.session import ChatSession, SessionConfig

BLOCKS = (2, 4, 8)


def _block_counts(alias: str, method: str, n_blocks: int) -> list[BlockCount]:
    """Counts of the blocks holding media, for a video of `n_blocks` temporal patches, one per block."""
    adapter = get_adapter(alias)
    media = video_media(2 * n_blocks, 224, 168, fps=1.0, seed=2)
    unit = adapter.prepare(media, "What is in it?").layout.units[0]
    per_block = unit.seq_end - unit.seq_start  # one temporal patch per block
    config = SessionConfig(method=method, budget=per_block, block_size=per_block, max_new_tokens=1)
    session = ChatSession(adapter, config)
    with counting_blocks(session.engine) as counts:
        session.ask("What is in it?", media)
    visual = [c for c in counts if c.visual_tokens]
    assert len(visual) == n_blocks
    return visual


def _growth(by_blocks: dict[int, list[BlockCount]]) -> list[str]:
    """Blocks whose counts differ from the same block of the shortest run (the first block) or from its later
    blocks (every other): what grew (or shrank) with the number of blocks."""

    def counted(c: BlockCount) -> BlockCount:  # Qwen3-VL's timestamps ("<10.0 seconds>") vary a block's tokens
        return dataclasses.replace(c, tokens=0)

    shortest = [counted(c) for c in by_blocks[min(by_blocks)]]
    problems = []
    for n, counts in by_blocks.items():
        for i, count in enumerate(map(counted, counts)):
            expected = shortest[0] if i == 0 else shortest[1]
            if count != expected:
                problems.append(f"{n} blocks, block {i}: {count} != {expected}")
    return problems


@pytest.mark.parametrize(
    ("alias", "method"),
    [
        ("tiny-qwen2.5-vl", "blockwise-keydiff"),
        ("tiny-qwen2.5-vl", "blockwise-snapkv"),
        ("tiny-qwen3-vl", "blockwise-keydiff"),
    ],
)
def test_launches_and_reads_per_block_are_constant(alias, method):
    _block_counts(alias, method, 1)  # a first call sets up lazily what later calls reuse (processor state)
    by_blocks = {n: _block_counts(alias, method, n) for n in BLOCKS}
    assert _growth(by_blocks) == []
    depth = len(get_adapter(alias).visual.blocks)
    for count in by_blocks[max(BLOCKS)]:
        assert count.layer_kernels > 0 and count.vision_kernels > 0  # something is counted
        assert count.vision_attention_calls == depth  # one attention call per vision layer
        assert count.vision_reads <= 2  # one per distinct chunk layout (windows, whole frames)
        assert count.layer_reads == 0


def test_a_cost_that_grows_with_the_blocks_is_caught(monkeypatch):
    """The check itself: one extra operation per block already in the cache, in the first decoder layer."""
    adapter = get_adapter("tiny-qwen2.5-vl")
    cached = {"blocks": 0}

    def per_cached_block(module, args, output) -> None:
        for _ in range(cached["blocks"]):
            torch.zeros(1).add_(1)
        cached["blocks"] += 1

    hook = adapter.layers[0].register_forward_hook(per_cached_block)
    try:
        by_blocks = {}
        for n in (1, 2, 3):
            cached["blocks"] = 0
            by_blocks[n] = _block_counts("tiny-qwen2.5-vl", "blockwise-keydiff", n)
    finally:
        hook.remove()
    del by_blocks[1]  # the warm-up
    assert _growth(by_blocks) != []
