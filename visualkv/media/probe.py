"""What a video container states (frame count, fps, size, rotation), read from its header without
decoding, and the limits checked on it before any frame is decoded."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from visualkv.errors import MediaError
from visualkv.media.backends import import_cv2
from visualkv.media.core import MediaLimits, check_pixels
from visualkv.media.messages import human_duration


@dataclass
class VideoInfo:
    frame_count: int  # 0 when the container does not say
    fps: float
    width: int = 0  # 0 when unknown
    height: int = 0
    rotation: int = 0  # degrees clockwise the player should rotate the picture


def valid_fps(fps: float) -> bool:
    return math.isfinite(fps) and 0 < fps <= 1000


def probe_opencv(file: Path) -> VideoInfo | None:
    """Frame count, fps, size and rotation from the container header (no stream decoding)."""
    cv2 = import_cv2()
    if cv2 is None:
        return None
    capture = cv2.VideoCapture(str(file))
    try:
        if not capture.isOpened():
            return None
        return VideoInfo(
            frame_count=max(0, int(capture.get(cv2.CAP_PROP_FRAME_COUNT))),
            fps=float(capture.get(cv2.CAP_PROP_FPS)),
            width=int(capture.get(cv2.CAP_PROP_FRAME_WIDTH)),
            height=int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT)),
            rotation=int(capture.get(cv2.CAP_PROP_ORIENTATION_META)) % 360,
        )
    finally:
        capture.release()


def opencv_opens(file: Path) -> bool:
    cv2 = import_cv2()
    if cv2 is None:
        return False
    capture = cv2.VideoCapture(str(file))
    try:
        return bool(capture.isOpened()) and capture.get(cv2.CAP_PROP_FRAME_COUNT) > 0
    finally:
        capture.release()


def check_video_info(info: VideoInfo, name: str, limits: MediaLimits) -> None:
    if info.frame_count > 0 and valid_fps(info.fps):
        seconds = info.frame_count / info.fps
        if seconds > limits.max_video_seconds:
            # the header's own figures, so that a damaged one (a wrong timescale: 0.01 fps) shows as such
            raise MediaError(
                f"'{name}': video is {human_duration(seconds)} long ({info.frame_count:,} frames at "
                f"{info.fps:.3g} fps, per its header); the limit is {human_duration(limits.max_video_seconds)} "
                "— trim it (e.g. ffmpeg -t) or raise MediaLimits.max_video_seconds"
            )
    if info.width > 0 and info.height > 0:
        check_pixels((info.width, info.height), name, limits, "video frame")


def count_frames_opencv(file: Path, fps: float, limits: MediaLimits) -> int:
    """Decode the stream to count its frames (for containers that do not state the count),
    stopping just past the duration limit."""
    cv2 = import_cv2()
    capture = cv2.VideoCapture(str(file))
    stop_after = math.ceil(limits.max_video_seconds * fps)
    count = 0
    try:
        while count <= stop_after and capture.grab():
            count += 1
    finally:
        capture.release()
    return count
