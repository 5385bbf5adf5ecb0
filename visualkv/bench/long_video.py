"""Hour-long synthetic videos for the bounded-memory benchmark (generated, never committed).

Two kinds, both 640x360 by default, written straight to an MP4 file frame by frame (the generator
holds a few panoramas, never the video):

* ``mix``: the example video's grammar repeated every two minutes: a static shot, a slow pan, a hard
  cut to another scene, a static shot with a one-second event (a red ball), static to the end of the
  cycle. Sali-Cache's temporal filter skips most of it.
* ``moving``: a continuous pan, so every frame moves and nothing can be skipped (the worst case for
  frame skipping; bounded memory must still hold).

The source frame rate equals the sampling rate the benchmark uses (1 fps by default), so sampling
takes every frame.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import cv2
import numpy as np

from visualkv.bench.synthetic import synthetic_image

VIDEO_KINDS = ("mix", "moving")
#: one cycle of the ``mix`` kind, seconds: static, pan, (cut) static with an event, static
_CYCLE = (40.0, 30.0, 50.0)
_EVENT_AT, _EVENT_SECONDS = 20.0, 1.0  # into the cycle's last shot
_PAN_STEP = 8  # px per second in ``moving`` (2 px at the motion filter's 160 px width: clearly moving)
_SCENES = 4  # distinct panoramas the cycles rotate through


@dataclass(frozen=True)
class LongVideoSpec:
    minutes: float
    kind: str = "mix"
    width: int = 640
    height: int = 360
    fps: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in VIDEO_KINDS:
            raise ValueError(f"video kind must be one of {', '.join(VIDEO_KINDS)}, got {self.kind!r}")
        if not self.minutes > 0 or not self.fps > 0:
            raise ValueError("minutes and fps must be positive")

    @property
    def frame_count(self) -> int:
        return max(1, round(self.minutes * 60 * self.fps))

    def file_name(self) -> str:
        return f"{self.kind}_{self.minutes:g}min_{self.width}x{self.height}_{self.fps:g}fps.mp4"


def iter_frames(spec: LongVideoSpec) -> Iterator[np.ndarray]:
    """RGB uint8 frames of the video, in order (frame k shows second k / fps)."""
    w, h = spec.width, spec.height
    panoramas = [synthetic_image(2 * w, h, seed=spec.seed + 10 + i) for i in range(_SCENES)]
    if spec.kind == "moving":
        strip = np.concatenate(panoramas, axis=1)
        strip = np.concatenate([strip, strip[:, :w]], axis=1)  # wraps around seamlessly
        period = strip.shape[1] - w
        for k in range(spec.frame_count):
            x = round(k / spec.fps * _PAN_STEP) % period
            yield strip[:, x : x + w]
        return
    static, pan, tail = _CYCLE
    cycle = static + pan + tail
    ball = (round(0.62 * w), round(0.55 * h), max(3, round(0.06 * h)))
    for k in range(spec.frame_count):
        t = k / spec.fps
        c, u = divmod(t, cycle)
        scene = panoramas[int(c) % _SCENES]
        if u < static:
            yield scene[:, :w]
        elif u < static + pan:
            x = round((u - static) / pan * w)
            yield scene[:, x : x + w]
        else:
            other = panoramas[(int(c) + 1) % _SCENES][:, w:]
            if _EVENT_AT <= u - static - pan < _EVENT_AT + _EVENT_SECONDS:
                other = other.copy()
                cv2.circle(other, ball[:2], ball[2], (230, 20, 20), -1, cv2.LINE_AA)
            yield other


def default_video_dir() -> str:
    """Where generated videos are cached between runs (shared by `bench memory --minutes` and `bench gpu`)."""
    return os.path.join(tempfile.gettempdir(), "visualkv-long-videos")


def write_long_video(spec: LongVideoSpec, folder: str) -> str:
    """Write the video (mp4v) into `folder` unless it is already there; returns its path."""
    path = os.path.join(folder, spec.file_name())
    if os.path.exists(path):
        return path
    os.makedirs(folder, exist_ok=True)
    tmp = path[:-4] + ".partial.mp4"  # the extension tells FFmpeg the container
    writer = cv2.VideoWriter(tmp, cv2.VideoWriter_fourcc(*"mp4v"), spec.fps, (spec.width, spec.height))
    if not writer.isOpened():
        raise RuntimeError("OpenCV cannot write mp4v video here (FFmpeg missing from the cv2 build?)")
    try:
        for frame in iter_frames(spec):
            writer.write(cv2.cvtColor(np.ascontiguousarray(frame), cv2.COLOR_RGB2BGR))
    finally:
        writer.release()
    os.replace(tmp, path)
    return path
