"""Tests for visualkv.media: formats, sampling, both video backends, and every refusal."""

from __future__ import annotations

import importlib.util
import json
import struct
import sys
import warnings
import zlib
from pathlib import Path

import cv2
import numpy as np
import pytest
from PIL import Image

from visualkv.errors import MediaError, VisualKVError
from visualkv.media import (
    FrameSampling,
    Media,
    MediaLimits,
    load_image,
    load_media,
    load_video,
    media_kind,
    readers,
    sample_frame_indices,
)
from visualkv.media import video as video_module

REPO = Path(__file__).resolve().parent.parent


def _load_examples_module():
    spec = importlib.util.spec_from_file_location("make_examples", REPO / "scripts" / "make_examples.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_examples"] = module  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return module


examples = _load_examples_module()
SHORT = examples.VideoTimeline(pan_start=2.0, cut=4.0, event_start=5.0, event_seconds=1.0, end=8.0)


# --------------------------------------------------------------------------------------------
# Helpers


def write_video(path: Path, frames: list[np.ndarray], fps: float = 4.0, fourcc: str = "mp4v") -> Path:
    height, width = frames[0].shape[:2]
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*fourcc), fps, (width, height))
    assert writer.isOpened(), f"OpenCV cannot write {fourcc} to {path.suffix}"
    for frame in frames:
        writer.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
    writer.release()
    return path


def noise_frames(count: int, width: int = 64, height: int = 48, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (height, width, 3), dtype=np.uint8) for _ in range(count)]


def corrupt_mjpeg(path: Path, frames: list[int] | None) -> Path:
    """Zero the start (SOI marker and headers) of the given JPEG frames in an MJPG AVI; all if None."""
    data = bytearray(path.read_bytes())
    starts = [i for i in range(len(data) - 3) if data[i : i + 3] == b"\xff\xd8\xff"]
    for k in range(len(starts)) if frames is None else frames:
        # Frames of 64x48 noise are ~3 KB: this wipes the markers the decoder looks for.
        data[starts[k] : starts[k] + 300] = bytes(300)
    path.write_bytes(bytes(data))
    return path


def png_header_only(path: Path, width: int, height: int) -> Path:
    """A PNG whose header claims width x height, with almost no pixel data (cheap image bomb)."""

    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b""))
    return path


@pytest.fixture(scope="module")
def still() -> np.ndarray:
    return examples.make_still(96, 64, seed=3, shapes=6)


