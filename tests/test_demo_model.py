"""The bundled demo model (assets/visualkv-demo) and the synthetic scene generator."""

from __future__ import annotations

import os

import numpy as np
import pytest

from visualkv.bench.needle import aggregate, make_cases, method_points
from visualkv.bench.scenes import (
    COLORS,
    NEEDLE_SHAPES,
    TRAIN_SEED_OFFSET,
    answer_matches,
    make_scene,
    make_video_scene,
    quadrant_of,
    render_scene,
    render_video,
    scene_media,
)

DEMO_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "visualkv-demo")
HAVE_DEMO = os.path.isfile(os.path.join(DEMO_DIR, "model.safetensors"))

# A fixed held-out scene (never seen in training) and questions the demo model answers correctly.
FIXED_SEED, FIXED_SIZE = 7, (672, 378)


# -- scene generator ------------------------------------------------------------------------------
def test_scene_is_deterministic_and_answers_are_consistent():
    a, b = make_scene(11, (448, 252)), make_scene(11, (448, 252))
    assert a.objects == b.objects and a.questions == b.questions
    assert np.array_equal(render_scene(a), render_scene(b))
    assert render_scene(a).shape == (252, 448, 3)
    assert make_scene(12, (448, 252)).objects != a.objects
    for q in a.questions:
        if q.kind == "count":
            assert q.answer == str(a.count(q.target))
        elif q.kind == "presence":
            assert q.answer == ("yes" if a.count(q.target) else "no")
        elif q.kind == "color":
            (needle,) = [o for o in a.needles if o.shape == q.target]
            assert q.answer == needle.color and q.answer in COLORS
        elif q.kind == "quadrant":
            (needle,) = [o for o in a.needles if o.shape == q.target]
            assert q.answer == quadrant_of(needle, a.width, a.height)


def test_needles_keep_their_pixel_size_in_a_4k_haystack():
    small, big = make_scene(3, (672, 378)), make_scene(3, (3840, 2160))
    assert 1 <= len(big.needles) <= 9 and all(o.shape in NEEDLE_SHAPES for o in big.needles)
    assert max(o.size for o in big.needles) <= 52 and max(o.size for o in small.needles) <= 52
    assert len(big.objects) > 10 * len(small.objects) / 2  # distractor density is per megapixel
    for o in big.needles:  # needles sit clear of the quadrant boundaries
        assert abs(o.cx - big.width / 2) >= o.size and abs(o.cy - big.height / 2) >= o.size


