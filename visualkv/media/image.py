"""Decode images to RGB uint8 (HxWx3) with Pillow.

Formats: PNG, JPEG (and phone MPO), WebP, BMP, GIF and TIFF (first frame / page only, with a warning when
there are more) and PPM. EXIF orientation is applied, alpha composited on white, 16-bit scaled to 8 bits;
a float or 32-bit image outside the usual ranges is stretched (with a warning), one holding NaN refused.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from visualkv.errors import MediaError
from visualkv.media.backends import import_cv2
from visualkv.media.core import Media, MediaLimits, check_pixels
from visualkv.media.messages import one_line

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


def pil_format(file: Path, formats: Sequence[str] | None) -> str | None:
    Image.init()  # register all plugins so that Image.OPEN lists every format
    try:
        with _open_pil(file, formats) as image:
            return image.format
    except Exception:  # noqa: BLE001 - any parse failure means "not this kind of image"
        return None


def decode_image_file(file: Path, name: str, limits: MediaLimits) -> tuple[np.ndarray, list[str]]:
    """The first frame as RGB uint8, and the warnings for the user (frames not read, values rescaled)."""
    try:
        image = _open_pil(file, IMAGE_FORMATS)
    except Exception as err:  # noqa: BLE001 - sniffing said image: the header is broken
        raise MediaError(f"'{name}': corrupt image header (PIL: {one_line(err)}) — re-export it") from None
    with image:
        check_pixels(image.size, name, limits, "image")  # before any pixel is decoded
        notes = unread_frames(image, name)
        try:
            return pil_to_rgb(image, name, notes), notes
        except _PillowDecodeError:
            # Pillow cannot decode some valid TIFF layouts (uncompressed subsampled YCbCr: "truncated"); OpenCV's
            # libtiff reads them, and returns None for a file that really is truncated or corrupt
            rgb = _opencv_tiff(file) if image.format == "TIFF" else None
            if rgb is None:
                raise
            return rgb, notes


_OPENCV_LOG_LOCK = threading.Lock()  # OpenCV's log level is process-wide


def _opencv_tiff(file: Path) -> np.ndarray | None:
    """The first page of a TIFF as RGB uint8 through OpenCV (EXIF orientation applied), or None."""
    cv2 = import_cv2()
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


class _PillowDecodeError(MediaError):
    """Pillow could not decode the pixels (truncated or corrupt data, or a layout it does not read)."""


def unread_frames(image: Image.Image, name: str) -> list[str]:
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


def pil_to_rgb(image: Image.Image, name: str, notes: list[str]) -> np.ndarray:
    """Decode (first frame/page), apply EXIF orientation, convert to RGB uint8 HxWx3."""
    try:
        image.load()
        image = ImageOps.exif_transpose(image)
        return _rgb_array(image, name, notes)
    except MediaError:
        raise
    except Exception as err:  # noqa: BLE001 - Pillow raises OSError, SyntaxError, zlib.error...
        detail = one_line(err)
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


def array_to_rgb(array: np.ndarray, limits: MediaLimits) -> np.ndarray:
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[..., 0]
    if array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[2] not in (3, 4)):
        raise MediaError(f"image array has shape {tuple(array.shape)}; expected HxW, HxWx3 (RGB) or HxWx4 (RGBA)")
    if not (np.issubdtype(array.dtype, np.number) or array.dtype == np.bool_):
        raise MediaError(f"image array has dtype {array.dtype}; expected uint8, float, bool or uint16")
    check_pixels((array.shape[1], array.shape[0]), "<array>", limits, "image")
    pixels = _to_uint8(array)
    if pixels.ndim == 2:
        pixels = np.repeat(pixels[..., None], 3, axis=2)
    elif pixels.shape[2] == 4:
        alpha = pixels[..., 3:].astype(np.float32) / 255.0
        pixels = np.rint(pixels[..., :3] * alpha + 255.0 * (1.0 - alpha)).astype(np.uint8)
    return np.ascontiguousarray(pixels)


def image_media(rgb: np.ndarray, notes: list[str], path: str | None) -> Media:
    return Media(kind="image", frames=[rgb], times=[0.0], path=path, warnings=notes, backend="pil")
