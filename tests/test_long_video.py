"""The hour-scale benchmark's generated videos and its summary (the benchmark itself is a command)."""

from __future__ import annotations

import itertools

import cv2
import numpy as np
import pytest

from visualkv.bench.long_memory import summarize
from visualkv.bench.long_video import LongVideoSpec, iter_frames, write_long_video


def _diffs(spec: LongVideoSpec) -> np.ndarray:
    frames = [f.astype(np.int16) for f in iter_frames(spec)]
    return np.array([np.abs(a - b).mean() for a, b in itertools.pairwise(frames)])


def test_mix_has_static_shots_pans_and_an_event():
    spec = LongVideoSpec(minutes=2, kind="mix", width=160, height=90)
    diffs = _diffs(spec)
    assert len(diffs) == spec.frame_count - 1 == 119
    static = diffs == 0
    # 40 s static, 30 s pan, a cut, 50 s static with a 1 s event: most frames repeat, the pan never does
    assert 0.6 < static.mean() < 0.8
    assert not static[40:69].any()
    assert (~static[70:]).sum() == 2  # the ball appears and disappears


def test_moving_never_repeats_a_frame():
    assert (_diffs(LongVideoSpec(minutes=1, kind="moving", width=160, height=90)) > 0).all()


def test_written_file_has_every_frame(tmp_path):
    spec = LongVideoSpec(minutes=1, kind="mix", width=160, height=96)
    path = write_long_video(spec, str(tmp_path))
    cap = cv2.VideoCapture(path)
    count = 0
    while cap.read()[0]:
        count += 1
    cap.release()
    assert count == spec.frame_count == 60
    assert write_long_video(spec, str(tmp_path)) == path  # reused, not rewritten


def test_bad_kind_is_refused():
    with pytest.raises(ValueError, match="mix, moving"):
        LongVideoSpec(minutes=1, kind="pan")


def test_summary_growth_spread_and_refusals():
    def row(method, minutes, rss, peak, ttft=6.0):
        return {
            "video_kind": "mix",
            "method": method,
            "minutes": minutes,
            "peak_rss_bytes": rss,
            "peak_kv_bytes": peak,
            "final_kv_bytes": peak // 2,
            "ttft_seconds": ttft * minutes / 10,
        }

    rows = [
        row("blockwise-keydiff", 10, 1000, 200),
        row("blockwise-keydiff", 60, 1050, 190),
        row("full", 10, 1000, 900),
        {"video_kind": "mix", "method": "full", "minutes": 60, "refused": "too many frames"},
    ]
    s = summarize(rows)
    bw = s["mix/blockwise-keydiff"]
    assert bw["peak_rss_growth"] == pytest.approx(0.05)
    assert bw["peak_kv_spread"] == pytest.approx(0.05)
    assert bw["ttft_seconds_per_hour"] == pytest.approx(36.0)
    assert s["mix/full"]["refused_minutes"] == [60]
    assert s["mix/full"]["measured_minutes"] == [10]
    assert "peak_rss_growth" not in s["mix/full"]  # one length: no growth to speak of
    rows.insert(0, row("blockwise-keydiff", 5, 500, 100))
    assert summarize(rows)["mix/blockwise-keydiff"]["peak_rss_growth"] == pytest.approx(1.1)
    assert summarize(rows, growth_from=10)["mix/blockwise-keydiff"]["peak_rss_growth"] == pytest.approx(0.05)
