"""Load and validate images and videos, and sample video frames.

Everything a user can hand us goes through here, so every failure becomes a one-line
:class:`~visualkv.errors.MediaError` that names the file and says what to do; no other exception
type escapes ``load_media`` / ``load_image`` / ``load_video`` / ``media_kind``.

Limits, stated honestly:

* Images are decoded by Pillow: PNG, JPEG (and phone MPO), WebP, BMP, GIF (first frame only),
  TIFF (first page only) and PPM; an animated GIF/APNG/WebP or a multi-page TIFF gets a warning in
  ``Media.warnings`` saying the rest is unread. EXIF orientation is applied; alpha is composited on
  white; 16-bit images are scaled to 8 bits; a float image outside [0, 1] and [0, 255], or a 32-bit
  integer one outside [0, 65535], is stretched from its minimum to its maximum (with a warning), and
  one holding NaN is refused. Other formats Pillow knows (PSD, ICO, ...) are refused.
* The pixel limit is checked from the header before any pixel is decoded, so an image bomb costs
  nothing. Pillow's own bomb check is bypassed only for that header read. The smallest side and
  the aspect ratio (``MediaLimits.max_aspect_ratio``, 200: the Qwen processors refuse more) are
  checked there too, and on video frames.
* Eager loading (``lazy=False``) decodes with decord, with OpenCV (FFmpeg) as the fallback when decord
  is missing, cannot open the file, or fails on a frame; lazy loading (the default) reads with OpenCV
  first and decord as the fallback (see :class:`_FrameDecoder`: decord's memory grew with the frames
  read). A frame neither can decode is handled as described below. Which codecs work depends on the
  FFmpeg those wheels bundle.
  decord ignores rotation metadata (phone videos) and mis-decodes such files, so in ``auto``
  mode a rotated video is decoded by OpenCV, which shows it upright.
* The duration limit is checked from container metadata (OpenCV header probe, else decord's
  packet index) before any frame is decoded. If a container states no frame count and decord is
  unavailable, OpenCV has to decode the stream to count frames (stopping at the limit).
* Frame times are ``index / average fps``: exact for constant-frame-rate video, approximate for
  variable frame rate.
* Video frames are decoded lazily (``load_media(..., lazy=True)``, the default): ``Media.frames``
  is a :class:`LazyFrames` sequence that decodes a frame when it is indexed (OpenCV, reading forward
  sequentially, the common case since blocks run in order, and seeking for a jump) and keeps only
  the last ``LazyFrames.cache_size`` (4) decoded frames, so memory does not grow with the video:
  an hour at 1 fps is 3,600 sampled frames, of which a block-wise prefill holds a few at a time.
  Only the first sampled frame is decoded when loading (it proves the file decodes and gives the
  size). A frame that cannot be decoded when its turn comes is replaced by the nearest earlier
  decodable frame, with a warning appended to :attr:`Media.warnings` (a long prefill is never lost
  at frame 3,000); if even the first sampled frame is undecodable, later ones are tried at load. A video whose
  every sampled frame decodes as one flat colour (zeroed picture data decodes as the decoder's grey) gets a
  warning once the last of them is decoded (at load when decoded eagerly).
  ``Media.iter_small(width)`` streams all frames downscaled (Sali-Cache's motion pass) with one
  full-size frame alive at a time. ``Media.resized_at_decode(size, resize)`` gives a view whose frames
  are resized right after decoding, before caching (:meth:`LazyFrames.resized`): a model adapter reads a
  video through it at the size its processor needs (``ModelAdapter.video_for_encoding``), while the
  Media itself keeps giving decoded frames (layout boxes, saliency and the app are in decoded pixels).
  ``lazy=False`` decodes every sampled frame up front at full resolution (RGB uint8: 64 frames of 1080p
  take ~400 MB) and leaves undecodable ones out, with a warning. Images are always decoded eagerly. Video frames obey the same pixel limit as images.
* Frame caps: ``FrameSampling.max_frames`` is the caller's own cap (uniform resampling over the
  whole video; ``None`` = no cap of its own). ``MediaLimits.max_frames`` is a hard limit that is
  refused, not resampled: more sampled frames than that raise a one-line MediaError. It is meant
  to follow the method (see ``visualkv.methods.media_limits``): methods whose memory is bounded
  (they evict per block) get ``None`` (only ``max_video_seconds`` limits them); the others keep
  512.
"""

from __future__ import annotations

import copy
import math
import os
import re
import stat
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import numpy as np
from PIL import Image, ImageOps

from visualkv.errors import MediaError

__all__ = [
    "IMAGE_FORMATS",
    "FrameSampling",
    "LazyFrames",
    "Media",
    "MediaError",
    "MediaLimits",
    "load_image",
    "load_media",
    "load_video",
    "media_kind",
    "quiet_decoders",
    "sample_frame_indices",
]

PathLike = str | os.PathLike
Backend = Literal["auto", "decord", "opencv"]

#: Pillow format names we decode (MPO: multi-picture JPEG written by many phones).
IMAGE_FORMATS: tuple[str, ...] = (
    "PNG",
    "JPEG",
    "MPO",
    "WEBP",
    "BMP",
    "DIB",
    "GIF",
    "TIFF",
    "PPM",
)
_SUPPORTED = "use a PNG/JPEG/WebP/BMP/GIF/TIFF image or an MP4/WebM/AVI/MKV/MOV video"
_FALLBACK_FPS = 25.0
#: `Media.resized_at_decode` resizes only to at most this share of the decoded pixels
RESIZE_AT_DECODE_BELOW = 0.75
_MAX_MESSAGE_DETAIL = 160


@dataclass(frozen=True)
class MediaLimits:
    """What we refuse to load. Defaults fit one large GPU; raise them deliberately."""

    max_file_bytes: int = 2 * 1024**3  # 2 GiB
    # 8K (7680x4320 = 33 MP) passes; a 20000x20000 bomb (400 MP) does not.
    max_image_pixels: int = 64_000_000
    min_image_side: int = 28  # one ViT patch; smaller images carry no usable detail
    # Longer side / shorter side at most this: the Qwen processors refuse more than 200 (a traceback
    # in the middle of a turn before), and a thinner strip is a few patches wide on every family.
    max_aspect_ratio: float = 200.0
    max_video_seconds: float = 3 * 3600
    # Most sampled frames a video may have; more is refused (one-line MediaError), never resampled.
    # None: no frame cap (methods whose memory is bounded; see visualkv.methods.media_limits).
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


