"""Load a video: probe, pick the decoder, sample frames, decode them eagerly or lazily.

Eager loading decodes with decord, OpenCV (FFmpeg) filling in where decord is missing, cannot open the
file or fails on a frame; lazy loading reads with OpenCV first (see :class:`FrameDecoder`). decord
ignores rotation metadata (phone videos), so in ``auto`` mode a rotated video is decoded by OpenCV.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np

from visualkv.errors import MediaError
from visualkv.media.backends import import_cv2, import_decord
from visualkv.media.core import Media, MediaLimits, check_pixels
from visualkv.media.flat import flat_video_note, is_flat
from visualkv.media.lazy import LazyFrames
from visualkv.media.messages import no_decodable_frame, one_line
from visualkv.media.probe import VideoInfo, check_video_info, count_frames_opencv, probe_opencv, valid_fps
from visualkv.media.readers import DecordReader, FrameDecoder, read_opencv
from visualkv.media.sampling import FrameSampling, sample_frame_indices

Backend = Literal["auto", "decord", "opencv"]


_FALLBACK_FPS = 25.0


def _check_backends(backend: str) -> tuple[bool, bool]:
    """Which of decord / OpenCV may be used; refuses a backend that is not installed."""
    if backend not in ("auto", "decord", "opencv"):
        raise MediaError(f"unknown video backend {backend!r} — use 'auto', 'decord' or 'opencv'")
    has_decord = import_decord() is not None
    has_cv2 = import_cv2() is not None
    if backend == "decord" and not has_decord:
        raise MediaError("decord is not installed — pip install decord, or use backend='opencv'")
    if backend == "opencv" and not has_cv2:
        raise MediaError("OpenCV is not installed — pip install opencv-python-headless, or use backend='decord'")
    if not (has_decord or has_cv2):
        raise MediaError("no video decoder is installed — pip install decord opencv-python-headless")
    return has_decord and backend != "opencv", has_cv2 and backend != "decord"


def _open_decord(
    file: Path, name: str, backend: str, header: VideoInfo | None, notes: list[str]
) -> DecordReader | None:
    """decord reader, or None (with a note) where auto mode should use OpenCV instead."""
    if header is not None and header.rotation:
        # decord ignores rotation metadata and mis-sizes such frames; OpenCV applies it.
        if backend == "decord":
            raise MediaError(
                f"'{name}': the video carries {header.rotation}° rotation metadata, which "
                "decord mis-decodes — use backend='auto' or 'opencv'"
            )
        notes.append(f"rotated video ({header.rotation}°): decoded with OpenCV")
        return None
    try:
        return DecordReader(file)
    except Exception as err:  # noqa: BLE001 - decord raises DECORDError, RuntimeError, ...
        if backend == "decord":
            raise MediaError(
                f"'{name}': decord cannot open this video ({one_line(err)}) — try backend='opencv' or re-encode it"
            ) from None
        notes.append(f"decord could not open the video ({one_line(err)}); used OpenCV")
        return None


def load_video_file(
    file: Path, name: str, limits: MediaLimits, sampling: FrameSampling, backend: str, lazy: bool = True
) -> Media:
    use_decord, use_cv2 = _check_backends(backend)
    notes: list[str] = []
    # The header probe comes first so that an over-long video is refused before decord builds
    # its packet index (which reads the whole file) and before anything is decoded.
    header = probe_opencv(file)
    if header is not None:
        check_video_info(header, name, limits)
    decord_reader = _open_decord(file, name, backend, header, notes) if use_decord else None
    info = decord_reader.info if decord_reader is not None else header
    if info is None or (decord_reader is None and not use_cv2):
        raise MediaError(
            f"'{name}': cannot open the video with decord or OpenCV — the file is damaged, truncated or "
            "its codec is unsupported; re-encode it (e.g. ffmpeg -i in -c:v libx264 out.mp4)"
        )
    check_video_info(info, name, limits)
    if not valid_fps(info.fps):
        notes.append(f"no valid frame rate stated ({info.fps}); assumed {_FALLBACK_FPS:g} fps")
        info.fps = _FALLBACK_FPS
    # A count of 0 comes only from the OpenCV header: decord always counts frames.
    if info.frame_count <= 0:
        info.frame_count = count_frames_opencv(file, info.fps, limits)
        check_video_info(info, name, limits)

    indices = sample_frame_indices(info.frame_count, info.fps, sampling)
    limits.check_frame_count(len(indices), name, sampling.fps)  # refused before any frame is decoded
    if lazy:
        return _lazy_video_media(file, name, limits, info, indices, decord_reader, use_cv2, notes)
    decoded = decord_reader.read_many(indices) if decord_reader is not None else {}
    used = ["decord"] if decoded else []
    missing = [i for i in indices if i not in decoded]
    if missing and use_cv2:
        from_opencv = read_opencv(file, info.fps, missing)
        decoded.update(from_opencv)
        used += ["opencv"] if from_opencv else []
    return _video_media(name, limits, info, indices, decoded, "+".join(used), notes)


def _video_media(
    name: str,
    limits: MediaLimits,
    info: VideoInfo,
    indices: list[int],
    decoded: dict[int, np.ndarray],
    backend: str,
    notes: list[str],
) -> Media:
    kept = [i for i in indices if i in decoded]
    if not kept:
        raise no_decodable_frame(name, len(indices))
    for index in indices:
        if index not in decoded:
            seconds = index / info.fps
            notes.append(f"frame {index} (t={seconds:.2f} s) could not be decoded; skipped")
    frames = [np.ascontiguousarray(decoded[i], dtype=np.uint8) for i in kept]
    if all(is_flat(frame) for frame in frames):  # stops at the first frame with content
        notes.append(flat_video_note(name))
    return _sampled_video(frames, frames[0].shape, name, limits, info, kept, notes, backend)


def _lazy_video_media(
    file: Path,
    name: str,
    limits: MediaLimits,
    info: VideoInfo,
    indices: list[int],
    decord_reader: DecordReader | None,
    use_cv2: bool,
    notes: list[str],
) -> Media:
    if not indices:
        raise no_decodable_frame(name, 0)
    decoder = FrameDecoder(file, info.fps, decord_reader, use_cv2)
    frames = LazyFrames(decoder, indices, info.fps, notes, name)
    backend = "+".join(b for b in ("decord", "opencv") if b in decoder.used)
    return _sampled_video(frames, frames.frame_shape, name, limits, info, indices, notes, backend)


def _sampled_video(
    frames: Sequence[np.ndarray],
    frame_shape: tuple[int, ...],
    name: str,
    limits: MediaLimits,
    info: VideoInfo,
    indices: list[int],
    notes: list[str],
    backend: str,
) -> Media:
    """The video Media of sampled source frames `indices` (eager list or lazy sequence), its frame size
    checked against the pixel limit."""
    height, width = frame_shape[:2]
    check_pixels((width, height), name, limits, "video frame")
    return Media(
        kind="video",
        frames=frames,
        times=[i / info.fps for i in indices],
        source_fps=info.fps,
        duration=info.frame_count / info.fps,
        path=name,
        warnings=notes,
        frame_indices=list(indices),
        backend=backend,
    )
