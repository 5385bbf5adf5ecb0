"""Deterministic synthetic "needle in a haystack" scenes with closed-answer questions.

Images: a textured background whose stripe orientation marks the quadrant, distractor shapes, and one or a
few small needles (star, cross, triangle or ring in one of six colours) of a fixed pixel size
(``NEEDLE_PX``), so a 4K scene is the same task with more haystack. Questions ask a needle's colour,
quadrant, presence or count. Videos: two shots with a hard cut, one needle visible in a few frames, stripes
whose period marks the third of the video; questions ask its colour and when it appeared.

Everything is a pure function of a seed; the demo model trains on seeds >= :data:`TRAIN_SEED_OFFSET` and is
evaluated below it::

    scene = make_scene(seed=3, size=(896, 504))
    rgb = render_scene(scene)          # HxWx3 uint8
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import cv2
import numpy as np
from PIL import Image, ImageDraw

from visualkv.bench.synthetic import write_frames
from visualkv.media import Media

__all__ = [
    "COLORS",
    "NEEDLE_PX",
    "NEEDLE_SHAPES",
    "QUADRANTS",
    "TRAIN_SEED_OFFSET",
    "Question",
    "Scene",
    "SceneObject",
    "VideoScene",
    "answer_matches",
    "cell_labels",
    "make_scene",
    "make_video_scene",
    "render_scene",
    "render_video",
    "scene_media",
    "video_media",
]

TRAIN_SEED_OFFSET = 1_000_000  # training scenes use seeds >= this; held-out sets use seeds below

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (225, 30, 35),
    "green": (30, 175, 60),
    "blue": (40, 80, 235),
    "yellow": (245, 220, 25),
    "purple": (150, 50, 205),
    "orange": (250, 135, 20),
}
NEEDLE_SHAPES: tuple[str, ...] = ("star", "cross", "triangle", "ring")
DISTRACTOR_SHAPES: tuple[str, ...] = ("circle", "square")
PLURAL = {"star": "stars", "cross": "crosses", "triangle": "triangles", "ring": "rings"}
QUADRANTS: tuple[str, ...] = ("top left", "top right", "bottom left", "bottom right")
NEEDLE_PX = (36, 52)  # needle side in pixels (min, max), independent of the image size
DISTRACTOR_PX = (18, 60)
# a needle stays clear of the midlines (its quadrant is unambiguous) and of the border, so a side
# shorter than this cannot always hold one (smaller scenes just get fewer needles)
MIN_SCENE_SIDE = 4 * NEEDLE_PX[1]
DISTRACTORS_PER_MEGAPIXEL = 48.0


@dataclass(frozen=True)
class SceneObject:
    shape: str
    color: str  # a COLORS name, or "muted" for distractors
    rgb: tuple[int, int, int]
    cx: float
    cy: float
    size: float
    needle: bool

    @property
    def box(self) -> tuple[int, int, int, int]:
        h = self.size / 2
        return (int(self.cx - h), int(self.cy - h), math.ceil(self.cx + h), math.ceil(self.cy + h))


@dataclass(frozen=True)
class Question:
    kind: str  # color | quadrant | presence | count | when
    target: str  # the needle shape asked about
    question: str
    answer: str


@dataclass
class Scene:
    seed: int
    width: int
    height: int
    objects: list[SceneObject]
    questions: list[Question] = field(default_factory=list)
    background_seed: int = 0

    @property
    def needles(self) -> list[SceneObject]:
        return [o for o in self.objects if o.needle]

    def count(self, shape: str) -> int:
        return sum(1 for o in self.needles if o.shape == shape)


@dataclass
class VideoScene:
    seed: int
    width: int
    height: int
    num_frames: int
    fps: float
    cut_frame: int
    shots: list[Scene]  # background + distractors of each shot
    velocities: list[list[tuple[float, float]]]  # per shot, per object (px per frame)
    needle: SceneObject
    visible: tuple[int, int]  # [first, last) frame where the needle is drawn
    questions: list[Question] = field(default_factory=list)
    time_cue: bool = False  # stripes' period marks the third of the video (see TIME_CUE_PERIODS)


# ----------------------------------------------------------------------------------------------
# Questions


def color_question(shape: str, past: bool = False) -> str:
    return f"What color {'was' if past else 'is'} the {shape}?"


def quadrant_question(shape: str) -> str:
    return f"Which quadrant holds the {shape}?"


def presence_question(shape: str) -> str:
    return f"Is there a {shape}?"


def count_question(shape: str) -> str:
    return f"How many {PLURAL[shape]} are there?"


def when_question(shape: str) -> str:
    return f"When did the {shape} appear?"


def answer_matches(generated: str, expected: str) -> bool:
    """Closed-answer match: case- and whitespace-insensitive, trailing punctuation ignored."""
    norm = " ".join(generated.strip().lower().rstrip(".!").split())
    return norm == expected.lower()


def quadrant_of(obj: SceneObject, width: int, height: int) -> str:
    top = obj.cy < height / 2
    left = obj.cx < width / 2
    return f"{'top' if top else 'bottom'} {'left' if left else 'right'}"


def _questions(scene: Scene, rng: np.random.Generator) -> list[Question]:
    """All askable questions of a scene, in a seed-determined order."""
    qs: list[Question] = []
    singles = [o for o in scene.needles if scene.count(o.shape) == 1]
    for o in singles:
        qs.append(Question("color", o.shape, color_question(o.shape), o.color))
        qs.append(Question("quadrant", o.shape, quadrant_question(o.shape), quadrant_of(o, scene.width, scene.height)))
    present = sorted({o.shape for o in scene.needles})
    absent = [s for s in NEEDLE_SHAPES if s not in present]
    for s in present + absent:
        qs.append(Question("presence", s, presence_question(s), "yes" if s in present else "no"))
        qs.append(Question("count", s, count_question(s), str(scene.count(s))))
    order = rng.permutation(len(qs))
    return [qs[i] for i in order]


# ----------------------------------------------------------------------------------------------
# Generation


def _background(
    rng: np.random.Generator, width: int, height: int, stripe_periods: tuple[float, ...] | None = None
) -> list[np.ndarray]:
    """Muted textured backgrounds, float32 HxWx3 in 0..255: one per stripe period.

    Without ``stripe_periods`` one background with a drawn period; with them (the videos' time
    cue) one per period, identical otherwise. The random draws are the same either way.
    """
    base = rng.uniform(60, 170, size=3).astype(np.float32)
    other = np.clip(base + rng.uniform(-50, 50, size=3), 20, 200).astype(np.float32)
    # gradient between two muted colours
    angle = rng.uniform(0, 2 * math.pi)
    ys = np.arange(height, dtype=np.float32)[:, None]
    xs = np.arange(width, dtype=np.float32)[None, :]
    g = np.cos(angle) * xs / max(width, 1) + np.sin(angle) * ys / max(height, 1)
    g = (g - g.min()) / max(float(g.max() - g.min()), 1e-6)
    img = base[None, None] * (1 - g[..., None]) + other[None, None] * g[..., None]
    # low-frequency noise
    cell = int(rng.integers(48, 160))
    coarse = rng.random((height // cell + 3, width // cell + 3, 3)).astype(np.float32)
    big = cv2.resize(coarse, ((width // cell + 3) * cell, (height // cell + 3) * cell), interpolation=cv2.INTER_CUBIC)
    img += (big[cell : cell + height, cell : cell + width] - 0.5) * rng.uniform(30, 70)
    drawn_period = float(rng.uniform(9, 13))
    amplitude = float(rng.uniform(10, 16))
    grain = rng.standard_normal(size=(height, width, 1), dtype=np.float32) * np.float32(rng.uniform(3, 10))
    periods = (drawn_period,) if stripe_periods is None else stripe_periods
    return [img + _quadrant_stripes(width, height, period, amplitude)[..., None] + grain for period in periods]


TIME_CUE_PERIODS: tuple[float, float, float] = (7.0, 11.0, 17.0)  # stripe period (px) at the start / middle / end

# Stripe direction (radians) of each quadrant's texture: TL horizontal, TR vertical, BL "/", BR "\\".
QUADRANT_STRIPE_ANGLES: dict[str, float] = {
    "top left": math.pi / 2,
    "top right": 0.0,
    "bottom left": math.pi / 4,
    "bottom right": 3 * math.pi / 4,
}


def _quadrant_stripes(width: int, height: int, period: float, amplitude: float) -> np.ndarray:
    """Fine stripes whose orientation depends on the quadrant (HxW float32, zero mean).

    This is the scene's position cue. Qwen2.5-VL has no absolute position embedding: a model learns
    where a token sits only from relative rotary positions, which a 1.7 M-parameter model trained for
    an hour on two CPU cores does not manage (quadrant answers stayed at chance without this cue).
    With it, a needle's own tokens (and their 112 px vision window) say which quadrant they are in,
    so the answer still needs the needle's tokens to be in the cache.
    """
    ys = np.arange(height, dtype=np.float32)[:, None]
    xs = np.arange(width, dtype=np.float32)[None, :]
    top = ys < height / 2
    left = xs < width / 2
    out = np.zeros((height, width), dtype=np.float32)
    for name, angle in QUADRANT_STRIPE_ANGLES.items():
        mask = (top if name.startswith("top") else ~top) & (left if name.endswith("left") else ~left)
        wave = np.sin((xs * math.cos(angle) + ys * math.sin(angle)) * (2 * math.pi / period))
        out = np.where(mask, wave, out)
    return out * np.float32(amplitude)


def _muted(rng: np.random.Generator) -> tuple[int, int, int]:
    g = rng.uniform(40, 210)
    return tuple(int(np.clip(g + rng.uniform(-25, 25), 0, 255)) for _ in range(3))


def _jitter(rgb: tuple[int, int, int], rng: np.random.Generator, amount: float = 18) -> tuple[int, int, int]:
    return tuple(int(np.clip(c + rng.uniform(-amount, amount), 0, 255)) for c in rgb)


def _place(rng, width, height, size, taken, margin_mid: bool) -> tuple[float, float] | None:
    for _ in range(200):
        cx = rng.uniform(size, width - size)
        cy = rng.uniform(size, height - size)
        if margin_mid and (abs(cx - width / 2) < size or abs(cy - height / 2) < size):
            continue
        if all(math.hypot(cx - x, cy - y) > (size + s) * 0.75 for x, y, s in taken):
            return cx, cy
    return None


def make_scene(
    seed: int,
    size: tuple[int, int] = (896, 504),
    n_shapes: int | None = None,
    min_needles: int = 1,
    density: float = 1.0,
    multi_prob: float = 0.3,
) -> Scene:
    """One still scene. ``size`` is (width, height); ``n_shapes`` distinct needle shapes (1-3).

    One needle shape may appear 2-3 times (for counting); the others once. ``density`` scales
    the number of distractors (training uses a curriculum from 0 to 1); ``multi_prob`` is the
    chance that one shape appears 2-3 times (training raises it so counting gets examples).
    """
    rng = np.random.default_rng(seed)
    width, height = size
    if n_shapes is None:
        n_shapes = int(rng.integers(max(1, min_needles), 4))
    shapes = list(rng.choice(NEEDLE_SHAPES, size=n_shapes, replace=False))
    counts = [1] * n_shapes
    if rng.random() < multi_prob:
        counts[int(rng.integers(n_shapes))] = int(rng.integers(2, 4))
    taken: list[tuple[float, float, float]] = []
    objects: list[SceneObject] = []
    color_names = list(COLORS)
    for shape, count in zip(shapes, counts):
        for _ in range(count):
            s = float(rng.uniform(*NEEDLE_PX))
            pos = _place(rng, width, height, s, taken, margin_mid=True)
            if pos is None:
                continue
            name = color_names[int(rng.integers(len(color_names)))]
            taken.append((pos[0], pos[1], s))
            objects.append(SceneObject(str(shape), name, COLORS[name], pos[0], pos[1], s, True))
    n_dis = round(density * (DISTRACTORS_PER_MEGAPIXEL * width * height / 1e6 * rng.uniform(0.7, 1.3) + 2))
    for _ in range(n_dis):
        s = float(rng.uniform(*DISTRACTOR_PX))
        cx, cy = rng.uniform(0, width), rng.uniform(0, height)
        if any(math.hypot(cx - x, cy - y) < (s + ns) * 0.75 for x, y, ns in taken):
            continue
        shape = str(DISTRACTOR_SHAPES[int(rng.integers(2))])
        if rng.random() < 0.6:
            name = color_names[int(rng.integers(len(color_names)))]
            rgb = _jitter(COLORS[name], rng)
        else:
            name, rgb = "muted", _muted(rng)
        objects.append(SceneObject(shape, name, rgb, cx, cy, s, False))
    # needles drawn last (on top): move them to the end of the list
    objects = [o for o in objects if not o.needle] + [o for o in objects if o.needle]
    scene = Scene(seed, width, height, objects, background_seed=int(rng.integers(2**31)))
    scene.questions = _questions(scene, rng)
    return scene


def _draw(draw: ImageDraw.ImageDraw, o: SceneObject, cx: float | None = None, cy: float | None = None) -> None:
    cx = o.cx if cx is None else cx
    cy = o.cy if cy is None else cy
    h = o.size / 2
    box = (cx - h, cy - h, cx + h, cy + h)
    if o.shape == "circle":
        draw.ellipse(box, fill=o.rgb)
    elif o.shape == "square":
        draw.rectangle(box, fill=o.rgb)
    elif o.shape == "ring":
        draw.ellipse(box, outline=o.rgb, width=max(3, int(o.size / 5)))
    elif o.shape == "cross":
        t = o.size / 6
        draw.rectangle((cx - t, cy - h, cx + t, cy + h), fill=o.rgb)
        draw.rectangle((cx - h, cy - t, cx + h, cy + t), fill=o.rgb)
    elif o.shape == "triangle":
        draw.polygon([(cx, cy - h), (cx + h, cy + h * 0.8), (cx - h, cy + h * 0.8)], fill=o.rgb)
    elif o.shape == "star":
        pts = []
        for k in range(10):
            r = h if k % 2 == 0 else h * 0.42
            a = -math.pi / 2 + k * math.pi / 5
            pts.append((cx + r * math.cos(a), cy + r * math.sin(a)))
        draw.polygon(pts, fill=o.rgb)
    else:
        raise ValueError(f"unknown shape {o.shape!r}")


def render_scene(scene: Scene) -> np.ndarray:
    """HxWx3 uint8 RGB of a still scene."""
    rng = np.random.default_rng(scene.background_seed)
    bg = np.clip(_background(rng, scene.width, scene.height)[0], 0, 255).astype(np.uint8)
    image = Image.fromarray(bg)
    draw = ImageDraw.Draw(image)
    for o in scene.objects:
        _draw(draw, o)
    return np.asarray(image)


def scene_media(scene: Scene) -> Media:
    """The scene as a :class:`visualkv.media.Media` image (what ChatSession takes)."""
    return Media(kind="image", frames=[render_scene(scene)], times=[0.0], backend="synthetic")


# ----------------------------------------------------------------------------------------------
# Videos


def video_third(frame: int, num_frames: int) -> int:
    """0, 1, 2: start, middle or end third of the video, of the 2-frame pair holding ``frame``."""
    return min(2, (3 * (frame // 2 * 2)) // num_frames)


def make_video_scene(
    seed: int, size: tuple[int, int] = (224, 224), num_frames: int = 16, fps: float = 4.0, time_cue: bool = True
) -> VideoScene:
    """Two shots with a hard cut, drifting distractors, one needle visible in 2 or 4 frames.

    With ``time_cue`` the background stripes' period changes at each third of the video
    (:data:`TIME_CUE_PERIODS`), so "when did it appear" is readable from the needle's own tokens:
    like the quadrant, a 1.7 M-parameter model cannot learn absolute (temporal) position from
    M-RoPE alone within our CPU budget.
    """
    rng = np.random.default_rng(seed)
    width, height = size
    cut = int(rng.integers(num_frames // 4, 3 * num_frames // 4)) // 2 * 2
    shots, vels = [], []
    for k in range(2):
        shot = make_scene(int(rng.integers(2**31)), size, n_shapes=1)
        shot.objects = [o for o in shot.objects if not o.needle]
        shots.append(shot)
        v = []
        for _ in shot.objects:
            moving = rng.random() < (0.15 if k == 0 else 0.5)
            v.append((float(rng.uniform(-4, 4)), float(rng.uniform(-3, 3))) if moving else (0.0, 0.0))
        vels.append(v)
    shape = str(rng.choice(NEEDLE_SHAPES))
    name = list(COLORS)[int(rng.integers(len(COLORS)))]
    s = float(rng.uniform(*NEEDLE_PX))
    cx, cy = rng.uniform(s, width - s), rng.uniform(s, height - s)
    needle = SceneObject(shape, name, COLORS[name], cx, cy, s, True)
    length = int(rng.choice([2, 4]))
    first = int(rng.integers(0, (num_frames - length) // 2 + 1)) * 2
    when = ("start", "middle", "end")[video_third(first, num_frames)]
    v = VideoScene(
        seed, width, height, num_frames, fps, cut, shots, vels, needle, (first, first + length), time_cue=time_cue
    )
    absent = str(rng.choice([x for x in NEEDLE_SHAPES if x != shape]))
    qs = [
        Question("color", shape, color_question(shape, past=True), name),
        Question("when", shape, when_question(shape), when),
        Question("presence", shape, presence_question(shape), "yes"),
        Question("presence", absent, presence_question(absent), "no"),
    ]
    v.questions = [qs[i] for i in rng.permutation(len(qs))]
    return v


def render_video(video: VideoScene) -> list[np.ndarray]:
    """The frames (HxWx3 uint8) of a video scene."""
    backgrounds = []  # per shot: one background, or one per third of the video (time cue)
    for shot in video.shots:
        rng = np.random.default_rng(shot.background_seed)
        bgs = _background(rng, video.width, video.height, TIME_CUE_PERIODS if video.time_cue else None)
        backgrounds.append([np.clip(b, 0, 255).astype(np.uint8) for b in bgs])
    frames = []
    for f in range(video.num_frames):
        k = 0 if f < video.cut_frame else 1
        t = f if k == 0 else f - video.cut_frame
        image = Image.fromarray(backgrounds[k][video_third(f, video.num_frames) if video.time_cue else 0])
        draw = ImageDraw.Draw(image)
        for o, (vx, vy) in zip(video.shots[k].objects, video.velocities[k]):
            _draw(draw, o, o.cx + vx * t, o.cy + vy * t)
        if video.visible[0] <= f < video.visible[1]:
            _draw(draw, video.needle)
        frames.append(np.asarray(image).copy())
    return frames


def video_media(video: VideoScene) -> Media:
    """The video as a :class:`visualkv.media.Media` (frames at ``video.fps``)."""
    frames = render_video(video)
    times = [i / video.fps for i in range(len(frames))]
    return Media(
        kind="video",
        frames=frames,
        times=times,
        source_fps=video.fps,
        duration=len(frames) / video.fps,
        frame_indices=list(range(len(frames))),
        backend="synthetic",
    )


# ----------------------------------------------------------------------------------------------
# Example media for the app (assets/visualkv-demo/)

NEEDLE_VIDEO = "example_needle_video.webm"
#: the example videos: (file, seed, side, frames per scene frame). A held scene frame lasts one second (a 16-s
#: video at 4 fps), so the app's default sampling (1 fps) reads the 16 scene frames the demo model was trained on
NEEDLE_VIDEOS: tuple[tuple[str, int, int, int], ...] = (
    (NEEDLE_VIDEO, 7, 224, 1),
    ("example_needle_video_16s.webm", 2, 280, 4),
)
EXAMPLES: tuple[tuple[str, int, tuple[int, int]], ...] = (
    ("example_scene.png", 7, (672, 378)),
    ("example_scene_4k.jpg", 7, (3840, 2160)),
)


def write_examples(out_dir: str) -> dict:
    """Write the demo's example media and ``examples.json`` (suggested questions with answers)."""
    import json
    import os

    os.makedirs(out_dir, exist_ok=True)
    items = []
    for name, seed, size in EXAMPLES:
        scene = make_scene(seed, size, n_shapes=3)
        image = Image.fromarray(render_scene(scene))
        path = os.path.join(out_dir, name)
        image.save(path, quality=92) if name.endswith(".jpg") else image.save(path, optimize=True)
        items.append(
            {
                "file": name,
                "seed": seed,
                "size": list(size),
                "needles": [{"shape": o.shape, "color": o.color, "box": list(o.box)} for o in scene.needles],
                "questions": [{"question": q.question, "answer": q.answer, "kind": q.kind} for q in scene.questions],
            }
        )
    items += [_write_needle_video(out_dir, *spec) for spec in NEEDLE_VIDEOS]
    manifest = {"model": "visualkv-demo", "examples": items}
    with open(os.path.join(out_dir, "examples.json"), "w") as fh:
        json.dump(manifest, fh, indent=1)
    return manifest


