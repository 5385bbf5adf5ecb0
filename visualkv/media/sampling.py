"""Which video frames to decode: :class:`FrameSampling` and :func:`sample_frame_indices`.

Frame times are ``index / average fps``: exact for constant-frame-rate video, approximate for a
variable frame rate. ``FrameSampling.max_frames`` resamples uniformly; ``MediaLimits.max_frames`` refuses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from visualkv.errors import MediaError


@dataclass(frozen=True)
class FrameSampling:
    """How to pick frames from a video.

    ``fps`` frames per second of video (times 0, 1/fps, 2/fps, ...); if that gives more than
    ``max_frames``, exactly ``max_frames`` are taken uniformly over the whole video instead, first
    and last frame included. ``max_frames=None``: no cap of its own (duration x fps frames; the
    limits' ``max_frames`` then refuses what is too many for the method). Sampling faster than
    the source fps yields each source frame once.
    """

    fps: float = 1.0
    max_frames: int | None = 64

    def __post_init__(self) -> None:
        if not (self.fps > 0 and math.isfinite(self.fps)):
            raise MediaError(f"FrameSampling.fps must be a positive number, got {self.fps}")
        if self.max_frames is not None and self.max_frames < 1:
            raise MediaError(f"FrameSampling.max_frames must be >= 1 (or None: no cap), got {self.max_frames}")


def sample_frame_indices(
    frame_count: int,
    source_fps: float,
    sampling: FrameSampling,
    hard_cap: int | None = None,
) -> list[int]:
    """Indices of the frames to decode, ascending and unique (see :class:`FrameSampling`)."""
    if frame_count <= 0:
        return []
    caps = [c for c in (sampling.max_frames, hard_cap) if c is not None]
    cap = min(caps) if caps else math.inf
    duration = frame_count / source_fps
    every_frame = sampling.fps >= source_fps
    if every_frame:
        # every source frame is on screen at some sampled time, so each is taken once (listing the
        # duration x fps sample times instead would build billions for an fps of 1e9)
        wanted = frame_count
    else:
        # Samples at t = k / fps for every t < duration; the epsilon keeps exact multiples exact.
        wanted = max(1, math.ceil(duration * sampling.fps - 1e-6))
    if wanted > cap:
        picked = np.linspace(0, frame_count - 1, cap).round().astype(int).tolist()
    elif every_frame:
        picked = list(range(frame_count))
    else:
        # The frame on screen at time t is floor(t * source_fps).
        picked = [math.floor(k / sampling.fps * source_fps + 1e-6) for k in range(wanted)]
        picked = [min(frame_count - 1, i) for i in picked]
    return sorted(set(picked))
