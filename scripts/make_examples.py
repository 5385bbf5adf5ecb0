"""Generate the example media in assets/ (deterministic, no third-party content).

    python scripts/make_examples.py [--out assets]

Writes:
  example_4k.png     3840x2160 still: textured background, ~60 muted distractor shapes and a few
                     small "needles" at fixed places (a red star, a yellow "VKV-42" label, ...)
  example_4k.json    the needles' boxes, for needle-in-an-image checks
  example_video.webm 64 s, 640x360, 4 fps, VP9 (plays in browsers): static shot, slow pan, hard cut,
                     static shot with a 1 s red-ball event, static to the end
  example_video.json the video's segments (start/end seconds, kind) and where the ball is
  *.poster.png       a 320 px poster frame of every example video (here and in visualkv-demo/), shown
                     on the app's example cards (`--posters-only` writes just these)

Same pixels on every run (a WebM file also holds a random segment id). The generator functions are importable so that tests can make small
variants in memory: ``make_still``, ``still_needles``, ``VideoTimeline``, ``iter_video_frames``,
``make_video_frames``, ``video_description``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import cv2
import numpy as np
from PIL import Image

STILL_SIZE = (3840, 2160)
MAX_STILL_BYTES = 8 * 1024**2
MAX_VIDEO_BYTES = 5 * 1024**2
VIDEO_FILE = "example_video.webm"
RED = (230, 20, 20)
YELLOW = (250, 215, 0)
BLACK = (0, 0, 0)


# --------------------------------------------------------------------------------------------
# Still image


def _smooth_noise(rng: np.random.Generator, width: int, height: int, cell: int) -> np.ndarray:
    """Low-frequency noise in [0, 1]: random values on a coarse grid, bicubically upsampled."""
    coarse = rng.random((height // cell + 3, width // cell + 3)).astype(np.float32)
    big = cv2.resize(
        coarse,
        ((width // cell + 3) * cell, (height // cell + 3) * cell),
        interpolation=cv2.INTER_CUBIC,
    )
    return np.clip(big[cell : cell + height, cell : cell + width], 0.0, 1.0)


def _background(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    """Smooth two-colour gradient modulated by low-frequency noise (float32 RGB, 0..255)."""
    start, end = rng.uniform(90, 200, (2, 3)).astype(np.float32)
    angle = rng.uniform(0, math.pi)
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    ramp = xs / width * math.cos(angle) + ys / height * math.sin(angle)
    ramp = (ramp - ramp.min()) / max(float(ramp.max() - ramp.min()), 1e-6)
    image = start + ramp[..., None] * (end - start)
    cell = max(8, min(width, height) // 6)
    image += (_smooth_noise(rng, width, height, cell)[..., None] - 0.5) * 50
    image += (_smooth_noise(rng, width, height, max(4, cell // 4))[..., None] - 0.5) * 16
    return image


def _muted_colour(rng: np.random.Generator) -> tuple[int, int, int]:
    """Low-saturation colour, so that distractors never look like the bright needles."""
    grey = rng.uniform(70, 190)
    return tuple(int(np.clip(grey + rng.uniform(-28, 28), 0, 255)) for _ in range(3))


def _star(cx: float, cy: float, radius: float) -> np.ndarray:
    angles = -math.pi / 2 + np.arange(10) * math.pi / 5
    radii = np.where(np.arange(10) % 2 == 0, radius, radius * 0.42)
    return np.stack([cx + radii * np.cos(angles), cy + radii * np.sin(angles)], axis=1).round().astype(np.int32)


def still_needles(width: int, height: int) -> list[dict]:
    """The needles of ``make_still`` at this size: name, description, box [x0, y0, x1, y1]."""
    scale = width / STILL_SIZE[0]
    star_r = round(28 * scale)
    label_w, label_h = round(300 * scale), round(84 * scale)
    disc_r = round(22 * scale)

    def at(fx: float, fy: float, half_w: int, half_h: int) -> list[int]:
        cx, cy = round(fx * width), round(fy * height)
        return [cx - half_w, cy - half_h, cx + half_w, cy + half_h]

    return [
        {
            "name": "red_star",
            "text": "a small bright red star",
            "box": at(0.73, 0.21, star_r, star_r),
        },
        {
            "name": "label",
            "text": "a yellow label reading VKV-42",
            "box": at(0.18, 0.78, label_w // 2, label_h // 2),
        },
        {
            "name": "blue_disc",
            "text": "a small bright blue disc",
            "box": at(0.52, 0.63, disc_r, disc_r),
        },
    ]


def _overlaps(box: list[int], boxes: list[list[int]], margin: int) -> bool:
    return any(
        box[0] < b[2] + margin and b[0] < box[2] + margin and box[1] < b[3] + margin and b[1] < box[3] + margin
        for b in boxes
    )


def _draw_distractors(canvas: np.ndarray, rng: np.random.Generator, count: int, keep_out: list[list[int]]) -> None:
    height, width = canvas.shape[:2]
    scale = width / STILL_SIZE[0]
    drawn = 0
    while drawn < count:
        size = int(rng.uniform(40, 170) * max(scale, 0.05)) + 2
        cx, cy = (
            int(rng.uniform(size, width - size)),
            int(rng.uniform(size, height - size)),
        )
        if _overlaps(
            [cx - size, cy - size, cx + size, cy + size],
            keep_out,
            margin=max(2, int(20 * scale)),
        ):
            continue  # needles must stay fully visible
        colour, kind = _muted_colour(rng), drawn % 3
        if kind == 0:
            cv2.circle(canvas, (cx, cy), size, colour, -1, cv2.LINE_AA)
        elif kind == 1:
            cv2.rectangle(
                canvas,
                (cx - size, cy - size),
                (cx + size, cy + size),
                colour,
                -1,
                cv2.LINE_AA,
            )
        else:
            tri = np.array(
                [[cx, cy - size], [cx - size, cy + size], [cx + size, cy + size]],
                np.int32,
            )
            cv2.fillPoly(canvas, [tri], colour, cv2.LINE_AA)
        drawn += 1


def _draw_needles(canvas: np.ndarray, needles: list[dict]) -> None:
    for needle in needles:
        x0, y0, x1, y1 = needle["box"]
        cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
        if needle["name"] == "red_star":
            cv2.fillPoly(canvas, [_star(cx, cy, (x1 - x0) / 2)], RED, cv2.LINE_AA)
        elif needle["name"] == "blue_disc":
            cv2.circle(
                canvas,
                (round(cx), round(cy)),
                (x1 - x0) // 2,
                (20, 60, 255),
                -1,
                cv2.LINE_AA,
            )
        elif needle["name"] == "label":
            cv2.rectangle(canvas, (x0, y0), (x1, y1), YELLOW, -1)
            _put_text_in_box(canvas, "VKV-42", (x0, y0, x1, y1))


def _put_text_in_box(canvas: np.ndarray, text: str, box: tuple[int, int, int, int]) -> None:
    """Black text centred in the box, as large as fits with a margin."""
    x0, y0, x1, y1 = box
    font, thickness = cv2.FONT_HERSHEY_SIMPLEX, max(1, (y1 - y0) // 14)
    (tw, th), _ = cv2.getTextSize(text, font, 1.0, thickness)
    font_scale = min(0.8 * (x1 - x0) / tw, 0.6 * (y1 - y0) / th)
    (tw, th), _ = cv2.getTextSize(text, font, font_scale, thickness)
    origin = (x0 + (x1 - x0 - tw) // 2, y0 + (y1 - y0 + th) // 2)
    cv2.putText(canvas, text, origin, font, font_scale, BLACK, thickness, cv2.LINE_AA)


def make_still(
    width: int = STILL_SIZE[0],
    height: int = STILL_SIZE[1],
    seed: int = 0,
    needles: bool = True,
    shapes: int = 60,
) -> np.ndarray:
    """Textured background, ``shapes`` muted distractors and (optionally) the needles; RGB uint8."""
    rng = np.random.default_rng(seed)
    canvas = np.ascontiguousarray(np.clip(_background(rng, width, height), 0, 255).astype(np.uint8))
    placed = still_needles(width, height) if needles else []
    _draw_distractors(canvas, rng, shapes, [n["box"] for n in placed])
    _draw_needles(canvas, placed)
    return canvas


# --------------------------------------------------------------------------------------------
# Video


@dataclass(frozen=True)
class VideoTimeline:
    """Segment boundaries in seconds. Defaults are the example video's; tests use shorter ones."""

    pan_start: float = 20.0
    cut: float = 35.0  # the pan ends with a hard cut to another scene
    event_start: float = 45.0
    event_seconds: float = 1.0
    end: float = 64.0