# --------------------------------------------------------------------------------------------
# Public entry points


def media_kind(path: PathLike) -> str:
    """Return ``"image"`` or ``"video"`` from the file's content (magic bytes / Pillow header),
    not its extension. Raises MediaError for anything else (missing, empty, text, PDF, ...)."""
    name = str(path)
    return _sniff(_check_file(path, name, limits=None), name)


def load_media(
    path: PathLike,
    limits: MediaLimits = MediaLimits(),
    sampling: FrameSampling = FrameSampling(),
    backend: Backend = "auto",
    lazy: bool = True,
) -> Media:
    """Load an image or a video (detected from content) with validation and frame sampling.

    ``lazy``: a video's frames are decoded when indexed (:class:`LazyFrames`), else all up front."""
    name = str(path)
    file = _check_file(path, name, limits)
    if _sniff(file, name) == "image":
        return _image_media(*_decode_image_file(file, name, limits), name)
    return _load_video_file(file, name, limits, sampling, backend, lazy)


def load_image(source: PathLike | Image.Image | np.ndarray, limits: MediaLimits = MediaLimits()) -> Media:
    """Load one image from a path, a PIL image, or an array (HxW, HxWx3 RGB, HxWx4 RGBA).

    Arrays may be uint8, bool, float in [0, 1] (or [0, 255]) or 16-bit integers.
    """
    if isinstance(source, Image.Image):
        name = getattr(source, "filename", "") or "<PIL image>"
        _check_pixels(source.size, name, limits, "image")
        notes = _unread_frames(source, name)
        return _image_media(_pil_to_rgb(source, name, notes), notes, None)
    if isinstance(source, np.ndarray):
        return _image_media(_array_to_rgb(source, limits), [], None)
    name = str(source)
    file = _check_file(source, name, limits)
    if _sniff(file, name) == "video":
        raise MediaError(f"'{name}' is a video, not an image — use load_video() or load_media()")
    return _image_media(*_decode_image_file(file, name, limits), name)


def load_video(
    path: PathLike,
    limits: MediaLimits = MediaLimits(),
    sampling: FrameSampling = FrameSampling(),
    backend: Backend = "auto",
    lazy: bool = True,
) -> Media:
    """Load a video and sample frames from it.

    ``backend``: ``"auto"`` (decord, OpenCV where decord is missing or fails), ``"decord"`` or
    ``"opencv"`` (only that library, no fallback). ``lazy``: see :func:`load_media`.
    """
    name = str(path)
    file = _check_file(path, name, limits)
    if _sniff(file, name) == "image":
        raise MediaError(f"'{name}' is an image, not a video — use load_image() or load_media()")
    return _load_video_file(file, name, limits, sampling, backend, lazy)


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


# --------------------------------------------------------------------------------------------
# Files and content sniffing


def _one_line(text: object) -> str:
    """Collapse a library's message to one short line for our own messages."""
    flat = re.sub(r"\s+", " ", str(text)).strip()
    # decord prefixes "[12:00:00] /src/file.cc:42: " to its messages
    flat = re.sub(r"\[[\d:]+\] \S+\.(?:cc|h|cpp):\d+: ", "", flat)
    return flat if len(flat) <= _MAX_MESSAGE_DETAIL else flat[: _MAX_MESSAGE_DETAIL - 3] + "..."


