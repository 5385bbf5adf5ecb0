"""Lazy video decoding, bounded memory and frame caps that follow the method."""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.test_media import corrupt_mjpeg, noise_frames, write_video
from visualkv.bench.synthetic import video_media, write_video_file
from visualkv.errors import MediaError
from visualkv.media import FrameSampling, LazyFrames, MediaLimits, load_media, readers, resize_to_width
from visualkv.media.saliency import MotionConfig, frame_decisions
from visualkv.runtime.frame_cap import FULL_FRAME_CAP, is_bounded, media_limits

ROOT = Path(__file__).resolve().parent.parent
ALL = FrameSampling(fps=10.0, max_frames=None)
NO_CAP = MediaLimits(max_frames=None)


@pytest.fixture(scope="module")
def video(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """12 s at 10 fps, 160x90, panning."""
    return Path(write_video_file(str(tmp_path_factory.mktemp("lazy") / "pan.mp4"), 120, 160, 90, fps=10.0))


@pytest.mark.parametrize("backend", ["decord", "opencv"])
def test_lazy_frames_equal_eager_frames(video: Path, backend: str) -> None:
    lazy = load_media(video, NO_CAP, ALL, backend=backend)
    eager = load_media(video, NO_CAP, ALL, backend=backend, lazy=False)
    assert lazy.is_lazy and not eager.is_lazy and isinstance(lazy.frames, LazyFrames)
    assert lazy.frames.decoded == 1  # loading decodes the first frame only (validity and size)
    assert lazy.size == eager.size == (160, 90) and lazy.num_frames == eager.num_frames == 120
    assert lazy.times == eager.times and lazy.frame_indices == eager.frame_indices and lazy.backend == backend
    # random access, negative indices and slices give the same pixels as decoding everything up front
    for k in (5, 0, 119, -1, 60, 61):
        assert np.array_equal(lazy.frames[k], eager.frames[k])
    assert all(np.array_equal(a, b) for a, b in zip(lazy.frames[40:50], eager.frames[40:50], strict=True))
    assert np.stack(lazy.frames[10:12]).shape == (2, 90, 160, 3)
    with pytest.raises(IndexError):
        lazy.frames[120]


def test_lazy_frames_stay_bounded_and_are_not_decoded_twice(video: Path) -> None:
    frames = load_media(video, NO_CAP, ALL).frames
    assert isinstance(frames, LazyFrames)
    frames.clear_cache()
    start = frames.decoded
    for t in range(len(frames) // 2):  # a Qwen temporal patch: the pair, then each frame again
        pair = np.stack(frames[2 * t : 2 * t + 2])
        assert np.array_equal(pair[1], frames[2 * t + 1]) and np.array_equal(pair[0], frames[2 * t])
        del pair
    assert frames.decoded - start == len(frames)  # each frame decoded once
    # decoded arrays alive anywhere (cache + the caller's) never exceed the cache plus one pair
    assert frames.peak_live_frames <= frames.cache_size + 2
    assert frames.cached_bytes <= frames.cache_size * 160 * 90 * 3


def test_iter_small_streams_and_gives_the_saliency_pass_the_same_decisions(video: Path) -> None:
    lazy = load_media(video, NO_CAP, ALL)
    eager = load_media(video, NO_CAP, ALL, lazy=False)
    lazy.frames.clear_cache()
    before = lazy.frames.peak_live_frames
    small = list(lazy.iter_small(80))
    assert [s.shape for s in small[:2]] == [(45, 80, 3)] * 2
    assert all(np.array_equal(s, resize_to_width(f, 80)) for s, f in zip(small, eager.frames, strict=True))
    assert lazy.frames.peak_live_frames <= max(before, 1)  # one full-size frame at a time, cache untouched
    cfg = MotionConfig(downscale_width=80)
    assert frame_decisions(lazy.iter_small(80), cfg) == frame_decisions(eager.frames, cfg)


@pytest.mark.parametrize("backend", ["auto", "opencv"])
def test_undecodable_frame_is_replaced_by_the_previous_one_with_a_warning(tmp_path: Path, backend: str) -> None:
    path = corrupt_mjpeg(write_video(tmp_path / "one_bad.avi", noise_frames(10), fourcc="MJPG"), frames=[5])
    loaded = load_video_lazily(path, backend)
    assert loaded.frame_indices == list(range(10)) and not loaded.warnings  # not known before decoding
    frames = [loaded.frames[k] for k in range(10)]
    assert loaded.warnings == ["frame 5 (t=1.25 s) could not be decoded; frame 4 (t=1.00 s) shown in its place"]
    assert np.array_equal(frames[5], frames[4])
    reference = noise_frames(10)
    errors = [np.abs(frames[6].astype(int) - reference[k].astype(int)).mean() for k in (5, 6, 7)]
    assert errors[1] < 0.8 * min(errors[0], errors[2])  # frame 6 is still frame 6
    loaded.frames[5]
    assert len(loaded.warnings) == 1  # warned once


def test_undecodable_first_frames_take_the_first_decodable_one(tmp_path: Path) -> None:
    path = corrupt_mjpeg(write_video(tmp_path / "bad_start.avi", noise_frames(6), fourcc="MJPG"), frames=[0, 1])
    loaded = load_video_lazily(path, "opencv")
    assert np.array_equal(loaded.frames[0], loaded.frames[2]) and len(loaded.warnings) == 2
    broken = corrupt_mjpeg(write_video(tmp_path / "all_bad.avi", noise_frames(4), fourcc="MJPG"), frames=None)
    with pytest.raises(MediaError, match="no decodable frame"):
        load_video_lazily(broken, "opencv")


def load_video_lazily(path: Path, backend: str):
    return load_media(path, sampling=FrameSampling(fps=4.0, max_frames=None), backend=backend)


def test_opencv_failing_on_a_frame_falls_back_to_decord_lazily(video: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    eager = load_media(video, NO_CAP, ALL, lazy=False)
    original = readers.OpenCVReader.read
    tried: list[int] = []

    def failing_on_60(self, i):
        tried.append(i)
        return None if i == 60 else original(self, i)

    monkeypatch.setattr(readers.OpenCVReader, "read", failing_on_60)
    lazy = load_media(video, NO_CAP, ALL)
    assert np.abs(lazy.frames[60].astype(int) - eager.frames[60].astype(int)).mean() < 2
    assert tried == [0, 60] and lazy.frames.backends_used == {"decord", "opencv"} and not lazy.warnings


# --------------------------------------------------------------------------------------------
# A lazy video crosses a process boundary as a reader, not as frames


def halve(frame: np.ndarray) -> np.ndarray:
    """A resize at decode that pickles (a module-level function), for a resized view."""
    return np.ascontiguousarray(frame[::2, ::2])


def all_frames(media) -> list[np.ndarray]:
    return [media.frames[k] for k in range(media.num_frames)]


def frames_after_unpickling(payloads: list[bytes]) -> list[list[np.ndarray]]:
    """Each pickled Media's frames, decoded where this runs (a spawned process in the test)."""
    return [all_frames(pickle.loads(payload)) for payload in payloads]


def test_a_lazy_video_pickles_as_a_reader_and_decodes_the_same_frames_elsewhere(video: Path, tmp_path: Path) -> None:
    """A lazily decoded video pickles as what reopens its file (a few kilobytes, no open reader, lock or frame):
    plain, resized at decode, and with an undecodable frame (pickled before that frame was met, and after),
    unpickled here and in a freshly spawned process, it gives the frames it gives in this process."""
    plain = load_media(video, NO_CAP, ALL)
    resized = plain.resized_at_decode((45, 80), halve)
    bad = corrupt_mjpeg(write_video(tmp_path / "one_bad.avi", noise_frames(10), fourcc="MJPG"), frames=[5])
    unmet, met = load_video_lazily(bad, "opencv"), load_video_lazily(bad, "opencv")
    assert resized.frames.is_resized and not unmet.warnings
    plain.frames[:4], resized.frames[:4]  # frames in their caches: not pickled
    payloads = {"plain": pickle.dumps(plain), "resized": pickle.dumps(resized), "unmet": pickle.dumps(unmet)}
    eager = all_frames(load_media(video, NO_CAP, ALL, lazy=False))  # decoded up front: not the lazy path
    expected = {"plain": eager, "resized": [halve(f) for f in eager], "unmet": all_frames(unmet)}
    expected["met"] = all_frames(met)
    payloads["met"] = pickle.dumps(met)
    assert np.array_equal(expected["met"][5], expected["met"][4]) and len(met.warnings) == 1
    # far below the decoded frames' bytes, counted from the decoded frame shape
    height, width, channels = eager[0].shape
    assert len(payloads["plain"]) < plain.num_frames * height * width * channels / 1000
    assert len(payloads["resized"]) < plain.num_frames * (height // 2) * (width // 2) * channels / 200
    copies = {name: pickle.loads(payload) for name, payload in payloads.items()}
    assert all(c.is_lazy and c.frames.decoded == 0 and c.frames.cached_bytes == 0 for c in copies.values())
    here = {name: all_frames(c) for name, c in copies.items()}
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        spawned = dict(zip(payloads, pool.apply(frames_after_unpickling, (list(payloads.values()),)), strict=True))
    for name, frames in expected.items():
        for decoded in (here[name], spawned[name]):
            assert len(decoded) == len(frames) and all(map(np.array_equal, decoded, frames)), name
    # the stand-in for the undecodable frame, and its warning, found by the copy or carried with it
    assert copies["unmet"].warnings == copies["met"].warnings == met.warnings
    assert copies["resized"].frames.frame_shape == (45, 80, 3)
    # a resized view and its base, pickled together, share one decoder and one lock again
    both = pickle.loads(pickle.dumps([plain, resized]))
    assert both[1].frames._base is both[0].frames
    assert both[1].frames._decoder is both[0].frames._decoder and both[1].frames._lock is both[0].frames._lock


def test_a_copy_of_a_lazy_video_is_the_same_reader(video: Path) -> None:
    """copy.copy gives the reader itself: a second one on the same decoder would close it when collected."""
    import copy
    import gc

    media = load_media(video, NO_CAP, ALL)
    assert copy.copy(media.frames) is media.frames
    copy.copy(media)  # a Media copy holds the same frames
    gc.collect()
    assert media.frames[3].shape == media.frames.frame_shape


# --------------------------------------------------------------------------------------------
# Frame caps follow the method


def test_frame_cap_follows_the_method(tmp_path: Path) -> None:
    path = write_video_file(str(tmp_path / "long.mp4"), FULL_FRAME_CAP + 88, 64, 36, fps=10.0)
    assert is_bounded("blockwise-keydiff") and is_bounded("blockwise-snapkv") and not is_bounded("full")
    with pytest.raises(MediaError) as refused:
        load_media(path, media_limits("full"), ALL)
    message = str(refused.value)
    assert "\n" not in message and "600 frames" in message and "capped at 512" in message
    assert "'full'" in message and "blockwise-keydiff or blockwise-snapkv" in message
    bounded = load_media(path, media_limits("blockwise-keydiff"), ALL)
    assert bounded.num_frames == 600 and bounded.frames.decoded == 1
    # the caller's own cap (--max-frames) still resamples uniformly, for any method
    assert load_media(path, media_limits("full"), FrameSampling(fps=10.0, max_frames=64)).num_frames == 64


def test_session_refuses_too_many_frames_for_an_unbounded_method() -> None:
    from visualkv.models.registry import load_model
    from visualkv.runtime.session import ChatSession, SessionConfig

    adapter = load_model("tiny-qwen2.5-vl")
    media = video_media(FULL_FRAME_CAP + 2, 32, 32)
    with pytest.raises(MediaError, match="capped at 512 frames"):
        ChatSession(adapter, SessionConfig(method="full")).ask("What?", media)


def test_cli_refuses_on_one_line_before_loading_the_model(tmp_path: Path) -> None:
    path = write_video_file(str(tmp_path / "long.mp4"), 600, 64, 36, fps=10.0)
    cmd = [sys.executable, "-m", "visualkv", "run", "--model", "no-such-model", "--media", path, "--fps", "10"]
    proc = subprocess.run([*cmd, "--prompt", "What?"], capture_output=True, text=True, cwd=ROOT, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "capped at 512 frames" in proc.stderr and "blockwise-keydiff" in proc.stderr


# --------------------------------------------------------------------------------------------
# Token ids built without tokenizing one pad per visual token


@pytest.mark.parametrize(
    ("model", "module"),
    [
        ("tiny-qwen2.5-vl", "qwen2_5_vl"),
        ("tiny-qwen3-vl", "qwen3_vl"),
        ("tiny-smolvlm2", "smolvlm"),
        ("tiny-llava-onevision", "llava_onevision"),
        ("tiny-internvl3.5", "internvl"),
    ],
)
def test_spliced_pad_ids_equal_tokenizing_the_expanded_prompt(
    model: str, module: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib

    from visualkv.models.registry import load_model

    adapter = load_model(model)
    media = video_media(6, 160, 90)
    fast = adapter.prepare(media, "What happens?").input_ids
    longest = []
    tokenizer = adapter.tokenizer
    original_call = type(tokenizer).__call__

    def reference_splice(tok, text, token, lengths):
        parts = text.split(token)
        expanded = parts[0] + "".join(token * n + rest for n, rest in zip(lengths, parts[1:], strict=True))
        return original_call(tok, expanded, add_special_tokens=False, return_tensors="pt")["input_ids"][0]

    def reference_runs(tok, text, token):
        return original_call(tok, text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]

    adapter_module = importlib.import_module(f"visualkv.models.{module}")
    for name, ref in (("splice_runs", reference_splice), ("tokenize_runs", reference_runs)):
        if hasattr(adapter_module, name):
            monkeypatch.setattr(adapter_module, name, ref)
    slow = adapter.prepare(media, "What happens?").input_ids
    monkeypatch.undo()
    assert torch.equal(fast, slow) and int(adapter.prepare(media, "What happens?").visual_mask.sum()) > 40

    def recording_call(tok, text, *args, **kwargs):
        longest.append(len(text) if isinstance(text, str) else max(len(t) for t in text))
        return original_call(tok, text, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "__call__", recording_call)
    adapter.prepare(media, "What happens?")
    assert max(longest) < 1200  # the fast path never tokenizes the pad runs themselves


# --------------------------------------------------------------------------------------------
# Peak RSS does not grow with the video (each length in a fresh process)

_RSS_SCRIPT = """
import gc, json, re, sys
from visualkv.media import FrameSampling, load_media
from visualkv.runtime.frame_cap import media_limits
from visualkv.models.registry import load_model
from visualkv.runtime.session import ChatSession, SessionConfig

def status(key):
    return int(re.search(key + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024

adapter = load_model("tiny-qwen2.5-vl")
config = SessionConfig(method="blockwise-keydiff", budget=64, block_size=72, max_new_tokens=1)
sampling, lazy = FrameSampling(fps=10.0, max_frames=None), sys.argv[3] == "lazy"
ChatSession(adapter, config).ask("What?", load_media(sys.argv[2], media_limits(config.method), sampling))  # warm-up
gc.collect()
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS: the peak of what follows alone
before = status("VmRSS")
media = load_media(sys.argv[1], media_limits(config.method), sampling, lazy=lazy)
session = ChatSession(adapter, config)
session.ask("What happens?", media)
report = session.report()
print(json.dumps({
    "frames": media.num_frames, "visual_tokens": report["visual_tokens"], "peak": status("VmHWM") - before,
    "block_rss": [b["rss_bytes"] - before for b in report["blocks"]],
    "peak_live_frames": media.frames.peak_live_frames if lazy else media.num_frames,
}))
"""


def _turn_memory(video: str, warm: str, mode: str = "lazy") -> dict:
    """Peak RSS growth of loading `video` and prefilling it (blockwise-keydiff, tiny-qwen2.5-vl) in a fresh
    process. glibc's malloc is told to return freed large blocks (fixed mmap threshold, one arena), so RSS
    follows live memory rather than the allocator's retained free lists (±40 MB of noise otherwise)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "1"}
    cmd = [sys.executable, "-c", _RSS_SCRIPT, video, warm, mode]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's VmHWM reset")
def test_rss_stays_flat_over_a_long_video(tmp_path: Path) -> None:
    warm = write_video_file(str(tmp_path / "warm.mp4"), 20, 160, 90, fps=10.0, seed=1)
    run = _turn_memory(write_video_file(str(tmp_path / "long.mp4"), 600, 160, 90, fps=10.0, seed=6), warm)
    series = run["block_rss"]
    assert run["frames"] == 600 and len(series) > 60
    assert run["peak_live_frames"] <= 8 + 4  # one block's frames (72 tokens / 18 per patch x 2) + the cache
    # RSS reaches its steady state within ~10 blocks (allocator and cache warm-up), then stays flat while
    # the last third of the video (200 frames, 8.6 MB decoded) goes through: nothing per frame is kept
    third = len(series) // 3
    frames_bytes = 200 * 160 * 90 * 3
    assert max(series[2 * third :]) - max(series[third : 2 * third]) < 0.25 * frames_bytes, series


def test_report_leaves_out_per_layer_fractions_beyond_its_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    from visualkv.models.registry import load_model
    from visualkv.runtime import session as session_module
    from visualkv.runtime.session import ChatSession, SessionConfig

    adapter = load_model("tiny-qwen2.5-vl")
    config = SessionConfig(method="blockwise-keydiff", budget=8, max_new_tokens=1)
    session = ChatSession(adapter, config)
    session.ask("What?", video_media(8, 64, 64))
    report = session.report()
    values = adapter.num_layers * report["visual_tokens"]
    assert len(report["retained_per_layer"]) == adapter.num_layers and "retained_per_layer_omitted" not in report
    monkeypatch.setattr(session_module, "REPORT_PER_LAYER_VALUES", values - 1)
    compact = session.report()
    assert "retained_per_layer" not in compact and f"{values:,} values" in compact["retained_per_layer_omitted"]
    assert compact["retained"] == report["retained"]  # the average over layers stays


def _in_forked_child(media, parent_frame, parent_reader: int, conn) -> None:
    """Run in a forked child: the parent's open reader (by id: a fork keeps addresses) is left alone, the child
    opens its own."""
    from visualkv.media import readers

    decoder = media.frames._decoder
    inherited = decoder._opencv is None and parent_reader in map(id, readers._INHERITED)
    same = np.array_equal(media.frames[media.num_frames - 1], parent_frame)
    del media, decoder
    gc.collect()  # the parent's video, garbage here: freeing its inherited reader would hang
    conn.send((inherited, same))


def test_a_forked_child_leaves_the_parents_video_readers_alone(video: Path) -> None:
    """A ZeroGPU worker is forked from the app: the app's open video readers come with it, their decoding threads
    do not, and freeing one there hangs. The child keeps them unfreed and reads with readers of its own."""
    media = load_media(video, NO_CAP, ALL)
    first, last = media.frames[0], media.frames[media.num_frames - 1]
    assert media.frames._decoder._opencv is not None  # open in the parent
    context = multiprocessing.get_context("fork")
    parent, child = context.Pipe(duplex=False)
    reader = id(media.frames._decoder._opencv)
    process = context.Process(target=_in_forked_child, args=(media, last, reader, child))
    process.start()
    child.close()
    process.join(timeout=60)
    if process.is_alive():
        process.kill()
    assert process.exitcode == 0 and parent.recv() == (True, True)
    assert np.array_equal(media.frames[0], first)  # the parent's reader still works