def _ball_geometry(width: int, height: int) -> tuple[int, int, int]:
    return round(0.62 * width), round(0.55 * height), max(3, round(0.06 * height))


def _frame_scenes(width: int, height: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    panorama = make_still(2 * width, height, seed=seed + 1, needles=False, shapes=24)
    scene_b = make_still(width, height, seed=seed + 2, needles=False, shapes=12)
    return panorama, scene_b


def iter_video_frames(
    width: int = 640,
    height: int = 360,
    fps: float = 4.0,
    seed: int = 0,
    timeline: VideoTimeline = VideoTimeline(),
) -> Iterator[np.ndarray]:
    """Yield the RGB frames (frame k shows time k / fps)."""
    panorama, scene_b = _frame_scenes(width, height, seed)
    with_ball = scene_b.copy()
    bx, by, br = _ball_geometry(width, height)
    cv2.circle(with_ball, (bx, by), br, RED, -1, cv2.LINE_AA)
    pan_span = panorama.shape[1] - width
    for k in range(round(timeline.end * fps)):
        t = k / fps
        if t < timeline.pan_start:
            yield panorama[:, :width]
        elif t < timeline.cut:
            progress = (t - timeline.pan_start) / (timeline.cut - timeline.pan_start)
            x = round(progress * pan_span)
            yield panorama[:, x : x + width]
        elif timeline.event_start <= t < timeline.event_start + timeline.event_seconds:
            yield with_ball
        else:
            yield scene_b


def make_video_frames(
    width: int = 640,
    height: int = 360,
    fps: float = 4.0,
    seed: int = 0,
    timeline: VideoTimeline = VideoTimeline(),
) -> list[np.ndarray]:
    """All frames as a list (mind the memory for the full-size video: use iter_video_frames)."""
    return [np.ascontiguousarray(f) for f in iter_video_frames(width, height, fps, seed, timeline)]


def video_description(
    width: int = 640,
    height: int = 360,
    fps: float = 4.0,
    timeline: VideoTimeline = VideoTimeline(),
) -> dict:
    """What ``iter_video_frames`` shows, segment by segment (seconds; end exclusive)."""
    tl = timeline
    event_end = tl.event_start + tl.event_seconds
    bx, by, br = _ball_geometry(width, height)
    return {
        "width": width,
        "height": height,
        "fps": fps,
        "frame_count": round(tl.end * fps),
        "duration": tl.end,
        "timeline": asdict(tl),
        "segments": [
            {
                "start": 0.0,
                "end": tl.pan_start,
                "kind": "static",
                "scene": "A",
                "note": "left end of scene A, frames identical",
            },
            {
                "start": tl.pan_start,
                "end": tl.cut,
                "kind": "pan",
                "scene": "A",
                "note": "slow pan left to right across scene A",
            },
            {
                "start": tl.cut,
                "end": tl.cut,
                "kind": "cut",
                "scene": "A->B",
                "note": "hard cut to scene B",
            },
            {"start": tl.cut, "end": tl.event_start, "kind": "static", "scene": "B"},
            {
                "start": tl.event_start,
                "end": event_end,
                "kind": "event",
                "scene": "B",
                "note": "a red ball appears",
            },
            {"start": event_end, "end": tl.end, "kind": "static", "scene": "B"},
        ],
        "event_object": {
            "name": "red_ball",
            "center": [bx, by],
            "radius": br,
            "box": [bx - br, by - br, bx + br, by + br],
        },
    }


# --------------------------------------------------------------------------------------------
# Writing files


def write_still(out: Path) -> dict:
    """Write example_4k.png (and example_4k.jpg if the PNG is over 8 MB) plus example_4k.json."""
    width, height = STILL_SIZE
    pixels = make_still(width, height, seed=0)
    png = out / "example_4k.png"
    tmp = out / "example_4k.png.tmp"
    Image.fromarray(pixels).save(tmp, format="PNG", compress_level=6)
    os.replace(tmp, png)
    chosen = png
    if png.stat().st_size > MAX_STILL_BYTES:
        chosen = out / "example_4k.jpg"
        Image.fromarray(pixels).save(chosen, format="JPEG", quality=90)
    info = {
        "file": chosen.name,
        "width": width,
        "height": height,
        "seed": 0,
        "needles": still_needles(width, height),
        "note": "boxes are [x0, y0, x1, y1] in pixels; everything else is background or muted distractor shapes",
    }
    (out / "example_4k.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def write_video(out: Path, width: int = 640, height: int = 360, fps: float = 4.0) -> dict:
    """Write example_video.webm (VP9) and example_video.json; check it reads back frame for frame."""
    from visualkv.bench.synthetic import WEBM_CRF, write_frames

    path = out / VIDEO_FILE
    tmp = out / "example_video.tmp.webm"  # the extension tells FFmpeg the container and the codec
    write_frames(str(tmp), iter_video_frames(width, height, fps), fps, (width, height))
    os.replace(tmp, path)
    if path.stat().st_size > MAX_VIDEO_BYTES:
        raise SystemExit(f"{path} is {path.stat().st_size} bytes; keep it under 5 MiB")
    description = video_description(width, height, fps)
    description["file"] = path.name
    description["codec"] = f"vp9 (libvpx, crf {WEBM_CRF})"
    description["decoded_frames"] = _decoded_frame_count(path, description["frame_count"])
    (out / "example_video.json").write_text(json.dumps(description, indent=2) + "\n")
    return description


def _decoded_frame_count(path: Path, expected: int) -> int:
    """The frames OpenCV decodes from `path` (the app's reader without decord): all `expected` of them."""
    cap = cv2.VideoCapture(str(path))
    count = 0
    while cap.grab():
        count += 1
    cap.release()
    if count != expected:
        raise SystemExit(f"OpenCV reads {count} frames from {path}, expected {expected}")
    return count


POSTER_WIDTH = 320


def write_posters(folder: Path, at: float = 0.25) -> list[Path]:
    """A poster frame (`at` of the way into the video, past a dark first frame) of every .webm under
    `folder`, as <name>.poster.png, POSTER_WIDTH px wide: the app's example cards show it."""
    written = []
    for video in sorted(folder.rglob("*.webm")):
        cap = cv2.VideoCapture(str(video))
        count = int(cap.get(cv2.CAP_PROP_FRAME_COUNT) or 0)
        cap.set(cv2.CAP_PROP_POS_FRAMES, int(count * at))
        ok, bgr = cap.read()
        cap.release()
        if not ok:
            raise SystemExit(f"cannot read a poster frame from {video}")
        height, width = bgr.shape[:2]
        small = cv2.resize(bgr, (POSTER_WIDTH, round(height * POSTER_WIDTH / width)), interpolation=cv2.INTER_AREA)
        path = video.with_suffix(".poster.png")
        Image.fromarray(cv2.cvtColor(small, cv2.COLOR_BGR2RGB)).save(path, optimize=True)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parent.parent / "assets",
        help="output folder (default: assets/)",
    )
    parser.add_argument("--posters-only", action="store_true", help="only (re)write the videos' poster frames")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # visualkv, for the videos and demo scenes
    started = time.perf_counter()
    if args.posters_only:
        for path in write_posters(args.out):
            print(f"{path}: {path.stat().st_size / 1024:.0f} KiB")
        return 0
    still = write_still(args.out)
    video = write_video(args.out)
    for name in (still["file"], "example_4k.json", video["file"], "example_video.json"):
        size = (args.out / name).stat().st_size
        print(f"{args.out / name}: {size / 1024**2:.2f} MiB")
    # the bundled demo model's example scenes and their suggested questions (visualkv/bench/scenes.py)
    from visualkv.bench.scenes import write_examples

    demo = write_examples(str(args.out / "visualkv-demo"))
    print(f"{args.out / 'visualkv-demo'}: {len(demo['examples'])} demo examples")
    for path in write_posters(args.out):
        print(f"{path}: {path.stat().st_size / 1024:.0f} KiB")
    print(f"done in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
