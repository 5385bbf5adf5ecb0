"""The prefill plan the engine runs and the memory guard sizes (visualkv.runtime.plan)."""

from __future__ import annotations

import pytest

from visualkv.layout import Block
from visualkv.runtime.plan import PrefillPlan


def _blocks(media: str) -> list[Block]:
    """Blocks in order, "m" with media (one unit each, a placeholder), "t" text only."""
    return [
        Block(i, "frame" if c == "m" else "text", i, i + 1, [object()] if c == "m" else []) for i, c in enumerate(media)
    ]


@pytest.mark.parametrize("media", ["mmmmmmm", "tmmtmmmt", "ttt", "mtttttm"])
@pytest.mark.parametrize("ahead", [2, 3])
def test_tower_calls_encode_every_block_with_media_once(media, ahead):
    """Each block with media falls in exactly one call, which starts at a block with media and spans at most
    `ahead` blocks; calls follow each other in order."""
    blocks = _blocks(media)
    calls = PrefillPlan("blockwise", 1, blocks, ahead).tower_calls()
    covered = [j for start in sorted(calls) for j in calls[start] if blocks[j].units]
    assert covered == [i for i, c in enumerate(media) if c == "m"]
    for start, call in calls.items():
        assert media[start] == "m" and call.start == start and len(call) <= ahead


def test_one_block_per_call_needs_no_plan():
    assert PrefillPlan("blockwise", 1, _blocks("mmm"), 1).tower_calls() == {}