def test_video_needle_is_visible_in_only_a_few_frames():
    video = make_video_scene(5, (112, 112))
    frames = render_video(video)
    assert len(frames) == video.num_frames and frames[0].shape == (112, 112, 3)
    first, last = video.visible
    assert 2 <= last - first <= 4 and first % 2 == 0
    assert 0 < video.cut_frame < video.num_frames
    when = next(q for q in video.questions if q.kind == "when")
    assert when.answer == ("start", "middle", "end")[min(2, 3 * first // video.num_frames)]
    assert {q.kind for q in video.questions} == {"color", "when", "presence"}


def test_answer_matching_and_needle_cases():
    assert answer_matches(" Red.", "red") and answer_matches("top  left", "top left")
    assert not answer_matches("redd", "red")
    cases = make_cases((448, 252), 3)
    assert len(cases) == 3 and all(c.scene.seed < TRAIN_SEED_OFFSET for c in cases)
    assert all(c.first.target != c.second.target for c in cases)
    points = method_points(["full", "blockwise-snapkv", "lightkv"], [0.05, 0.1])
    assert [(m, f) for m, f, _ in points] == [
        ("full", 1.0),
        ("blockwise-snapkv", 0.05),
        ("blockwise-snapkv", 0.1),
        ("lightkv", None),
    ]
    per_case = [
        {
            "video": False,
            "method": "full",
            "budget_fraction": 1.0,
            "size": "448x252",
            "correct": [True, ok],
            "kinds": ["color", "quadrant"],
            "kept_fraction": 1.0,
        }
        for ok in (True, False)
    ]
    rows = {r["setting"]: r for r in aggregate(per_case)}
    assert rows["single"]["accuracy"] == 1.0 and rows["followup"]["accuracy"] == 0.5
    assert set(rows["single"]) >= {"method", "budget_fraction", "setting", "size", "accuracy"}


def test_demo_alias_is_registered():
    from visualkv.models.registry import BUNDLED_MODELS, OFFLINE_MODELS

    assert any(c.name == "visualkv-demo" and c.offline for c in OFFLINE_MODELS)
    assert os.path.samefile(BUNDLED_MODELS["visualkv-demo"], DEMO_DIR) or not os.path.exists(DEMO_DIR)


# -- the bundled model ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo():
    if not HAVE_DEMO:
        pytest.skip("assets/visualkv-demo not present (run scripts/train_demo.py)")
    import torch

    from visualkv.models.registry import load_model

    torch.manual_seed(0)
    return load_model("visualkv-demo")


def test_demo_checkpoint_is_small_and_a_qwen25vl():
    if not HAVE_DEMO:
        pytest.skip("assets/visualkv-demo not present")
    total = sum(os.path.getsize(os.path.join(DEMO_DIR, f)) for f in os.listdir(DEMO_DIR))
    assert total <= 50 * 1024**2
    assert os.path.isfile(os.path.join(DEMO_DIR, "MODEL_CARD.md"))


def test_demo_model_answers_a_fixed_scene(demo):
    from visualkv.runtime.session import ChatSession, SessionConfig

    assert type(demo.model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    scene = make_scene(FIXED_SEED, FIXED_SIZE)
    media = scene_media(scene)
    color = next(q for q in scene.questions if q.kind == "color")
    absent = next(q for q in scene.questions if q.kind == "presence" and q.answer == "no")
    session = ChatSession(demo, SessionConfig(method="full", max_new_tokens=6))
    assert session.ask(color.question, media).answer == color.answer
    assert session.ask(absent.question).answer == "no"  # follow-up on the same cache
    n_visual = session.prepared.layout.n_visual
    evict = ChatSession(demo, SessionConfig(method="blockwise-keydiff", budget=n_visual // 4, max_new_tokens=6))
    assert evict.ask(color.question, media).answer == color.answer


def test_background_stripes_mark_the_quadrant():
    """The position cue: each quadrant's background has stripes of its own orientation."""
    import cv2

    scene = make_scene(21, (672, 378))
    scene.objects = []  # background only
    gray = cv2.GaussianBlur(render_scene(scene).astype(np.float32).mean(-1), (0, 0), 1.5)
    dy, dx = np.gradient(gray)
    h, w = gray.shape
    energy = {}
    for name, (ys, xs) in {
        "top left": (slice(0, h // 2), slice(0, w // 2)),
        "top right": (slice(0, h // 2), slice(w // 2, w)),
        "bottom left": (slice(h // 2, h), slice(0, w // 2)),
        "bottom right": (slice(h // 2, h), slice(w // 2, w)),
    }.items():
        gx, gy = dx[ys, xs], dy[ys, xs]
        # mean squared derivative along x, y and the two diagonals
        energy[name] = {
            "x": np.mean(gx**2),
            "y": np.mean(gy**2),
            "/": np.mean((gx + gy) ** 2) / 2,
            "\\": np.mean((gx - gy) ** 2) / 2,
        }
    assert max(energy["top left"], key=energy["top left"].get) == "y"  # horizontal stripes vary along y
    assert max(energy["top right"], key=energy["top right"].get) == "x"
    assert max(energy["bottom left"], key=energy["bottom left"].get) == "/"
    assert max(energy["bottom right"], key=energy["bottom right"].get) == "\\"
    for name, by_direction in energy.items():  # and the winner dominates
        e = sorted(by_direction.values())
        assert e[-1] > 1.5 * e[-2], (name, by_direction)


def test_video_time_cue_changes_the_stripe_period_per_third():
    """Videos made with time_cue: the stripes' period says which third of the video a frame is in."""
    from visualkv.bench.scenes import TIME_CUE_PERIODS, make_video_scene, video_third

    video = make_video_scene(4, (224, 224), time_cue=True)
    for shot in video.shots:
        shot.objects = []  # background only
    frames = render_video(video)

    def period_top_left(frame: np.ndarray) -> float:  # horizontal stripes there: a profile along y
        profile = frame[:112, :112].astype(np.float32).mean(axis=(1, 2))
        spectrum = np.abs(np.fft.rfft(profile - profile.mean()))
        freqs = np.fft.rfftfreq(len(profile))
        band = freqs > 1 / 30  # ignore the slow background gradient
        return 1 / freqs[band][np.argmax(spectrum[band])]

    for f in (0, 7, 15):
        assert abs(period_top_left(frames[f]) - TIME_CUE_PERIODS[video_third(f, 16)]) < 2.5
    assert [video_third(f, 16) for f in range(16)] == [0] * 6 + [1] * 6 + [2] * 4
    plain = make_video_scene(4, (224, 224), time_cue=False)
    assert not plain.time_cue and plain.questions == video.questions  # same scene, same answers
    assert make_video_scene(4, (224, 224)).time_cue  # the default: what the demo model was trained on


def test_every_example_card_is_answered_right_with_the_app_defaults(demo):
    """Every example card under the chat is a demo scene (a 4K still and videos among them), and with the
    settings column as a first visitor finds it (method, budget, answer length, video sampling) the demo model
    answers each card's question right, its cache compressed (a peak below the full cache): what a new user clicks
    first."""
    from ui.examples import chat_examples
    from ui.forms import DEFAULTS, MAX_FILE_BYTES
    from ui.text import demo_questions_md
    from visualkv.bench.demo_examples import load_demo_examples, question_forms
    from visualkv.bench.scenes import answer_matches
    from visualkv.media import MediaLimits, load_media
    from visualkv.runtime.frame_cap import media_limits
    from visualkv.runtime.session import ChatSession

    examples = load_demo_examples()
    assert {e.kind for e in examples} == {"image", "video"}
    assert any(e.width == 3840 for e in examples)
    keys = {(q.question, e.path): q.answer for e in examples for q in e.questions}
    cards = [(card["text"], card["files"][0]) for card in chat_examples(examples)]
    assert len(cards) >= 8 and all(card in keys for card in cards), cards  # every card has a known answer
    config = DEFAULTS.session_config([])
    limits = media_limits(config.method, MediaLimits(max_file_bytes=MAX_FILE_BYTES))
    wrong, uncompressed = [], []
    for question, path in cards:
        media = load_media(path, limits=limits, sampling=DEFAULTS.sampling())
        session = ChatSession(demo, config)
        answer = session.ask(question, media).answer
        if not answer_matches(answer, keys[question, path]):
            wrong.append((os.path.basename(path), question, keys[question, path], answer))
        report = session.report()  # the default budget compresses every card: its peak is below the full cache
        if not report["peak_kv_bytes"] < report["full_kv_bytes"]:
            uncompressed.append((os.path.basename(path), report["budget"], report["visual_tokens"]))
    assert not wrong, wrong
    assert not uncompressed, uncompressed
    panel = demo_questions_md(question_forms(), examples)
    assert all(q.question in panel for e in examples for q in e.questions)