@pytest.fixture(scope="module")
def short_video(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """8 s, 4 fps, 160x96: static, pan, cut, static, 1 s red-ball event, static."""
    frames = examples.make_video_frames(160, 96, fps=4.0, seed=1, timeline=SHORT)
    path = write_video(tmp_path_factory.mktemp("video") / "short.mp4", frames)
    return path, examples.video_description(160, 96, 4.0, SHORT)


# --------------------------------------------------------------------------------------------
# Images


@pytest.mark.parametrize(
    ("suffix", "options", "tolerance"),
    [
        (".png", {}, 0),
        (".bmp", {}, 0),
        (".tiff", {}, 0),
        (".webp", {"lossless": True}, 0),
        (".jpg", {"quality": 95}, 6),
        (".gif", {}, 12),  # 256-colour palette
    ],
)
def test_image_round_trip(tmp_path: Path, still: np.ndarray, suffix: str, options: dict, tolerance: float) -> None:
    path = tmp_path / f"still{suffix}"
    Image.fromarray(still).save(path, **options)
    loaded = load_media(path)
    assert loaded.kind == "image" and media_kind(path) == "image"
    assert loaded.times == [0.0] and loaded.source_fps is None and loaded.duration is None
    assert loaded.size == (96, 64)
    (frame,) = loaded.frames
    assert frame.shape == (64, 96, 3) and frame.dtype == np.uint8
    assert np.abs(frame.astype(int) - still.astype(int)).mean() <= tolerance


def test_alpha_is_composited_on_white(tmp_path: Path) -> None:
    rgba = np.zeros((32, 32, 4), np.uint8)
    rgba[..., 0] = 200  # red channel under varying alpha
    rgba[:, 16:, 3] = 255
    Image.fromarray(rgba, "RGBA").save(tmp_path / "a.png")
    frame = load_image(tmp_path / "a.png").frames[0]
    assert frame[0, 0].tolist() == [255, 255, 255]  # fully transparent -> white
    assert frame[0, 20].tolist() == [200, 0, 0]  # opaque -> the colour itself
    same = load_image(rgba).frames[0]
    assert np.array_equal(same, frame)


def test_exif_orientation_is_applied(tmp_path: Path) -> None:
    pixels = np.zeros((40, 60, 3), np.uint8)
    pixels[:, :10] = 255  # white band on the left
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    Image.fromarray(pixels).save(tmp_path / "rot.jpg", exif=exif, quality=95)
    loaded = load_image(tmp_path / "rot.jpg")
    assert loaded.size == (40, 60)
    assert loaded.frames[0][:10].mean() > 200  # the left band is now at the top


def test_grayscale_16bit_and_gif_first_frame(tmp_path: Path) -> None:
    Image.fromarray(np.full((40, 40), 65535, np.uint16)).save(tmp_path / "g16.png")
    assert load_image(tmp_path / "g16.png").frames[0].min() == 255
    # a dark 16-bit file (every value <= 255) is still 16-bit: 200/65535 is black, not 8-bit 200
    Image.fromarray(np.full((40, 40), 200, np.uint16)).save(tmp_path / "dark16.png")
    assert load_image(tmp_path / "dark16.png").frames[0].max() == 1
    first, second = (Image.new("RGB", (40, 40), colour) for colour in ((0, 0, 255), (0, 255, 0)))
    first.save(tmp_path / "anim.gif", save_all=True, append_images=[second], duration=100)
    assert load_image(tmp_path / "anim.gif").frames[0][0, 0].tolist() == [0, 0, 255]


@pytest.mark.parametrize(
    "file, words",
    [
        ("anim.gif", "is an animated GIF (3 frames): only the first frame is read — convert it to a video"),
        ("anim.png", "is an animated PNG (APNG) (3 frames): only the first frame is read"),
        ("anim.webp", "is an animated WebP (3 frames): only the first frame is read"),
        ("pages.tif", "is a multi-page TIFF (3 pages): only the first page is read"),
    ],
)
def test_frames_past_the_first_are_named_in_a_warning(tmp_path: Path, file: str, words: str) -> None:
    first, *rest = (Image.new("RGB", (40, 40), colour) for colour in ((0, 0, 255), (0, 255, 0), (255, 0, 0)))
    first.save(tmp_path / file, save_all=True, append_images=rest, **({"duration": 100} if "anim" in file else {}))
    loaded = load_media(tmp_path / file)
    assert np.abs(loaded.frames[0][0, 0].astype(int) - [0, 0, 255]).max() <= 4  # WebP is lossy
    assert len(loaded.warnings) == 1 and words in loaded.warnings[0] and file in loaded.warnings[0]
    assert load_image(Image.open(tmp_path / file)).warnings == loaded.warnings  # a PIL image is told too
    first.save(tmp_path / ("one_" + file))  # one frame: nothing to say
    assert load_media(tmp_path / ("one_" + file)).warnings == []


def test_tiff_that_pillow_cannot_decode_is_read_with_opencv(tmp_path: Path) -> None:
    """An uncompressed TIFF tagged as 2x2-subsampled YCbCr: Pillow calls it truncated, libtiff (OpenCV) reads it."""
    from PIL import TiffImagePlugin

    tags = TiffImagePlugin.ImageFileDirectory_v2()
    tags[262], tags[530] = 6, (2, 2)  # PhotometricInterpretation YCbCr, YCbCrSubsampling 2x2
    Image.new("YCbCr", (80, 64), (128, 128, 128)).save(tmp_path / "scan.tif", tiffinfo=tags)
    with pytest.raises(OSError, match="truncated"), Image.open(tmp_path / "scan.tif") as image:
        image.load()  # the premise: Pillow alone refuses it
    loaded = load_media(tmp_path / "scan.tif")
    assert loaded.kind == "image" and loaded.size == (80, 64) and loaded.warnings == []
    assert np.abs(loaded.frames[0].astype(int) - 128).max() <= 3  # mid grey stays mid grey


def test_wide_range_grayscale_is_stretched_and_said(tmp_path: Path) -> None:
    ramp = np.linspace(-5.0, 20.0, 64 * 64, dtype=np.float32).reshape(64, 64)
    Image.fromarray(ramp, mode="F").save(tmp_path / "depth.tif")
    loaded = load_media(tmp_path / "depth.tif")
    gray = loaded.frames[0][..., 0]
    # min to max over 0-255 (clipping to [0, 255] would leave 5/25 of it black)
    assert gray.min() == 0 and gray.max() == 255 and abs(int(gray[32, 0]) - 128) <= 2
    assert loaded.warnings == [
        "'" + str(tmp_path / "depth.tif") + "' is a 32-bit float image with values -5 to 20: stretched to 0-255"
    ]
    counts = (np.arange(64 * 64).reshape(64, 64) * 1000).astype(np.int32)  # up to 4.1 million
    Image.fromarray(counts, mode="I").save(tmp_path / "counts.tif")
    stretched = load_media(tmp_path / "counts.tif")
    assert stretched.frames[0].max() == 255 and stretched.frames[0][32, 0, 0] in (127, 128)
    assert "32-bit integer image with values 0 to 4.095e+06" in stretched.warnings[0]
    # the usual ranges are scaled as before, without a warning
    unit = np.linspace(0.0, 1.0, 64 * 64, dtype=np.float32).reshape(64, 64)
    Image.fromarray(unit, mode="F").save(tmp_path / "unit.tif")
    plain = load_media(tmp_path / "unit.tif")
    assert plain.warnings == [] and plain.frames[0].max() == 255 and plain.frames[0][0, 0, 0] == 0


def test_aspect_limit_can_be_raised(tmp_path: Path) -> None:
    path = _make_bad_input("thin", tmp_path)
    assert load_media(path, limits=MediaLimits(max_aspect_ratio=400)).size == (8400, 28)
    Image.new("RGB", (28 * 200, 28)).save(tmp_path / "edge.png")
    assert load_media(tmp_path / "edge.png").size == (5600, 28)  # exactly the limit passes
    with pytest.raises(MediaError, match="max_aspect_ratio must be >= 1"):
        MediaLimits(max_aspect_ratio=0.5)


def test_pil_and_array_inputs(still: np.ndarray) -> None:
    assert np.array_equal(load_image(Image.fromarray(still)).frames[0], still)
    assert np.array_equal(load_image(still).frames[0], still)
    as_float = load_image(still.astype(np.float32) / 255.0).frames[0]
    assert np.abs(as_float.astype(int) - still.astype(int)).max() <= 1
    gray = load_image(np.full((30, 30), 7, np.uint8)).frames[0]
    assert gray.shape == (30, 30, 3) and (gray == 7).all()
    with pytest.raises(MediaError, match="shape"):
        load_image(np.zeros((30, 30, 2), np.uint8))


def test_8k_image_is_accepted() -> None:
    assert load_image(np.zeros((4320, 7680, 3), np.uint8)).size == (7680, 4320)


def test_image_bomb_refused_from_header_without_pillow_warning(tmp_path: Path) -> None:
    before = Image.MAX_IMAGE_PIXELS
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a DecompressionBombWarning would fail the test
        for side in (9000, 20000):  # 81 MP: Pillow warns; 400 MP: Pillow raises
            path = png_header_only(tmp_path / f"bomb{side}.png", side, side)
            with pytest.raises(MediaError, match=rf"{side}x{side} is [\d.]+ MP; the limit is 64.0 MP"):
                load_media(path)
    assert Image.MAX_IMAGE_PIXELS == before


# --------------------------------------------------------------------------------------------
# Refusals: each bad input gets its own one-line MediaError


def _make_bad_input(kind: str, tmp: Path) -> Path:
    if kind == "missing":
        return tmp / "nope.png"
    if kind == "directory":
        (tmp / "folder.mp4").mkdir()
        return tmp / "folder.mp4"
    if kind == "empty":
        (tmp / "empty.png").touch()
        return tmp / "empty.png"
    if kind == "text":
        (tmp / "notes.mp4").write_text("just some notes, not a video\n" * 20)
        return tmp / "notes.mp4"
    if kind == "html":
        (tmp / "page.jpg").write_text("<!DOCTYPE html><html><body>404 Not Found</body></html>\n")
        return tmp / "page.jpg"
    if kind == "pdf":
        (tmp / "paper.png").write_bytes(b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n1 0 obj\n<< /Type /Catalog >>\nendobj\n")
        return tmp / "paper.png"
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    if kind == "corrupt_png":
        Image.fromarray(noise).save(tmp / "bad.png")
        data = bytearray((tmp / "bad.png").read_bytes())
        data[100:300] = bytes(200)  # inside IDAT
        (tmp / "bad.png").write_bytes(bytes(data))
        return tmp / "bad.png"
    if kind == "truncated_jpeg":
        Image.fromarray(noise).save(tmp / "cut.jpg", quality=90)
        data = (tmp / "cut.jpg").read_bytes()
        (tmp / "cut.jpg").write_bytes(data[: len(data) // 2])
        return tmp / "cut.jpg"
    if kind == "truncated_tiff":  # refused although OpenCV is tried after Pillow for TIFFs
        Image.fromarray(np.tile(noise, (4, 4, 1))).save(tmp / "cut.tif")
        data = (tmp / "cut.tif").read_bytes()
        (tmp / "cut.tif").write_bytes(data[: len(data) // 2])
        return tmp / "cut.tif"
    if kind == "tiny":
        Image.new("RGB", (1, 1)).save(tmp / "dot.png")
        return tmp / "dot.png"
    if kind == "huge":
        return png_header_only(tmp / "huge.png", 20000, 20000)
    if kind == "undecodable_video":
        path = write_video(tmp / "broken.avi", noise_frames(6), fourcc="MJPG")
        return corrupt_mjpeg(path, frames=None)
    if kind == "thin":  # 300:1, which the Qwen processors refuse (a traceback mid-turn)
        Image.new("RGB", (28 * 300, 28)).save(tmp / "strip.png")
        return tmp / "strip.png"
    if kind == "tall_video":
        return write_video(tmp / "tall.avi", noise_frames(2, width=32, height=32 * 210), fourcc="MJPG")
    if kind == "nan_tiff":
        values = np.linspace(0, 1, 64 * 64, dtype=np.float32).reshape(64, 64)
        values[3, 7] = np.nan
        Image.fromarray(values, mode="F").save(tmp / "measured.tif")
        return tmp / "measured.tif"
    raise AssertionError(kind)


BAD_INPUTS = {
    "missing": r"cannot read '.*nope.png': no such file",
    "directory": r"'.*folder.mp4': it is a directory",
    "empty": r"'.*empty.png': the file is empty \(0 bytes\)",
    "text": r"'.*notes.mp4' is not a video or image \(looks like text\)",
    "html": r"not a video or image \(looks like an HTML page",
    "pdf": r"'.*paper.png' is not a video or image \(looks like a PDF document\)",
    "corrupt_png": r"'.*bad.png': corrupt image data \(PIL: ",
    "truncated_jpeg": r"'.*cut.jpg': the image is truncated",
    "truncated_tiff": r"'.*cut.tif': the image is truncated",
    "tiny": r"image 1x1 is too small; each side must be at least 28 px",
    "huge": r"image 20000x20000 is 400.0 MP; the limit is 64.0 MP — downscale it",
    "undecodable_video": r"'.*broken.avi': video has no decodable frame",
    "thin": r"'.*strip.png': image 8400x28 has an aspect ratio of 300:1; the limit is 200:1 — crop it",
    "tall_video": r"'.*tall.avi': video frame 32x6720 has an aspect ratio of 210:1; the limit is 200:1",
    "nan_tiff": r"'.*measured.tif': the image holds NaN or infinite values",
}


@pytest.mark.parametrize("kind", sorted(BAD_INPUTS))
def test_bad_input_raises_one_line_media_error(tmp_path: Path, kind: str, capfd: pytest.CaptureFixture) -> None:
    path = _make_bad_input(kind, tmp_path)
    capfd.readouterr()
    with pytest.raises(MediaError, match=BAD_INPUTS[kind]) as caught:
        load_media(path)
    message = str(caught.value)
    assert "\n" not in message and len(message) < 400
    if kind != "undecodable_video":  # FFmpeg's lines: quiet_decoders() (test_cli checks it)
        assert capfd.readouterr().err == ""  # no decoder's log lines around the one line (libtiff's, for a TIFF)
    assert isinstance(caught.value, VisualKVError)


def test_kind_is_sniffed_from_content_not_extension(tmp_path: Path, still: np.ndarray) -> None:
    Image.fromarray(still).save(tmp_path / "really_png.mp4", format="PNG")
    assert media_kind(tmp_path / "really_png.mp4") == "image"
    video = write_video(tmp_path / "really_mp4.mp4", noise_frames(4)).rename(tmp_path / "really_mp4.png")
    assert media_kind(video) == "video"
    assert load_media(video).kind == "video"
    with pytest.raises(MediaError, match="is a video, not an image"):
        load_image(video)
    with pytest.raises(MediaError, match="is an image, not a video"):
        load_video(tmp_path / "really_png.mp4")


def test_file_size_limit(tmp_path: Path, still: np.ndarray) -> None:
    Image.fromarray(still).save(tmp_path / "s.png")
    with pytest.raises(MediaError, match=r"'.*s.png' is [\d.]+ KiB; the limit is 100 bytes"):
        load_media(tmp_path / "s.png", limits=MediaLimits(max_file_bytes=100))


def test_bad_settings_raise_media_error(short_video: tuple[Path, dict]) -> None:
    with pytest.raises(MediaError, match="fps"):
        FrameSampling(fps=0)
    with pytest.raises(MediaError, match="max_frames"):
        MediaLimits(max_frames=0)
    with pytest.raises(MediaError, match="unknown video backend"):
        load_video(short_video[0], backend="ffmpeg")


# --------------------------------------------------------------------------------------------
# Videos


@pytest.mark.parametrize(
    ("suffix", "fourcc"),
    [
        (".mp4", "mp4v"),
        (".mov", "mp4v"),
        (".avi", "MJPG"),
        (".mkv", "XVID"),
        (".webm", "VP80"),
    ],
)
def test_video_containers(tmp_path: Path, suffix: str, fourcc: str) -> None:
    path = write_video(tmp_path / f"v{suffix}", noise_frames(12), fps=4.0, fourcc=fourcc)
    assert media_kind(path) == "video"
    loaded = load_media(path)
    # lazily decoded by OpenCV (decord only where OpenCV fails on a frame: tests/test_lazy_video.py)
    assert loaded.kind == "video" and loaded.backend == "opencv"
    assert loaded.frame_indices == [0, 4, 8] and loaded.times == [0.0, 1.0, 2.0]
    assert loaded.duration == pytest.approx(3.0) and loaded.source_fps == pytest.approx(4.0)
    assert loaded.size == (64, 48) and loaded.frames[0].dtype == np.uint8


@pytest.mark.parametrize("backend", ["decord", "opencv"])
def test_video_backends_agree(short_video: tuple[Path, dict], backend: str) -> None:
    path, description = short_video
    sampling = FrameSampling(fps=2.0)
    loaded = load_video(path, sampling=sampling, backend=backend)
    reference = load_video(path, sampling=sampling, backend="decord")
    assert loaded.backend == backend and not loaded.warnings
    assert loaded.frame_indices == list(range(0, 32, 2))
    assert loaded.times == [i / 4.0 for i in range(0, 32, 2)]
    for mine, ref in zip(loaded.frames, reference.frames, strict=True):
        assert mine.shape == (96, 160, 3)
        assert np.abs(mine.astype(int) - ref.astype(int)).mean() < 2
    # The red ball is on screen during the event segment only, in RGB order.
    (event,) = [s for s in description["segments"] if s["kind"] == "event"]
    cx, cy = description["event_object"]["center"]
    for time, frame in zip(loaded.times, loaded.frames, strict=True):
        red, green, blue = frame[cy, cx].astype(int)
        assert (red > 180 and green < 80 and blue < 80) == (event["start"] <= time < event["end"])


def test_opencv_seeks_over_long_gaps(tmp_path: Path) -> None:
    # 30 s at 4 fps; 0.1 fps sampling -> gaps of 40 frames
    frames = noise_frames(120, seed=4)
    path = write_video(tmp_path / "long_gaps.avi", frames, fourcc="MJPG")
    sampling = FrameSampling(fps=0.1)
    by_cv = load_video(path, sampling=sampling, backend="opencv")
    by_decord = load_video(path, sampling=sampling, backend="decord")
    assert by_cv.frame_indices == by_decord.frame_indices == [0, 40, 80]
    for mine, ref in zip(by_cv.frames, by_decord.frames, strict=True):
        assert np.abs(mine.astype(int) - ref.astype(int)).mean() < 2


def test_fallback_to_opencv_when_decord_missing_or_failing(
    short_video: tuple[Path, dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = short_video[0]
    expected = load_video(path, backend="decord")

    monkeypatch.setattr(video_module, "import_decord", lambda: None)  # looked up by video_module._check_backends
    missing = load_video(path)
    assert missing.backend == "opencv" and missing.times == expected.times
    monkeypatch.undo()

    def cannot_open(_file: Path) -> None:
        raise RuntimeError("simulated decord failure")

    monkeypatch.setattr(video_module, "DecordReader", cannot_open)
    failing = load_video(path)
    assert failing.backend == "opencv" and failing.times == expected.times
    assert any("decord could not open" in w for w in failing.warnings)


def test_frame_decord_fails_on_is_taken_from_opencv(
    short_video: tuple[Path, dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = short_video[0]
    expected = load_video(path, backend="decord")
    original = readers.DecordReader.read_many

    def drop_frame_4(self, indices: list[int]) -> dict[int, np.ndarray]:
        decoded = original(self, indices)
        decoded.pop(4)
        return decoded

    monkeypatch.setattr(readers.DecordReader, "read_many", drop_frame_4)
    mixed = load_video(path, lazy=False)  # the lazy form: tests/test_lazy_video.py
    assert mixed.backend == "decord+opencv" and not mixed.warnings
    assert mixed.frame_indices == expected.frame_indices
    assert np.abs(mixed.frames[1].astype(int) - expected.frames[1].astype(int)).mean() < 2


@pytest.mark.parametrize("backend", ["auto", "opencv"])
def test_undecodable_frame_is_skipped_with_warning(tmp_path: Path, backend: str) -> None:
    path = corrupt_mjpeg(
        write_video(tmp_path / "one_bad.avi", noise_frames(10), fourcc="MJPG"),
        frames=[5],
    )
    loaded = load_video(path, sampling=FrameSampling(fps=4.0), backend=backend, lazy=False)
    assert loaded.frame_indices == [0, 1, 2, 3, 4, 6, 7, 8, 9]
    assert loaded.warnings == ["frame 5 (t=1.25 s) could not be decoded; skipped"]
    # MJPEG is lossy; frame 6 must still be frame 6, not 5 or 7
    reference = noise_frames(10)
    errors = [np.abs(loaded.frames[5].astype(int) - reference[k].astype(int)).mean() for k in (5, 6, 7)]
    assert errors[1] < 0.8 * min(errors[0], errors[2])


@pytest.mark.parametrize("backend", ["auto", "decord", "opencv"])
def test_one_frame_video(tmp_path: Path, backend: str) -> None:
    path = write_video(tmp_path / "one.mp4", noise_frames(1))
    loaded = load_video(path, backend=backend)
    assert loaded.num_frames == 1 and loaded.times == [0.0] and loaded.duration == pytest.approx(0.25)


def test_sampling_by_fps_and_by_max_frames(short_video: tuple[Path, dict]) -> None:
    path = short_video[0]  # 32 frames at 4 fps = 8 s
    by_fps = load_video(path, sampling=FrameSampling(fps=1.0))
    assert by_fps.times == [float(t) for t in range(8)] and by_fps.frame_indices == list(range(0, 32, 4))

    capped = load_video(path, sampling=FrameSampling(fps=4.0, max_frames=5))
    assert capped.frame_indices == [
        0,
        8,
        16,
        23,
        31,
    ]  # uniform over the whole video, ends included
    assert capped.times == [i / 4.0 for i in capped.frame_indices]

    # The limits' cap is refused, not resampled (it follows the method: see tests/test_lazy_video.py).
    with pytest.raises(MediaError, match=r"sampled at 4 fps is 32 frames; the limit is 3 frames"):
        load_video(path, limits=MediaLimits(max_frames=3), sampling=FrameSampling(fps=4.0))
    uncapped = load_video(path, limits=MediaLimits(max_frames=None), sampling=FrameSampling(fps=4.0, max_frames=None))
    assert uncapped.frame_indices == list(range(32))


def test_sample_frame_indices_edge_cases() -> None:
    assert sample_frame_indices(0, 4.0, FrameSampling()) == []
    assert sample_frame_indices(1, 30.0, FrameSampling()) == [0]
    # Sampling faster than the source: each source frame once.
    assert sample_frame_indices(12, 4.0, FrameSampling(fps=10.0, max_frames=100)) == list(range(12))
    # ... without listing duration x fps sample times (1e12 here: a list would not fit in memory)
    assert sample_frame_indices(12, 4.0, FrameSampling(fps=1e12, max_frames=None)) == list(range(12))
    assert sample_frame_indices(12, 4.0, FrameSampling(fps=1e12, max_frames=4)) == [0, 4, 7, 11]
    assert sample_frame_indices(12, 4.0, FrameSampling(fps=4.0, max_frames=None)) == list(range(12))
    # 29.97 fps NTSC, 1 fps: the frame on screen at each whole second.
    assert sample_frame_indices(300, 29.97, FrameSampling(fps=1.0))[:4] == [
        0,
        29,
        59,
        89,
    ]


def test_too_long_video_refused_before_decoding(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 360 frames at 0.01 fps: the container says 10 hours.
    path = write_video(tmp_path / "ten_hours.mp4", noise_frames(360, width=32, height=32), fps=0.01)

    def no_decoding(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("decoded a video that should have been refused from its header")

    monkeypatch.setattr(video_module, "DecordReader", no_decoding)
    monkeypatch.setattr(readers, "OpenCVReader", no_decoding)
    with pytest.raises(
        MediaError,
        match=r"video is 10.0 h long \(360 frames at 0.01 fps, per its header\); the limit is 3.0 h — trim it",
    ):
        load_media(path)
    monkeypatch.undo()
    # Without the OpenCV header probe, decord's packet index (no decoding) tells the same.
    monkeypatch.setattr(video_module, "probe_opencv", lambda _file: None)
    monkeypatch.setattr(video_module, "read_opencv", no_decoding)
    monkeypatch.setattr(readers.DecordReader, "read_many", no_decoding)
    with pytest.raises(MediaError, match="10.0 h long"):
        load_video(path, backend="decord")


def rotate_90_in_header(path: Path) -> Path:
    """Write a 90-degree rotation matrix into the MP4 track header (as phones do)."""
    data = bytearray(path.read_bytes())
    tkhd = data.find(b"tkhd")
    assert tkhd > 0 and data[tkhd + 4] == 0  # version 0 header
    matrix_at = tkhd + 4 + 4 + 20 + 8 + 8  # version/flags, times/id/duration, reserved, layer...
    one, w = 0x00010000, 0x40000000  # 16.16 and 2.30 fixed point
    matrix = [0, one, 0, -one & 0xFFFFFFFF, 0, 0, 0, 0, w]
    data[matrix_at : matrix_at + 36] = struct.pack(">9I", *matrix)
    path.write_bytes(bytes(data))
    return path


def test_rotated_phone_video_is_shown_upright(tmp_path: Path) -> None:
    pixels = np.zeros((48, 64, 3), np.uint8)
    pixels[:, :10] = 255  # white band on the left; after 90 degrees clockwise: on top
    path = rotate_90_in_header(write_video(tmp_path / "phone.mp4", [pixels] * 4))
    loaded = load_video(path)
    assert loaded.size == (48, 64) and loaded.backend == "opencv"
    assert loaded.frames[0][:8].mean() > 200 and loaded.frames[0][20:].mean() < 50
    assert any("rotated" in w for w in loaded.warnings)
    with pytest.raises(MediaError, match="rotation metadata"):
        load_video(path, backend="decord")


def test_media_repr_and_size(short_video: tuple[Path, dict]) -> None:
    loaded = load_video(short_video[0])
    assert isinstance(loaded, Media) and loaded.size == (160, 96)
    text = repr(loaded)
    assert "kind='video'" in text and "array" not in text and len(text) < 200


# --------------------------------------------------------------------------------------------
# The example generator


def test_example_still_has_needles_at_described_places() -> None:
    pixels = examples.make_still(960, 540, seed=0)
    needles = {n["name"]: n["box"] for n in examples.still_needles(960, 540)}
    x0, y0, x1, y1 = needles["red_star"]
    star = pixels[y0:y1, x0:x1].astype(int)
    assert ((star[..., 0] > 200) & (star[..., 1] < 60)).sum() > 0.2 * star[..., 0].size
    x0, y0, x1, y1 = needles["label"]
    label = pixels[y0:y1, x0:x1].astype(int)
    assert (label.min(axis=2) < 40).any() and ((label[..., 0] > 230) & (label[..., 2] < 30)).mean() > 0.5
    assert np.array_equal(pixels, examples.make_still(960, 540, seed=0))


def test_example_assets_match_their_description() -> None:
    described = REPO / "assets" / "example_video.json"
    if not described.exists():
        pytest.skip("assets not generated (python scripts/make_examples.py)")
    info = json.loads(described.read_text())
    assert info["duration"] >= 64 and {s["kind"] for s in info["segments"]} == {
        "static",
        "pan",
        "cut",
        "event",
    }
    loaded = load_video(REPO / "assets" / info["file"], sampling=FrameSampling(fps=1.0, max_frames=64))
    assert loaded.num_frames == 64 and loaded.size == (info["width"], info["height"])


def test_a_video_of_flat_frames_is_said_to_be_damaged(tmp_path: Path) -> None:
    """Zeroed picture data decodes as one flat colour: said once every sampled frame has been decoded and found flat
    (lazily: when the last one is read; eagerly: at load), never for a video with content after a blank start."""
    grey = write_video(tmp_path / "grey.avi", [np.full((48, 64, 3), 128, np.uint8)] * 6, fourcc="MJPG")
    words = "'" + str(grey) + "': every sampled frame is one flat colour, so its picture data is likely damaged"
    every = FrameSampling(fps=4.0)  # the file's own rate: all six frames
    lazy = load_media(grey, sampling=every)
    assert len(lazy.frames) == 6 and lazy.warnings == []  # only the first frame decoded so far
    _ = lazy.frames[:5]
    assert lazy.warnings == []
    _ = lazy.frames[5], list(lazy.frames)
    assert len(lazy.warnings) == 1 and lazy.warnings[0].startswith(words)
    assert load_media(grey, lazy=False, sampling=every).warnings[0].startswith(words)
    fade = [np.zeros((48, 64, 3), np.uint8)] * 3 + noise_frames(3)  # a black start, then content
    faded = write_video(tmp_path / "fade.avi", fade, fourcc="MJPG")
    lazy_fade = load_media(faded, sampling=every)
    _ = list(lazy_fade.frames)
    assert lazy_fade.warnings == [] and load_media(faded, lazy=False, sampling=every).warnings == []
