"""File checks and content sniffing: is this path a readable file within the size limit, and is it an
image or a video (from magic bytes and Pillow's header, never the extension)?"""

from __future__ import annotations

import stat
from pathlib import Path

from visualkv.errors import MediaError
from visualkv.media.core import MediaLimits, PathLike
from visualkv.media.image import IMAGE_FORMATS, pil_format
from visualkv.media.messages import human_bytes, one_line
from visualkv.media.probe import opencv_opens

_SUPPORTED = "use a PNG/JPEG/WebP/BMP/GIF/TIFF image or an MP4/WebM/AVI/MKV/MOV video"


def check_file(path: PathLike, name: str, limits: MediaLimits | None) -> Path:
    """The path must be a readable, non-empty regular file within the size limit."""
    file = Path(path)
    try:
        info = file.stat()
    except FileNotFoundError:
        raise MediaError(f"cannot read '{name}': no such file — check the path") from None
    except PermissionError:
        raise MediaError(f"cannot read '{name}': permission denied — check the file's permissions") from None
    except OSError as err:
        raise MediaError(f"cannot read '{name}': {one_line(err.strerror or err)}") from None
    if stat.S_ISDIR(info.st_mode):
        raise MediaError(f"cannot read '{name}': it is a directory — pass an image or video file")
    if not stat.S_ISREG(info.st_mode):
        raise MediaError(f"cannot read '{name}': not a regular file — pass an image or video file")
    if info.st_size == 0:
        raise MediaError(f"cannot read '{name}': the file is empty (0 bytes) — re-export or re-download it")
    if limits is not None and info.st_size > limits.max_file_bytes:
        raise MediaError(
            f"'{name}' is {human_bytes(info.st_size)}; the limit is {human_bytes(limits.max_file_bytes)}"
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
        raise MediaError(f"cannot read '{name}': {one_line(err.strerror or err)}") from None


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


def sniff(file: Path, name: str) -> str:
    head = _read_head(file, name)
    if _video_container(head):
        return "video"
    image_format = pil_format(file, IMAGE_FORMATS)
    if image_format is not None:
        return "image"
    other_format = pil_format(file, None)
    if other_format in _KNOWN_OTHER_IMAGE_FORMATS:
        raise MediaError(f"'{name}' is a {other_format} image, which is not supported — convert it to PNG")
    what = _describe(head)
    if what == "unrecognised binary data" and opencv_opens(file):
        return "video"  # a container we have no magic bytes for, but FFmpeg reads it
    raise MediaError(f"'{name}' is not a video or image (looks like {what}) — {_SUPPORTED}")


# Formats Pillow can identify but we do not accept (weak-magic ones such as TGA are left out
# so that junk is not reported as an image).
_KNOWN_OTHER_IMAGE_FORMATS = {
    "PSD", "ICO", "ICNS", "EPS", "JPEG2000", "AVIF", "HEIF", "DDS", "PCX", "SGI", "QOI", "XBM",
    "XPM", "FITS", "BLP", "FLI", "CUR", "SUN", "WMF",
}  # fmt: skip
