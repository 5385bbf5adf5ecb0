"""What loading gives (:class:`Media`) and what it refuses (:class:`MediaLimits`).

Limits are checked from headers before pixels are decoded, so an image bomb or a ten-hour video
costs nothing; video frames obey the same pixel, side and aspect-ratio limits as images.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from visualkv.errors import MediaError
from visualkv.media.lazy import LazyFrames
from visualkv.media.resize import resize_to_width

PathLike = str | os.PathLike

#: `Media.resized_at_decode` resizes only to at most this share of the decoded pixels
RESIZE_AT_DECODE_BELOW = 0.75


@dataclass(frozen=True)
class MediaLimits:
    """What we refuse to load. Defaults fit one large GPU; raise them deliberately."""

    max_file_bytes: int = 2 * 1024**3  # 2 GiB
    # 8K (7680x4320 = 33 MP) passes; a 20000x20000 bomb (400 MP) does not.
    max_image_pixels: int = 64_000_000
    min_image_side: int = 28  # one ViT patch; smaller images carry no usable detail
    # Longer side / shorter side at most this: the Qwen processors refuse more than 200, and a
    # thinner strip is a few patches wide on every family.
    max_aspect_ratio: float = 200.0
    max_video_seconds: float = 3 * 3600
    # Most sampled frames a video may have; more is refused (one-line MediaError), never resampled.
    # None: no frame cap (methods whose memory is bounded; see visualkv.runtime.frame_cap.media_limits).
    max_frames: int | None = 512
    # For the refusal message: the method the cap is for, and the methods without one.
    cap_method: str | None = None
    bounded_methods: tuple[str, ...] = ()
    # ... and how the caller can sample fewer frames (the options differ: app, CLI, bench gpu)
    fewer_frames: str = "lower the fps or sample fewer frames (--max-frames)"

    def __post_init__(self) -> None:
        for name in (
            "max_file_bytes",
            "max_image_pixels",
            "min_image_side",
            "max_frames",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise MediaError(f"MediaLimits.{name} must be >= 1, got {value}")
        if not self.max_video_seconds > 0:
            raise MediaError(f"MediaLimits.max_video_seconds must be > 0, got {self.max_video_seconds}")
        if not self.max_aspect_ratio >= 1:
            raise MediaError(f"MediaLimits.max_aspect_ratio must be >= 1, got {self.max_aspect_ratio}")

    def check_frame_count(self, frames: int, name: str, fps: float) -> None:
        """Refuse more sampled frames than ``max_frames`` with one line naming the bounded methods."""
        if self.max_frames is None or frames <= self.max_frames:
            return
        who = (
            f"'{self.cap_method}' holds every frame's KV at once and is capped at {self.max_frames} frames"
            if self.cap_method
            else f"the limit is {self.max_frames} frames (MediaLimits.max_frames)"
        )
        bounded = " or ".join(self.bounded_methods)
        use = f"use {bounded} (bounded memory), " if bounded else ""
        raise MediaError(f"'{name}' sampled at {fps:g} fps is {frames} frames; {who} — {use}{self.fewer_frames}")


def check_pixels(size: tuple[int, int], name: str, limits: MediaLimits, what: str) -> None:
    """Refuse a `what` ("image", "video frame") of `size` (width, height) outside the pixel, side or aspect
    limits; called on header sizes, before any pixel is decoded."""
    width, height = size
    pixels = width * height
    if pixels > limits.max_image_pixels:
        raise MediaError(
            f"'{name}': {what} {width}x{height} is {pixels / 1e6:.1f} MP; the limit is "
            f"{limits.max_image_pixels / 1e6:.1f} MP — downscale it (or raise MediaLimits.max_image_pixels)"
        )
    if min(width, height) < limits.min_image_side:
        raise MediaError(
            f"'{name}': {what} {width}x{height} is too small; each side must be at least "
            f"{limits.min_image_side} px — use a larger {what}"
        )
    ratio = max(width, height) / min(width, height)
    if ratio > limits.max_aspect_ratio:
        raise MediaError(
            f"'{name}': {what} {width}x{height} has an aspect ratio of {ratio:.4g}:1; the limit is "
            f"{limits.max_aspect_ratio:g}:1 — crop it into pieces (or raise MediaLimits.max_aspect_ratio)"
        )


@dataclass(repr=False)
class Media:
    """A validated image or sampled video, as RGB uint8 frames (HxWx3).

    ``frames`` is a read-only sequence: a list for an image or an eagerly loaded video, a
    :class:`LazyFrames` for a lazily loaded video (indexing decodes; slices give lists).
    """

    kind: str  # "image" or "video"
    frames: Sequence[np.ndarray]  # one frame for an image
    times: list[float]  # seconds of each frame in the video (0.0 for an image)
    source_fps: float | None = None  # video's average native fps
    duration: float | None = None  # video seconds (frame count / fps)
    path: str | None = None
    # e.g. frames skipped as undecodable, or why OpenCV was used instead of decord
    warnings: list[str] = field(default_factory=list)
    frame_indices: list[int] = field(default_factory=list)  # source index of each frame
    backend: str | None = None  # "pil", "decord", "opencv" or "decord+opencv"

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) of the frames (from the lazy sequence's metadata: nothing is decoded)."""
        height, width = self.frame_shape[:2]
        return width, height

    @property
    def frame_shape(self) -> tuple[int, ...]:
        """(height, width, 3) of every frame."""
        if isinstance(self.frames, LazyFrames):
            return self.frames.frame_shape
        return tuple(self.frames[0].shape)

    @property
    def num_frames(self) -> int:
        return len(self.frames)

    @property
    def is_lazy(self) -> bool:
        """Frames are decoded on access (see :class:`LazyFrames`)."""
        return isinstance(self.frames, LazyFrames)

    @property
    def frame_bytes(self) -> int:
        """Bytes of one decoded frame."""
        return int(np.prod(self.frame_shape))

    @property
    def resident_frame_bytes(self) -> int:
        """Bytes of decoded frames this Media holds right now (a lazy one: its small cache only)."""
        if isinstance(self.frames, LazyFrames):
            return self.frames.cached_bytes
        return sum(int(f.nbytes) for f in self.frames)

    def resized_at_decode(self, size: tuple[int, int], resize: Callable[[np.ndarray], np.ndarray]) -> Media:
        """This video with each frame resized to ``size`` (height, width) by ``resize`` right after it is
        decoded (:meth:`LazyFrames.resized`): what a model adapter gives its vision side, so the frames held
        while blocks run are the size the processor needs, not the decoded size. ``self`` is returned
        unchanged where that would not pay: an image or an eager video (their frames are already held), or a
        ``size`` of more than ``RESIZE_AT_DECODE_BELOW`` (3/4) of the decoded pixels (each decode then holds
        one full-size frame besides the small ones, so a slight shrink saves nothing). The full-size frames
        this Media had cached are released (decoded again if something asks for them)."""
        if not isinstance(self.frames, LazyFrames) or self.frames.is_resized:
            return self
        height, width = self.frame_shape[:2]
        if size[0] * size[1] > RESIZE_AT_DECODE_BELOW * height * width:
            return self
        self.frames.clear_cache()
        return replace(self, frames=self.frames.resized(size, resize))

    def iter_small(self, width: int) -> Iterator[np.ndarray]:
        """Every frame in order, resized to ``width`` px wide (aspect kept; INTER_AREA when shrinking,
        as ``visualkv.media.saliency`` does), decoding one full frame at a time: a streaming pass over a long
        video whose memory does not grow with it."""
        if isinstance(self.frames, LazyFrames):
            yield from self.frames.iter_small(width)
            return
        for frame in self.frames:
            yield resize_to_width(frame, width)

    def __repr__(self) -> str:  # the default repr would print every pixel
        width, height = self.size
        extra = f", duration={self.duration:.2f}s, fps={self.source_fps:.3g}" if self.kind == "video" else ""
        return (
            f"Media(kind={self.kind!r}, frames={self.num_frames} x {width}x{height}{extra}, "
            f"path={self.path!r}, warnings={len(self.warnings)})"
        )