def _human_bytes(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _check_file(path: PathLike, name: str, limits: MediaLimits | None) -> Path:
    """The path must be a readable, non-empty regular file within the size limit."""
    file = Path(path)
    try:
        info = file.stat()
    except FileNotFoundError:
        raise MediaError(f"cannot read '{name}': no such file — check the path") from None
    except PermissionError:
        raise MediaError(f"cannot read '{name}': permission denied — check the file's permissions") from None
    except OSError as err:
        raise MediaError(f"cannot read '{name}': {_one_line(err.strerror or err)}") from None
    if stat.S_ISDIR(info.st_mode):
        raise MediaError(f"cannot read '{name}': it is a directory — pass an image or video file")
    if not stat.S_ISREG(info.st_mode):
        raise MediaError(f"cannot read '{name}': not a regular file — pass an image or video file")
    if info.st_size == 0:
        raise MediaError(f"cannot read '{name}': the file is empty (0 bytes) — re-export or re-download it")
    if limits is not None and info.st_size > limits.max_file_bytes:
        raise MediaError(
            f"'{name}' is {_human_bytes(info.st_size)}; the limit is {_human_bytes(limits.max_file_bytes)}"
            " — compress or trim it, or raise MediaLimits.max_file_bytes"
        )
    return file


def _read_head(file: Path, name: str, size: int = 512) -> bytes:
    try:
        with file.open("rb") as handle:
            return handle.read(size)
    except PermissionError:
        raise MediaError(f"cannot read '{name}': permission denied — check the file's permissions") from None
    except OSError as err:
        raise MediaError(f"cannot read '{name}': {_one_line(err.strerror or err)}") from None


# ISO-BMFF brands that are still images (HEIC/AVIF), not videos.
_IMAGE_BRANDS = {b"heic", b"heix", b"heim", b"heis", b"mif1", b"msf1", b"avif", b"avis"}
_QUICKTIME_ATOMS = {b"moov", b"mdat", b"free", b"wide", b"skip", b"pnot"}


def _video_container(head: bytes) -> str | None:
    """Name of the video container these magic bytes start, or None."""
    if head[4:8] == b"ftyp":
        return None if head[8:12] in _IMAGE_BRANDS else "MP4/MOV"
    if head[4:8] in _QUICKTIME_ATOMS:
        return "MOV"
    if head.startswith(b"\x1a\x45\xdf\xa3"):
        return "Matroska/WebM"
    if head[:4] == b"RIFF" and head[8:12] == b"AVI ":
        return "AVI"
    if head.startswith((b"FLV", b"OggS", b"YUV4MPEG2")):
        return "FLV/Ogg/Y4M"
    if head[:4] in (b"\x00\x00\x01\xba", b"\x00\x00\x01\xb3", b"\x30\x26\xb2\x75"):
        return "MPEG/ASF"
    if len(head) > 188 and head[0] == 0x47 and head[188] == 0x47:
        return "MPEG-TS"
    return None


def _describe(head: bytes) -> str:
    """What a non-media file looks like, for the error message."""
    known = {
        b"%PDF": "a PDF document",
        b"PK\x03\x04": "a ZIP archive (or an Office document)",
        b"\x1f\x8b": "a gzip archive",
        b"\x7fELF": "an executable",
        b"ID3": "an MP3 audio file",
        b"fLaC": "a FLAC audio file",
    }
    for magic, what in known.items():
        if head.startswith(magic):
            return what
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return "a WAV audio file"
    if b"\x00" not in head:
        printable = sum(32 <= byte < 127 or byte in b"\t\n\r" or byte >= 128 for byte in head)
        if printable >= 0.95 * len(head):
            start = head.lstrip().lower()
            if start.startswith((b"<!doctype html", b"<html")):
                return "an HTML page — perhaps a failed download"
            if start.startswith((b"<svg", b"<?xml")) and b"<svg" in start:
                return "an SVG drawing — rasterise it to PNG first"
            return "text"
    return "unrecognised binary data"


def _sniff(file: Path, name: str) -> str:
    head = _read_head(file, name)
    if _video_container(head):
        return "video"
    image_format = _pil_format(file, IMAGE_FORMATS)
    if image_format is not None:
        return "image"
    other_format = _pil_format(file, None)
    if other_format in _KNOWN_OTHER_IMAGE_FORMATS:
        raise MediaError(f"'{name}' is a {other_format} image, which is not supported — convert it to PNG")
    what = _describe(head)
    if what == "unrecognised binary data" and _opencv_opens(file):
        return "video"  # a container we have no magic bytes for, but FFmpeg reads it
    raise MediaError(f"'{name}' is not a video or image (looks like {what}) — {_SUPPORTED}")


# Formats Pillow can identify but we do not accept (weak-magic ones such as TGA are left out
# so that junk is not reported as an image).
_KNOWN_OTHER_IMAGE_FORMATS = {
    "PSD", "ICO", "ICNS", "EPS", "JPEG2000", "AVIF", "HEIF", "DDS", "PCX", "SGI", "QOI", "XBM",
    "XPM", "FITS", "BLP", "FLI", "CUR", "SUN", "WMF",
}  # fmt: skip


# --------------------------------------------------------------------------------------------
# Images

# Pillow's bomb check is a module global; we lift it only around a header read, under a lock.
_PIL_LIMIT_LOCK = threading.Lock()


def _open_pil(file: Path, formats: Sequence[str] | None) -> Image.Image:
    """Image.open (header only) without Pillow's DecompressionBombError: we check size ourselves."""
    allowed = None if formats is None else [f for f in formats if f in Image.OPEN]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            return Image.open(file, formats=allowed)
        except Image.DecompressionBombError:
            with _PIL_LIMIT_LOCK:
                saved = Image.MAX_IMAGE_PIXELS
                Image.MAX_IMAGE_PIXELS = None
                try:
                    return Image.open(file, formats=allowed)
                finally:
                    Image.MAX_IMAGE_PIXELS = saved


def _pil_format(file: Path, formats: Sequence[str] | None) -> str | None:
    Image.init()  # register all plugins so that Image.OPEN lists every format
    try:
        with _open_pil(file, formats) as image:
            return image.format
    except Exception:  # noqa: BLE001 - any parse failure means "not this kind of image"
        return None


def _check_pixels(size: tuple[int, int], name: str, limits: MediaLimits, what: str) -> None:
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


def _decode_image_file(file: Path, name: str, limits: MediaLimits) -> tuple[np.ndarray, list[str]]:
    """The first frame as RGB uint8, and the warnings for the user (frames not read, values rescaled)."""
    try:
        image = _open_pil(file, IMAGE_FORMATS)
    except Exception as err:  # noqa: BLE001 - sniffing said image: the header is broken
        raise MediaError(f"'{name}': corrupt image header (PIL: {_one_line(err)}) — re-export it") from None
    with image:
        _check_pixels(image.size, name, limits, "image")  # before any pixel is decoded
        notes = _unread_frames(image, name)
        try:
            return _pil_to_rgb(image, name, notes), notes
        except _PillowDecodeError:
            # Pillow cannot decode some valid TIFF layouts (uncompressed subsampled YCbCr: "truncated"); OpenCV's
            # libtiff reads them, and returns None for a file that really is truncated or corrupt
            rgb = _opencv_tiff(file) if image.format == "TIFF" else None
            if rgb is None:
                raise
            return rgb, notes


def _opencv_tiff(file: Path) -> np.ndarray | None:
    """The first page of a TIFF as RGB uint8 through OpenCV (EXIF orientation applied), or None."""
    cv2 = _import_cv2()
    if cv2 is None:
        return None
    logging = cv2.utils.logging
    with _OPENCV_LOG_LOCK:  # libtiff's complaints about a broken file would print around our one-line error
        level = logging.getLogLevel()
        logging.setLogLevel(logging.LOG_LEVEL_SILENT)
        try:
            bgr = cv2.imread(str(file), cv2.IMREAD_COLOR)
        except cv2.error:
            bgr = None
        finally:
            logging.setLogLevel(level)
    return None if bgr is None else np.ascontiguousarray(bgr[..., ::-1])


_OPENCV_LOG_LOCK = threading.Lock()  # OpenCV's log level is process-wide


class _PillowDecodeError(MediaError):
    """Pillow could not decode the pixels (truncated or corrupt data, or a layout it does not read)."""


def _unread_frames(image: Image.Image, name: str) -> list[str]:
    """A warning when the file holds more frames or pages than the first, which alone is read (MPO's
    second picture is a phone's preview or depth map, not content: no warning)."""
    if image.format == "MPO" or not getattr(image, "is_animated", False):
        return []
    count = getattr(image, "n_frames", 2)
    if image.format == "TIFF":
        return [f"'{name}' is a multi-page TIFF ({count} pages): only the first page is read"]
    kind = {"PNG": "PNG (APNG)", "WEBP": "WebP"}.get(image.format, image.format)
    what = f"'{name}' is an animated {kind} ({count} frames): only the first frame is read"
    return [f"{what} — convert it to a video (e.g. ffmpeg -i {Path(name).name} out.mp4) to use them all"]


def _pil_to_rgb(image: Image.Image, name: str, notes: list[str]) -> np.ndarray:
    """Decode (first frame/page), apply EXIF orientation, convert to RGB uint8 HxWx3."""
    try:
        image.load()
        image = ImageOps.exif_transpose(image)
        return _rgb_array(image, name, notes)
    except MediaError:
        raise
    except Exception as err:  # noqa: BLE001 - Pillow raises OSError, SyntaxError, zlib.error...
        detail = _one_line(err)
        if "truncated" in detail.lower():
            raise _PillowDecodeError(
                f"'{name}': the image is truncated (PIL: {detail}) — re-download or re-export it"
            ) from None
        raise _PillowDecodeError(
            f"'{name}': corrupt image data (PIL: {detail}) — re-export or re-download it"
        ) from None


def _rgb_array(image: Image.Image, name: str, notes: list[str]) -> np.ndarray:
    if image.mode in ("I", "I;16", "I;16B", "I;16L", "I;16N", "F"):
        gray = _wide_to_uint8(np.asarray(image), image.mode, name, notes)
        return np.ascontiguousarray(np.repeat(gray[..., None], 3, axis=2))
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        image = Image.alpha_composite(white, rgba)
    return np.array(image.convert("RGB"), dtype=np.uint8)


def _wide_to_uint8(values: np.ndarray, mode: str, name: str, notes: list[str]) -> np.ndarray:
    """A 16-bit, 32-bit integer or float grayscale file onto 8 bits. A 16-bit file is divided by 257 (a dark one
    stays dark). Values in the usual ranges (float in [0, 1] or [0, 255], 32-bit integers in [0, 65535]) are
    scaled as :func:`_to_uint8` does; others (a 32-bit float TIFF of
    measurements, negative integers) are stretched from their minimum to their maximum, with a warning,
    since clipping them to [0, 255] would leave a blank or saturated picture."""
    if mode == "F" and not np.isfinite(values).all():
        raise MediaError(
            f"'{name}': the image holds NaN or infinite values — replace them (e.g. with 0) and save it again"
        )
    if mode.startswith("I;16"):  # declared 16-bit: scale from 16 bits even when every value is dark (<= 255)
        return np.clip(np.rint(values.astype(np.float64) / 257.0), 0, 255).astype(np.uint8)
    low, high = float(values.min(initial=0.0)), float(values.max(initial=0.0))
    usual_high = (1.0 if high <= 1.0 else 255.0) if mode == "F" else 65535.0
    if (low >= 0.0 and high <= usual_high) or high == low:
        return _to_uint8(values)
    kind = "32-bit float" if mode == "F" else "32-bit integer"
    notes.append(f"'{name}' is a {kind} image with values {low:.4g} to {high:.4g}: stretched to 0-255")
    stretched = (values.astype(np.float64) - low) * (255.0 / (high - low))
    return np.clip(np.rint(stretched), 0, 255).astype(np.uint8)


def _to_uint8(array: np.ndarray) -> np.ndarray:
    """Scale an array to uint8: bool -> 0/255, float in [0,1] (else [0,255]), 16-bit -> /257."""
    if array.dtype == np.uint8:
        return array
    if array.dtype == np.bool_:
        return array.astype(np.uint8) * 255
    values = array.astype(np.float64)
    if not np.isfinite(values).all():
        raise MediaError("image array contains NaN or infinity — clean it before loading")
    peak = float(values.max(initial=0.0))
    if np.issubdtype(array.dtype, np.floating) and peak <= 1.0:
        values = values * 255.0
    elif peak > 255:
        values = values / 257.0  # 16-bit range onto 8 bits
    return np.clip(np.rint(values), 0, 255).astype(np.uint8)


def _array_to_rgb(array: np.ndarray, limits: MediaLimits) -> np.ndarray:
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[..., 0]
    if array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[2] not in (3, 4)):
        raise MediaError(f"image array has shape {tuple(array.shape)}; expected HxW, HxWx3 (RGB) or HxWx4 (RGBA)")
    if not (np.issubdtype(array.dtype, np.number) or array.dtype == np.bool_):
        raise MediaError(f"image array has dtype {array.dtype}; expected uint8, float, bool or uint16")
    _check_pixels((array.shape[1], array.shape[0]), "<array>", limits, "image")
    pixels = _to_uint8(array)
    if pixels.ndim == 2:
        pixels = np.repeat(pixels[..., None], 3, axis=2)
    elif pixels.shape[2] == 4:
        alpha = pixels[..., 3:].astype(np.float32) / 255.0
        pixels = np.rint(pixels[..., :3] * alpha + 255.0 * (1.0 - alpha)).astype(np.uint8)
    return np.ascontiguousarray(pixels)