def _write_needle_video(out_dir: str, name: str, seed: int, side: int, hold: int) -> dict:
    """Write one example video scene at its own rate, each scene frame shown `hold` times (a video `hold` times
    longer), and return its manifest entry."""
    import os

    video = make_video_scene(seed, (side, side))
    frames = [frame for frame in video_media(video).frames for _ in range(hold)]
    # VP9 WebM: plays in the app's chat (browsers do not decode mp4v); near-lossless, so the frames read back
    # are the ones the demo model was trained on
    write_frames(os.path.join(out_dir, name), frames, video.fps, (video.width, video.height))
    return {
        "file": name,
        "seed": seed,
        "size": [video.width, video.height],
        "frames": len(frames),
        "fps": video.fps,
        "cut_frame": video.cut_frame * hold,
        "needle": {
            "shape": video.needle.shape,
            "color": video.needle.color,
            "visible_frames": [video.visible[0] * hold, video.visible[1] * hold],
        },
        "questions": [{"question": q.question, "answer": q.answer, "kind": q.kind} for q in video.questions],
    }


SHAPE_CLASSES: tuple[str, ...] = ("none", *DISTRACTOR_SHAPES, *NEEDLE_SHAPES)  # needle classes rank highest


def cell_labels(scene: Scene, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-cell labels of a rows x cols grid over the scene (e.g. one cell per visual token).

    Returns ``(shape, color)`` int64 arrays (rows, cols): ``shape`` indexes :data:`SHAPE_CLASSES`
    (a needle anywhere in the cell wins over distractors), ``color`` is 0 or 1 + the index of the
    needle's colour in :data:`COLORS` (needle cells only). Used as an auxiliary training target.
    """
    from dataclasses import replace

    shape_img = Image.new("L", (scene.width, scene.height), 0)
    needle_img = Image.new("L", (scene.width, scene.height), 0)
    ds, dn = ImageDraw.Draw(shape_img), ImageDraw.Draw(needle_img)
    needles = scene.needles
    for o in scene.objects:
        c = SHAPE_CLASSES.index(o.shape)
        _draw(ds, replace(o, rgb=c))
        if o.needle:
            _draw(dn, replace(o, rgb=needles.index(o) + 1))
    ys = np.round(np.arange(rows) * scene.height / rows).astype(int)
    xs = np.round(np.arange(cols) * scene.width / cols).astype(int)

    def pool(img: Image.Image) -> np.ndarray:
        a = np.asarray(img)
        return np.maximum.reduceat(np.maximum.reduceat(a, ys, axis=0), xs, axis=1)

    shape = pool(shape_img).astype(np.int64)
    idx = pool(needle_img).astype(np.int64)
    names = list(COLORS)
    lut = np.array([0] + [1 + names.index(o.color) for o in needles], dtype=np.int64)
    color = lut[idx]
    color[shape < len(("none", *DISTRACTOR_SHAPES))] = 0
    return shape, color
