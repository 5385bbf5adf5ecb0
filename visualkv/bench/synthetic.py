"""Deterministic synthetic media for benchmarks and tests (no third-party content).

Memory and latency do not depend on what the pixels show, but flat images would
flatter some methods (identical keys), so these have texture and shapes.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from visualkv.media import Media


def synthetic_image(width: int, height: int, seed: int = 0) -> np.ndarray:
    """RGB uint8 (height, width, 3): smooth gradients, coarse noise and rectangles."""
    rng = np.random.default_rng(seed)
    y = np.linspace(0, 1, height, dtype=np.float32)[:, None]
    x = np.linspace(0, 1, width, dtype=np.float32)[None, :]
    img = np.empty((height, width, 3), dtype=np.float32)
    for ch in range(3):
        a, b, c = rng.uniform(0.2, 1.0, 3)
        img[..., ch] = 90 + 60 * np.sin(6.28 * (a * x + b * y) + c) + 40 * x * y
    coarse = rng.normal(0, 18, (-(-height // 32), -(-width // 32), 3)).astype(np.float32)
    img += np.repeat(np.repeat(coarse, 32, axis=0), 32, axis=1)[:height, :width]
    for _ in range(max(8, (width * height) // 200_000)):
        w, h = rng.integers(8, max(9, width // 12)), rng.integers(8, max(9, height // 12))
        x0, y0 = rng.integers(0, max(1, width - w)), rng.integers(0, max(1, height - h))
        img[y0 : y0 + h, x0 : x0 + w] = rng.uniform(0, 255, 3)
    return np.clip(img, 0, 255).astype(np.uint8)


def image_media(width: int, height: int, seed: int = 0) -> Media:
    return Media(
        kind="image",
        frames=[synthetic_image(width, height, seed)],
        times=[0.0],
        source_fps=None,
        duration=None,
        path=None,
    )


def video_media(n_frames: int, width: int = 640, height: int = 360, fps: float = 1.0, seed: int = 0) -> Media:
    """A slow pan over a larger synthetic scene, sampled at `fps`."""
    scene = synthetic_image(width + 4 * n_frames, height, seed)
    frames = [np.ascontiguousarray(scene[:, 4 * i : 4 * i + width]) for i in range(n_frames)]
    return Media(
        kind="video",
        frames=frames,
        times=[i / fps for i in range(n_frames)],
        source_fps=fps,
        duration=n_frames / fps,
        path=None,
    )


def megapixel_size(megapixels: float, aspect: float = 16 / 9) -> tuple[int, int]:
    """(width, height) of an image of about `megapixels` MP with the given aspect ratio."""
    height = round((megapixels * 1e6 / aspect) ** 0.5)
    return round(height * aspect), height


#: Constant quality of the VP9 encoder (libvpx's CRF: 4 = near-lossless, 63 = worst; its least is 3).
WEBM_CRF = 4


def write_frames(path: str, frames: Iterable[np.ndarray], fps: float, size: tuple[int, int]) -> str:
    """Write RGB `frames` (each `size` = (width, height)) into a video file through OpenCV's bundled FFmpeg, one
    at a time, the codec by the file's extension: ``.webm`` is VP9 (libvpx, constant quality `WEBM_CRF`),
    which browsers play (the app's example videos); any other extension is MPEG-4 Part 2 (``mp4v``), quick to
    write but not played by browsers (inputs of tests and benchmarks that only the library reads)."""
    import cv2

    path = str(path)
    if path.lower().endswith(".webm"):
        fourcc, params = "VP90", [cv2.VIDEOWRITER_PROP_CRF, WEBM_CRF]
    else:
        fourcc, params = "mp4v", []
    writer = cv2.VideoWriter(path, cv2.CAP_FFMPEG, cv2.VideoWriter_fourcc(*fourcc), fps, size, params)
    if not writer.isOpened():
        raise OSError(f"OpenCV cannot write {fourcc} video to {path} (FFmpeg missing from the cv2 build?)")
    try:
        for rgb in frames:
            writer.write(cv2.cvtColor(np.ascontiguousarray(rgb), cv2.COLOR_RGB2BGR))
    finally:
        writer.release()
    return path


def write_video_file(
    path: str, n_frames: int, width: int = 640, height: int = 360, fps: float = 1.0, seed: int = 0
) -> str:
    """Write `video_media`'s pan (wrapping around a scene twice the width, so memory stays flat however
    long) one frame at a time: inputs for lazy-decoding tests and hour-long benchmarks. The codec follows the
    extension (`write_frames`): ``.webm`` plays in a browser, ``.mp4`` (mp4v) is quicker to write."""
    scene = synthetic_image(2 * width, height, seed)
    scene = np.concatenate([scene, scene[:, :width]], axis=1)  # wraps seamlessly
    pan = (scene[:, (4 * i) % (2 * width) : (4 * i) % (2 * width) + width] for i in range(n_frames))
    return write_frames(path, pan, fps, (width, height))