def _image_media(rgb: np.ndarray, notes: list[str], path: str | None) -> Media:
    return Media(kind="image", frames=[rgb], times=[0.0], path=path, warnings=notes, backend="pil")


# --------------------------------------------------------------------------------------------
# Videos


def _import_decord() -> ModuleType | None:
    try:
        import decord
    except ImportError:
        return None
    return decord


def _import_cv2() -> ModuleType | None:
    try:
        import cv2
    except ImportError:
        return None
    return cv2


def quiet_decoders() -> None:
    """Silence FFmpeg's own logging in decord and in OpenCV for this process ("[mjpeg @ 0x…] No JPEG data found"
    per broken frame): a decoder failure already becomes one :class:`MediaError`, and those lines would print
    around it. Process-wide, so the library never calls it; the CLI and the app, which own their process, do,
    before the first video is opened (OpenCV reads OPENCV_FFMPEG_LOGLEVEL once, when FFmpeg starts; a value
    already set is kept). VISUALKV_DEBUG=1 keeps them."""
    if os.environ.get("VISUALKV_DEBUG"):
        return
    os.environ.setdefault("OPENCV_FFMPEG_LOGLEVEL", "-8")  # AV_LOG_QUIET
    decord = _import_decord()
    if decord is not None:
        decord.logging.set_level(decord.logging.QUIET)


