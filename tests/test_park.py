"""Parked sessions (visualkv.runtime.park): between turns a chat's state waits on the host and crosses a process
boundary by pickling; a follow-up after a park is bit-identical to one without.

The model runs on the pretend GPU of tests/fake_cuda.py, so a tensor a park leaves on the "device" is seen (a
CPU-only run could not tell the host from the device) and a tensor an unpark leaves on the host fails the turn.
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from tests.conftest import FAMILIES, cache_entries
from tests.fake_cuda import FakeCudaTensor, fake_cuda, fake_cuda_adapter
from tests.test_invariants import METHODS_ALL
from visualkv.bench.synthetic import write_video_file
from visualkv.errors import MediaError
from visualkv.media import FrameSampling, load_media
from visualkv.methods import method_traits
from visualkv.runtime.park import (
    ParkedState,
    adopt_state,
    device_tensors,
    export_state,
    portable_media,
    resolve_park,
)
from visualkv.runtime.session import ChatSession, SessionConfig

QUESTIONS = ("What is in the picture?", "And in the corner?", "What colour is it?")


def _config(method: str, park: str, **extra) -> SessionConfig:
    budget = 40 if method_traits(method).needs_budget else None
    extra.setdefault("decode", "static")  # a CUDA graph cannot be captured on the pretend GPU
    return SessionConfig(method=method, budget=budget, block_size=64, max_new_tokens=4, park_cache=park, **extra)


def _through_pickle(session: ChatSession) -> ChatSession:
    """The session as another process gets it: its parked state pickled, adopted by a fresh session."""
    parked = export_state(session)
    assert device_tensors(parked) == [], "a parked state holds a tensor off the host"
    copy = pickle.loads(pickle.dumps(parked))
    assert isinstance(copy, ParkedState)
    fresh = ChatSession(session.adapter, copy.config)
    adopt_state(fresh, copy)
    return fresh


def _counts(block: dict) -> dict:
    """A block event's counts (its seconds and memory readings differ run to run)."""
    return {k: v for k, v in block.items() if k not in ("seconds", "rss_bytes", "cuda_allocated_bytes")}


def _conversation(adapter, config: SessionConfig, media, parked: bool) -> ChatSession:
    session = ChatSession(adapter, config)
    session.ask(QUESTIONS[0], media)
    for question in QUESTIONS[1:]:
        if parked:
            session = _through_pickle(session)
        session.ask(question)
    return session


@pytest.mark.parametrize("method", METHODS_ALL)
def test_a_parked_followup_equals_an_unparked_one(method, small_image, small_video):
    """Every method on an image (greedy), and the methods that skip frames on a video too (sampled): the same
    tokens, the same cache, entry for entry."""
    adapter = fake_cuda_adapter(FAMILIES[0])
    # the image's answers run the fixed-shape step a CUDA graph would capture, the video's plain steps
    runs = [(small_image, 0.0, "static")] + ([(small_video, 0.7, "eager")] if "salicache" in method else [])
    for media, temperature, decode in runs:
        settings = {"temperature": temperature, "decode": decode}
        with fake_cuda():
            kept = _conversation(adapter, _config(method, "never", **settings), media, parked=False)
            moved = _conversation(adapter, _config(method, "always", **settings), media, parked=True)
            assert isinstance(kept.cache.layers[0].keys, FakeCudaTensor)  # the reference never left the device
            moved_report, kept_report = moved.report(), kept.report()
        assert [t.token_ids for t in moved.turns] == [t.token_ids for t in kept.turns]
        assert len(moved.turns) == len(QUESTIONS) and all(len(t.token_ids) for t in moved.turns)
        ours, reference = cache_entries(moved), cache_entries(kept)
        assert len(ours) == len(reference) > 0
        assert all(torch.equal(a, b) for a, b in zip(ours, reference))
        for key in ("final_kv_bytes", "peak_kv_bytes", "retained_per_layer"):
            assert moved_report[key] == kept_report[key], key
        assert [_counts(b) for b in moved_report["blocks"]] == [_counts(b) for b in kept_report["blocks"]]
        assert moved_report["park"]["parked"] and not kept_report["park"]["parked"]


