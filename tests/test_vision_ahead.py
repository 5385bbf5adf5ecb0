"""Encoding ahead (`SessionConfig.vision_ahead`): several blocks' media in one vision-tower call.

Each block's strip (image rows) or temporal patches (video) is its own sequence in that call, so the result must
be what a call per block gives: the same logits and answer, every patch through the tower once, fewer calls.
Every family encodes ahead: Qwen's strips and temporal patches as sequences of their own, the tile families' tiles
and frames, and LLaVA-OneVision's frames and (for images) tile rows, as images of their own.
"""

from __future__ import annotations

import pytest
import torch

from visualkv.bench.synthetic import image_media, video_media
from visualkv.errors import ConfigError
from visualkv.methods import method_traits
from visualkv.models.registry import load_model
from visualkv.runtime.memory_guard import estimate_prefill
from visualkv.runtime.session import ChatSession, SessionConfig

QWEN = ("tiny-qwen2.5-vl", "tiny-qwen3-vl")  # strips and temporal patches batched as separate sequences
TILES = ("tiny-smolvlm2", "tiny-internvl3.5")  # tiles and frames: independent images, batched together
#: LLaVA-OneVision: video frames batched; an image's tile rows (its map rows share them) and base image batched
FAMILIES = (*QWEN, *TILES, "tiny-llava-onevision")
AHEAD = [(name, kind) for name in FAMILIES for kind in ("image", "video")]
METHODS = ("blockwise-keydiff", "blockwise-snapkv", "blockwise-keydiff+salicache", "lightkv")


@pytest.fixture(scope="module")
def media():
    # 1920x1080: ~39 token rows, blocks of 512 tokens read ~7 rows each (Qwen2.5-VL: windows of 4 rows)
    return {"image": image_media(1920, 1080, seed=3), "video": video_media(24, 320, 180, seed=2)}


_ADAPTERS: dict[str, object] = {}


def _adapter(name: str):
    if name not in _ADAPTERS:
        _ADAPTERS[name] = load_model(name)
    return _ADAPTERS[name]


def _turn(adapter, media, method: str, ahead: int):
    """(first logits, answer ids, tower calls, patches through the tower) of one blockwise turn."""
    calls: list[int] = []
    inner = adapter.model.model
    tower = getattr(adapter, "visual", None) or getattr(inner, "vision_model", None) or inner.vision_tower
    forward = tower.forward if tower is not None else None
    if tower is not None:

        def counted(*args, **kwargs):
            pixels = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
            calls.append(int(pixels.shape[0]))  # patches (Qwen) or images (the tile families)
            return forward(*args, **kwargs)

        tower.forward = counted
    try:
        block = 512 if media.kind == "image" else 128
        cfg = SessionConfig(
            method=method, budget=64, block_size=block, prefill="blockwise", max_new_tokens=4, vision_ahead=ahead
        )
        session = ChatSession(adapter, cfg)
        record = session.ask("What is in the picture?", media)
    finally:
        if tower is not None:
            del tower.forward  # back to the class's method
    return session.prefill_result.logits, record.token_ids, len(calls), sum(calls), session


@pytest.mark.parametrize(("name", "kind"), AHEAD)
@pytest.mark.parametrize("method", METHODS)
def test_encoding_ahead_changes_nothing_but_the_number_of_calls(media, name, kind, method):
    adapter = _adapter(name)
    logits_1, ids_1, calls_1, patches_1, _ = _turn(adapter, media[kind], method, 1)
    logits_4, ids_4, calls_4, patches_4, session = _turn(adapter, media[kind], method, 4)
    assert torch.allclose(logits_1, logits_4, atol=1e-5, rtol=0), (logits_1 - logits_4).abs().max()
    assert ids_1 == ids_4
    assert patches_4 == patches_1  # every patch through the tower once: nothing encoded twice or for nothing
    assert calls_4 < calls_1, (calls_1, calls_4)
    held = (adapter._ahead_strips, adapter._ahead_frames) if name in QWEN else (adapter._ahead_units,)
    assert not any(held) and getattr(adapter, "_ahead_base", None) is None  # nothing left held after the prefill
    assert session.report()["config"]["vision_ahead"] == 4  # recorded in the report


def test_llava_onevision_image_tile_rows_are_each_encoded_once_ahead(media):
    """Its map rows share rows of tiles: encoded ahead, a tile row read by two blocks still goes through the
    tower once (the buffer holds it), and the base image joins the first call."""
    adapter = _adapter("tiny-llava-onevision")
    prepared = adapter.prepare(media["image"], "What is in the picture?")
    geometry = prepared.vision_inputs["geometry"]
    logits_1, ids_1, calls_1, tiles_1, _ = _turn(adapter, media["image"], "blockwise-keydiff", 1)
    # 8 blocks: several tile rows in one call (4 read one new tile row each on this small map)
    logits_8, ids_8, calls_8, tiles_8, _ = _turn(adapter, media["image"], "blockwise-keydiff", 8)
    assert torch.allclose(logits_1, logits_8, atol=1e-5, rtol=0) and ids_1 == ids_8
    assert tiles_1 == tiles_8 == 1 + geometry.tile_rows * geometry.tile_cols  # the base image and every tile
    assert calls_1 == 1 + geometry.tile_rows  # block by block: the base image, then a call per tile row
    assert calls_8 < calls_1, (calls_1, calls_8)


def test_the_memory_guard_counts_the_larger_tower_call(media):
    def vision_bytes(name: str, ahead: int, kind: str = "video") -> int:
        adapter = _adapter(name)
        prepared = adapter.prepare(media[kind], "What happens?")
        cls = method_traits("blockwise-keydiff")
        return estimate_prefill(adapter, prepared, cls, 64, 128, "blockwise", ahead).vision_bytes

    assert vision_bytes("tiny-qwen2.5-vl", 4) > vision_bytes("tiny-qwen2.5-vl", 1)
    assert vision_bytes("tiny-smolvlm2", 4) > vision_bytes("tiny-smolvlm2", 1)
    assert vision_bytes("tiny-llava-onevision", 4) > vision_bytes("tiny-llava-onevision", 1)
    # its image: a block may read two of its three tile rows already; 64 blocks (all) read every one, in one call
    assert vision_bytes("tiny-llava-onevision", 64, "image") > vision_bytes("tiny-llava-onevision", 1, "image")


def test_vision_ahead_below_one_is_refused():
    with pytest.raises(ConfigError, match="vision_ahead .* from 1 to 64"):
        SessionConfig(vision_ahead=0).validate()


def test_a_stopped_prefill_leaves_nothing_encoded_ahead(media):
    import threading

    from visualkv.errors import PrefillStopped

    adapter = _adapter("tiny-qwen2.5-vl")
    cfg = SessionConfig(method="blockwise-keydiff", budget=64, block_size=128, prefill="blockwise", vision_ahead=8)
    stop = threading.Event()
    session = ChatSession(adapter, cfg)
    with pytest.raises(PrefillStopped):
        # stopped after the first block with frames: the next seven blocks' frames were encoded with it
        stream = session.stream(
            "What happens?", media["video"], on_block=lambda e: e.visual_tokens_in and stop.set(), stop=stop
        )
        list(stream)
    assert not adapter._ahead_frames and adapter._strip is None