def _opencv_opens(file: Path) -> bool:
    cv2 = _import_cv2()
    if cv2 is None:
        return False
    capture = cv2.VideoCapture(str(file))
    try:
        return bool(capture.isOpened()) and capture.get(cv2.CAP_PROP_FRAME_COUNT) > 0
    finally:
        capture.release()


@dataclass
class _VideoInfo:
    frame_count: int  # 0 when the container does not say
    fps: float
    width: int = 0  # 0 when unknown
    height: int = 0
    rotation: int = 0  # degrees clockwise the player should rotate the picture


def _valid_fps(fps: float) -> bool:
    return math.isfinite(fps) and 0 < fps <= 1000


def _probe_opencv(file: Path) -> _VideoInfo | None:
    """Frame count, fps, size and rotation from the container header (no stream decoding)."""
    cv2 = _import_cv2()
    if cv2 is None:
        return None
    capture = cv2.VideoCapture(str(file))
    try:
        if not capture.isOpened():
            return None
        return _VideoInfo(
            frame_count=max(0, int(capture.get(cv2.CAP_PROP_FRAME_COUNT))),
            fps=float(capture.get(cv2.CAP_PROP_FPS)),
            width=int(capture.get(cv2.CAP_PROP_FRAME_WIDTH)),
            height=int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT)),
            rotation=int(capture.get(cv2.CAP_PROP_ORIENTATION_META)) % 360,
        )
    finally:
        capture.release()


def _check_video_info(info: _VideoInfo, name: str, limits: MediaLimits) -> None:
    if info.frame_count > 0 and _valid_fps(info.fps):
        seconds = info.frame_count / info.fps
        if seconds > limits.max_video_seconds:
            # the header's own figures, so that a damaged one (a wrong timescale: 0.01 fps) shows as such
            raise MediaError(
                f"'{name}': video is {_human_duration(seconds)} long ({info.frame_count:,} frames at "
                f"{info.fps:.3g} fps, per its header); the limit is {_human_duration(limits.max_video_seconds)} "
                "— trim it (e.g. ffmpeg -t) or raise MediaLimits.max_video_seconds"
            )
    if info.width > 0 and info.height > 0:
        _check_pixels((info.width, info.height), name, limits, "video frame")


def _human_duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.1f} s"


class _DecordReader:
    """decord VideoReader, re-created after an error: after a failed frame its decoder state is
    unreliable (the next seek fails too). Gives up after a few failures, because each re-open
    re-reads the whole packet index."""

    _MAX_FAILURES = 3

    def __init__(self, file: Path) -> None:
        self._decord = _import_decord()
        self._path = str(file)
        self._reader = self._open()
        self._failures = 0
        fps = float(self._reader.get_avg_fps())
        self.info = _VideoInfo(frame_count=len(self._reader), fps=fps)

    def _open(self) -> Any:  # decord has no type stubs
        return self._decord.VideoReader(self._path, num_threads=0)

    def read_many(self, indices: list[int]) -> dict[int, np.ndarray]:
        """Decode frames in one batch; on failure frame by frame, leaving out failed ones."""
        try:
            batch = self._reader.get_batch(indices).asnumpy()  # (N, H, W, 3) RGB
        except Exception:  # noqa: BLE001 - decord raises DECORDError, RuntimeError, ...
            self._reader = None
        else:
            if batch.ndim == 4 and batch.shape[3] == 3:
                return {index: batch[k] for k, index in enumerate(indices)}
        decoded = {index: self._read_one(index) for index in indices}
        return {index: frame for index, frame in decoded.items() if frame is not None}

    def _read_one(self, index: int) -> np.ndarray | None:
        if self._failures >= self._MAX_FAILURES:
            return None
        try:
            if self._reader is None:
                self._reader = self._open()
            frame = self._reader[index].asnumpy()
        except Exception:  # noqa: BLE001 - any decord failure means "not decodable here"
            frame = None
        if frame is None or frame.ndim != 3 or frame.shape[2] != 3:
            self._failures += 1
            self._reader = None
            return None
        return frame


class _OpenCVReader:
    """cv2.VideoCapture reading frames by index; OpenCV applies rotation metadata itself.

    Short forward gaps are read sequentially (grab), longer ones seek. An FFmpeg seek can land
    a frame early after a corrupt frame, so each grabbed frame's timestamp decides which index
    it really is; a target frame that cannot be decoded gives None.
    """

    def __init__(self, file: Path, fps: float) -> None:
        self._cv2 = _import_cv2()
        self._capture = self._cv2.VideoCapture(str(file))
        if not self._capture.isOpened():
            raise OSError("OpenCV cannot open the file")
        self._fps = fps
        self._max_gap = self.max_gap_for(fps)
        self._last = -1  # index of the last grabbed frame

    @staticmethod
    def max_gap_for(fps: float) -> int:
        """Grabbing up to ~4 s forward is cheaper than a seek (which decodes from a keyframe)."""
        return max(16, int(4 * fps))

    def read(self, index: int) -> np.ndarray | None:
        if not (self._last < index <= self._last + self._max_gap):
            self._capture.set(self._cv2.CAP_PROP_POS_FRAMES, index)
            self._last = index - 1
        # A few extra steps for seeks that land early.
        for _ in range(index - self._last + 8):
            if not self._capture.grab():
                self._last += 1  # a failed grab still consumes that frame's packet
                if self._last >= index:
                    return None
                continue
            seconds = self._capture.get(self._cv2.CAP_PROP_POS_MSEC) / 1000.0
            self._last = math.floor(seconds * self._fps + 0.5)
            if self._last == index:
                return self._retrieve()
            if self._last > index:
                return None  # the stream moved past the target: it was undecodable
        return None

    def _retrieve(self) -> np.ndarray | None:
        ok, bgr = self._capture.retrieve()
        if not ok or bgr is None:
            return None
        return self._cv2.cvtColor(bgr, self._cv2.COLOR_BGR2RGB)

    def close(self) -> None:
        self._capture.release()