def test_a_reprefill_after_a_park_equals_one_without(small_image):
    """A follow-up that rebuilds the media cache reads the parked prepared input and media."""
    adapter = fake_cuda_adapter(FAMILIES[0])
    with fake_cuda():
        kept = _conversation(adapter, _config("blockwise-snapkv", "never", followup="reprefill"), small_image, False)
        moved = _conversation(adapter, _config("blockwise-snapkv", "always", followup="reprefill"), small_image, True)
    assert [t.token_ids for t in moved.turns] == [t.token_ids for t in kept.turns]
    assert all(torch.equal(a, b) for a, b in zip(cache_entries(moved), cache_entries(kept)))


@pytest.mark.parametrize("method", ["salicache", "lightkv"])
def test_a_parked_session_holds_no_device_tensor(method, small_video):
    """After a turn with park_cache="always" the whole state is on the host, packed tiers included, and the
    report says how many bytes were parked and how long the moves took."""
    adapter = fake_cuda_adapter(FAMILIES[0])
    with fake_cuda():
        session = ChatSession(adapter, _config(method, "always"))
        session.ask(QUESTIONS[0], small_video)
    state = {name: getattr(session, name) for name in ("cache", "prepared", "prefill_result", "method")}
    assert device_tensors(state) == []
    if method == "salicache":
        assert any(layer.quant for layer in session.cache.layers)  # packed tiers were parked too
    report = session.report()
    assert report["park"]["parked"]
    assert report["park"]["moved_bytes"] >= report["final_kv_bytes"] + report["index_bytes"] > 0
    assert report["park"]["parked_bytes"] >= report["park"]["moved_bytes"]
    pickle.loads(pickle.dumps(export_state(session)))
    with fake_cuda():
        session.ask(QUESTIONS[1])  # the next turn moves it back to the device and parks it again
    assert device_tensors({"cache": session.cache}) == [] and session.park_stats.unpark_seconds > 0


def test_auto_parks_on_zero_gpu_and_in_shared_mode():
    assert resolve_park("auto", {"SPACES_ZERO_GPU": "true"})
    assert resolve_park("auto", {"SPACE_ID": "someone/visualkv"})
    assert not resolve_park("auto", {})
    assert resolve_park("always", {}) and not resolve_park("never", {"SPACES_ZERO_GPU": "1"})


def test_a_lazy_video_crosses_as_itself_while_its_file_is_there(tmp_path):
    path = write_video_file(str(tmp_path / "gone.mp4"), 8, 64, 48, fps=4.0)
    media = load_media(path, sampling=FrameSampling(fps=1.0))
    assert media.is_lazy and portable_media(media) is media
    os.remove(path)  # an upload the server has cleaned up
    with pytest.raises(MediaError, match="gone.mp4': the video's file is gone from the server; upload it again"):
        portable_media(media)


def test_a_follow_up_of_a_chat_whose_video_file_is_gone_is_one_line(tmp_path):
    """A follow-up's call reopens the chat's video (not passed again): its export says the upload is gone, and a
    copy that reads a frame after its file went says the same, not that a frame could not be decoded."""
    path = write_video_file(str(tmp_path / "gone.mp4"), 8, 64, 48, fps=4.0)
    media = load_media(path, sampling=FrameSampling(fps=1.0))
    session = ChatSession(fake_cuda_adapter(FAMILIES[0]), _config("blockwise-keydiff", "always"))
    with fake_cuda():
        session.ask(QUESTIONS[0], media)
    export_state(session)  # the file is there: the state crosses
    copy = pickle.loads(pickle.dumps(media))
    os.remove(path)
    with pytest.raises(MediaError, match="gone.mp4': the video's file is gone from the server"):
        export_state(session)
    with pytest.raises(MediaError, match="gone.mp4': the video's file is gone from the server"):
        copy.frames[media.num_frames - 1]
    assert not copy.warnings  # no frame was taken for undecodable