def _count_frames_opencv(file: Path, fps: float, limits: MediaLimits) -> int:
    """Decode the stream to count its frames (for containers that do not state the count),
    stopping just past the duration limit."""
    cv2 = _import_cv2()
    capture = cv2.VideoCapture(str(file))
    stop_after = math.ceil(limits.max_video_seconds * fps)
    count = 0
    try:
        while count <= stop_after and capture.grab():
            count += 1
    finally:
        capture.release()
    return count


def _read_opencv(file: Path, fps: float, indices: list[int]) -> dict[int, np.ndarray]:
    try:
        reader = _OpenCVReader(file, fps)
    except OSError:
        return {}
    try:
        frames = {index: reader.read(index) for index in indices}
    finally:
        reader.close()
    return {index: frame for index, frame in frames.items() if frame is not None}


def _check_backends(backend: str) -> tuple[bool, bool]:
    """Which of decord / OpenCV may be used; refuses a backend that is not installed."""
    if backend not in ("auto", "decord", "opencv"):
        raise MediaError(f"unknown video backend {backend!r} — use 'auto', 'decord' or 'opencv'")
    has_decord = _import_decord() is not None
    has_cv2 = _import_cv2() is not None
    if backend == "decord" and not has_decord:
        raise MediaError("decord is not installed — pip install decord, or use backend='opencv'")
    if backend == "opencv" and not has_cv2:
        raise MediaError("OpenCV is not installed — pip install opencv-python-headless, or use backend='decord'")
    if not (has_decord or has_cv2):
        raise MediaError("no video decoder is installed — pip install decord opencv-python-headless")
    return has_decord and backend != "opencv", has_cv2 and backend != "decord"


def _open_decord(
    file: Path, name: str, backend: str, header: _VideoInfo | None, notes: list[str]
) -> _DecordReader | None:
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
        return _DecordReader(file)
    except Exception as err:  # noqa: BLE001 - decord raises DECORDError, RuntimeError, ...
        if backend == "decord":
            raise MediaError(
                f"'{name}': decord cannot open this video ({_one_line(err)}) — try backend='opencv' or re-encode it"
            ) from None
        notes.append(f"decord could not open the video ({_one_line(err)}); used OpenCV")
        return None


def _load_video_file(
    file: Path, name: str, limits: MediaLimits, sampling: FrameSampling, backend: str, lazy: bool = True
) -> Media:
    use_decord, use_cv2 = _check_backends(backend)
    notes: list[str] = []
    # The header probe comes first so that an over-long video is refused before decord builds
    # its packet index (which reads the whole file) and before anything is decoded.
    header = _probe_opencv(file)
    if header is not None:
        _check_video_info(header, name, limits)
    decord_reader = _open_decord(file, name, backend, header, notes) if use_decord else None
    info = decord_reader.info if decord_reader is not None else header
    if info is None or (decord_reader is None and not use_cv2):
        raise MediaError(
            f"'{name}': cannot open the video with decord or OpenCV — the file is damaged, truncated or "
            "its codec is unsupported; re-encode it (e.g. ffmpeg -i in -c:v libx264 out.mp4)"
        )
    _check_video_info(info, name, limits)
    if not _valid_fps(info.fps):
        notes.append(f"no valid frame rate stated ({info.fps}); assumed {_FALLBACK_FPS:g} fps")
        info.fps = _FALLBACK_FPS
    # A count of 0 comes only from the OpenCV header: decord always counts frames.
    if info.frame_count <= 0:
        info.frame_count = _count_frames_opencv(file, info.fps, limits)
        _check_video_info(info, name, limits)

    indices = sample_frame_indices(info.frame_count, info.fps, sampling)
    limits.check_frame_count(len(indices), name, sampling.fps)  # refused before any frame is decoded
    if lazy:
        return _lazy_video_media(file, name, limits, info, indices, decord_reader, use_cv2, notes)
    decoded = decord_reader.read_many(indices) if decord_reader is not None else {}
    used = ["decord"] if decoded else []
    missing = [i for i in indices if i not in decoded]
    if missing and use_cv2:
        from_opencv = _read_opencv(file, info.fps, missing)
        decoded.update(from_opencv)
        used += ["opencv"] if from_opencv else []
    return _video_media(name, limits, info, indices, decoded, "+".join(used), notes)


def _no_decodable_frame(name: str, sampled: int) -> MediaError:
    return MediaError(
        f"'{name}': video has no decodable frame (sampled {sampled}, none decoded) "
        "— re-encode it (e.g. ffmpeg -i in -c:v libx264 out.mp4)"
    )


def _video_media(
    name: str,
    limits: MediaLimits,
    info: _VideoInfo,
    indices: list[int],
    decoded: dict[int, np.ndarray],
    backend: str,
    notes: list[str],
) -> Media:
    kept = [i for i in indices if i in decoded]
    if not kept:
        raise _no_decodable_frame(name, len(indices))
    for index in indices:
        if index not in decoded:
            seconds = index / info.fps
            notes.append(f"frame {index} (t={seconds:.2f} s) could not be decoded; skipped")
    frames = [np.ascontiguousarray(decoded[i], dtype=np.uint8) for i in kept]
    if all(_is_flat(frame) for frame in frames):  # stops at the first frame with content
        notes.append(_flat_video_note(name))
    return _sampled_video(frames, frames[0].shape, name, limits, info, kept, notes, backend)


def _sampled_video(
    frames: Sequence[np.ndarray],
    frame_shape: tuple[int, ...],
    name: str,
    limits: MediaLimits,
    info: _VideoInfo,
    indices: list[int],
    notes: list[str],
    backend: str,
) -> Media:
    """The video Media of sampled source frames `indices` (eager list or lazy sequence), its frame size
    checked against the pixel limit."""
    height, width = frame_shape[:2]
    _check_pixels((width, height), name, limits, "video frame")
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


# --------------------------------------------------------------------------------------------
# Lazy videos


def resize_to_width(frame: np.ndarray, width: int) -> np.ndarray:
    """RGB frame resized to ``width`` px wide, aspect kept (height rounded, at least 1): INTER_AREA
    when shrinking, INTER_LINEAR when enlarging (the same resize ``visualkv.media.saliency`` applies, so
    a frame resized here passes through its own resize unchanged)."""
    h, w = frame.shape[:2]
    height = max(1, round(h * width / w))
    cv2 = _import_cv2()
    if cv2 is None:
        resample = Image.Resampling.BOX if w > width else Image.Resampling.BILINEAR
        return np.asarray(Image.fromarray(frame).resize((width, height), resample))
    interp = cv2.INTER_AREA if w > width else cv2.INTER_LINEAR
    return cv2.resize(frame, (width, height), interpolation=interp)


class _FrameDecoder:
    """Decodes one frame by source index: OpenCV first (sequential reads forward, a seek for a jump),
    decord where OpenCV is missing or fails on that frame. Why OpenCV first, although decord's random
    access is the faster seek: over a 30-minute video (1,800 frames) a composed prefill reading frames
    through decord grew the process by 0.1 to 1 GB from run to run (its decoder's buffers), through
    OpenCV by under 20 MB, so only OpenCV keeps an hour of video in bounded memory."""

    def __init__(self, file: Path, fps: float, decord_reader: _DecordReader | None, use_cv2: bool) -> None:
        self._file, self._fps = file, fps
        self._decord = decord_reader
        self._use_cv2 = use_cv2
        self._opencv: _OpenCVReader | None = None
        self.used: set[str] = set()  # backends that produced a frame

    def read(self, index: int) -> np.ndarray | None:
        frame = self._read_cv2(index)
        if frame is not None or self._decord is None:
            return frame
        frame = self._decord._read_one(index)
        if frame is not None:
            self.used.add("decord")
        return frame

    def _read_cv2(self, index: int) -> np.ndarray | None:
        if not self._use_cv2:
            return None
        if self._opencv is None:
            try:
                self._opencv = _OpenCVReader(self._file, self._fps)
            except OSError:
                self._use_cv2 = False
                return None
        frame = self._opencv.read(index)
        if frame is not None:
            self.used.add("opencv")
        return frame

    def close(self) -> None:
        if self._opencv is not None:
            self._opencv.close()
        self._decord = self._opencv = None


class _LiveCount:
    """How many decoded frames are alive (referenced anywhere), and the most ever at once."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    def born(self) -> None:
        self.now += 1
        self.peak = max(self.peak, self.now)

    def died(self) -> None:
        self.now -= 1


class LazyFrames(Sequence[np.ndarray]):
    """A video's sampled frames, decoded when indexed: a read-only ``Sequence[np.ndarray]``.

    ``frames[k]`` decodes sampled frame k (RGB uint8, HxWx3) unless it is among the last
    ``cache_size`` decoded (so a Qwen temporal patch or a block's frames are not decoded twice);
    ``frames[a:b]`` gives a list. Decoding is serialised by a lock (the app may draw thumbnails
    while a prefill runs). A frame that cannot be decoded is replaced, consistently, by the nearest
    earlier decodable one (frames before the first decodable one: by that one), and a warning is
    appended to the Media's ``warnings``. ``frame_shape`` comes from the first decodable frame,
    decoded when the video is loaded. Statistics for tests and benchmarks: ``decoded`` (decode
    calls), ``live_frames`` / ``peak_live_frames`` (decoded arrays alive anywhere, now / at most).
    """

    def __init__(
        self,
        decoder: _FrameDecoder,
        indices: Sequence[int],
        fps: float,
        notes: list[str],
        name: str,
        cache_size: int = 4,
    ) -> None:
        if cache_size < 1:
            raise MediaError(f"LazyFrames.cache_size must be >= 1, got {cache_size}")
        self._decoder = decoder
        self._indices = list(indices)
        self._fps = fps
        self._notes = notes
        self.cache_size = cache_size
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._stand_ins: dict[int, int] = {}  # undecodable position -> position shown instead
        self._lock = threading.RLock()
        self._live = _LiveCount()
        self.decoded = 0
        self._source_shape: tuple[int, ...] | None = None  # decoded size (first decodable frame)
        self._shape: tuple[int, ...] | None = None  # size of the frames given out (== source unless resized)
        self._resize: Callable[[np.ndarray], np.ndarray] | None = None
        self._base: LazyFrames | None = None  # the sequence a resized view shares its decoder with
        self._flat = _FlatWatch(name, len(self._indices), notes)  # shared with resized views
        weakref.finalize(self, decoder.close)
        first = next((k for k in range(len(self._indices)) if self._fetch(k, remember=True) is not None), None)
        if first is None:
            raise _no_decodable_frame(name, len(self._indices))
        for k in range(first):
            self._stand_in(k, first)

    # -- Sequence ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._indices)

    def __getitem__(self, key):  # int -> array, slice -> list of arrays
        if isinstance(key, slice):
            return [self._get(k) for k in range(*key.indices(len(self)))]
        k = int(key)
        if k < 0:
            k += len(self)
        if not 0 <= k < len(self):
            raise IndexError(f"frame {key} out of range ({len(self)} frames)")
        return self._get(k)

    def __repr__(self) -> str:
        h, w = self.frame_shape[:2]
        return f"LazyFrames({len(self)} x {w}x{h}, cached={len(self._cache)})"

    # -- metadata and statistics -------------------------------------------------------------
    @property
    def frame_shape(self) -> tuple[int, ...]:
        """(height, width, 3) of the frames this sequence gives (a resized view: the resized size)."""
        assert self._shape is not None
        return self._shape

    @property
    def source_shape(self) -> tuple[int, ...]:
        """(height, width, 3) of the frames as decoded."""
        assert self._source_shape is not None
        return self._source_shape

    @property
    def is_resized(self) -> bool:
        return self._resize is not None

    def resized(self, size: tuple[int, int], resize: Callable[[np.ndarray], np.ndarray]) -> LazyFrames:
        """A view of the same frames at ``size`` (height, width): each frame goes through ``resize`` (an
        (H, W, 3) uint8 frame -> (height, width, 3) uint8) right after it is decoded, before it is cached, so
        this view holds small frames only (one full-size frame is alive while it is being resized). It
        shares this sequence's decoder, lock, undecodable-frame stand-ins and warnings, and has its own
        cache and statistics. Nothing is decoded here."""
        # a shallow copy shares the decoder, indices, lock, warnings and the undecodable-frame stand-ins (an
        # undecodable frame is looked for, and reported, once); what is the view's own is set anew below
        view = copy.copy(self)
        view._cache = OrderedDict()
        view._live = _LiveCount()
        view.decoded = 0
        view._shape = (int(size[0]), int(size[1]), *self.source_shape[2:])
        view._resize = resize
        view._base = self._base or self  # keeps the decoder open (it is closed when the base is collected)
        return view

    @property
    def cached_bytes(self) -> int:
        return sum(int(f.nbytes) for f in self._cache.values())

    @property
    def live_frames(self) -> int:
        return self._live.now

    @property
    def peak_live_frames(self) -> int:
        return self._live.peak

    @property
    def backends_used(self) -> set[str]:
        return set(self._decoder.used)

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()

    def iter_small(self, width: int) -> Iterator[np.ndarray]:
        """Every frame in order, resized to ``width`` (see :func:`resize_to_width`) right after
        decoding; bypasses the cache, so one full-size frame is alive at a time."""
        for k in range(len(self)):
            with self._lock:
                frame = self._get(k, remember=False)
            small = resize_to_width(frame, width)
            del frame
            yield small

    # -- decoding ----------------------------------------------------------------------------
    def _get(self, k: int, remember: bool = True) -> np.ndarray:
        with self._lock:
            k = self._stand_ins.get(k, k)
            cached = self._cache.get(k)
            if cached is not None:
                self._cache.move_to_end(k)
                return cached
            frame = self._fetch(k, remember)
            if frame is not None:
                return frame
            # undecodable: the nearest earlier decodable frame stands in (position 0 always decodes
            # or has a stand-in from the constructor)
            for j in range(k - 1, -1, -1):
                j = self._stand_ins.get(j, j)
                frame = self._cache.get(j)
                if frame is None:
                    frame = self._fetch(j, remember)
                if frame is not None:
                    self._stand_in(k, j)
                    return frame
            raise AssertionError("unreachable: the first frame decodes or has a stand-in")

    def _fetch(self, k: int, remember: bool) -> np.ndarray | None:
        """Decode position k (no stand-in); None if undecodable."""
        frame = self._decoder.read(self._indices[k])
        self.decoded += 1
        if frame is None:
            return None
        frame = np.ascontiguousarray(frame, dtype=np.uint8)
        self._flat.saw(k, frame)
        if self._source_shape is None:
            self._source_shape = self._shape = tuple(frame.shape)
        elif tuple(frame.shape) != self._source_shape:  # a mid-stream size change: keep one frame size
            frame = np.ascontiguousarray(_resize_to(frame, self._source_shape))
        if self._resize is not None:  # resized before it is cached: the full-size frame dies here
            frame = np.ascontiguousarray(self._resize(frame), dtype=np.uint8)
            if tuple(frame.shape) != self._shape:
                raise AssertionError(f"frame resized to {frame.shape}, expected {self._shape}")
        self._live.born()
        weakref.finalize(frame, self._live.died)
        if remember:
            self._cache[k] = frame
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return frame

    def _stand_in(self, k: int, j: int) -> None:
        self._stand_ins[k] = j
        index, other = self._indices[k], self._indices[j]
        self._notes.append(
            f"frame {index} (t={index / self._fps:.2f} s) could not be decoded; frame {other} "
            f"(t={other / self._fps:.2f} s) shown in its place"
        )


def _is_flat(frame: np.ndarray, tolerance: int = 2) -> bool:
    """Every channel of an (H, W, 3) frame one value, within `tolerance` levels: what a video whose picture data
    was zeroed or lost decodes to (the decoder's grey). A sparse grid of pixels is tried first, so a frame with
    content costs next to nothing."""
    for sample in (frame[::16, ::16], frame):
        pixels = sample.reshape(-1, sample.shape[-1])
        if int((pixels.max(axis=0).astype(np.int16) - pixels.min(axis=0)).max()) > tolerance:
            return False
    return True


def _flat_video_note(name: str) -> str:
    return (
        f"'{name}': every sampled frame is one flat colour, so its picture data is likely damaged (the model "
        "sees a blank video) — re-download or re-encode it"
    )


class _FlatWatch:
    """Says once, in the Media's warnings, that every sampled frame of a lazily decoded video is flat (`_is_flat`),
    when the last of them has been decoded; looks no further once a frame with content is seen."""

    def __init__(self, name: str, frames: int, notes: list[str]) -> None:
        self.name, self.frames, self.notes = name, frames, notes
        self.flat: set[int] = set()  # positions decoded so far, all flat
        self.done = False  # a frame with content was seen, or the warning was given

    def saw(self, k: int, frame: np.ndarray) -> None:
        if self.done or k in self.flat:
            return
        if not _is_flat(frame):
            self.done = True
            return
        self.flat.add(k)
        if len(self.flat) == self.frames:
            self.notes.append(_flat_video_note(self.name))
            self.done = True


def _resize_to(frame: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    cv2 = _import_cv2()
    if cv2 is None:
        return np.asarray(Image.fromarray(frame).resize((shape[1], shape[0])))
    return cv2.resize(frame, (shape[1], shape[0]), interpolation=cv2.INTER_AREA)


def _lazy_video_media(
    file: Path,
    name: str,
    limits: MediaLimits,
    info: _VideoInfo,
    indices: list[int],
    decord_reader: _DecordReader | None,
    use_cv2: bool,
    notes: list[str],
) -> Media:
    if not indices:
        raise _no_decodable_frame(name, 0)
    decoder = _FrameDecoder(file, info.fps, decord_reader, use_cv2)
    frames = LazyFrames(decoder, indices, info.fps, notes, name)
    backend = "+".join(b for b in ("decord", "opencv") if b in decoder.used)
    return _sampled_video(frames, frames.frame_shape, name, limits, info, indices, notes, backend)
