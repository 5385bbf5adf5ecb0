"""Sali-Cache signals on synthetic clips: temporal filter calibration, saliency, tiers."""

from __future__ import annotations

import itertools
import sys

import cv2
import numpy as np
import pytest

from visualkv.media.saliency import (
    TIER_FULL,
    TIER_INT4,
    TIER_INT8,
    TIER_PRUNED,
    FrameDecision,
    MotionConfig,
    TierSpec,
    _banded_box_sums,
    _frame_signals,
    assign_tiers,
    frame_decisions,
    parse_tiers,
    token_saliency,
)

W, H = 640, 360
N_FRAMES = 12


# -- synthetic clips (numpy / OpenCV only) ------------------------------------------------------


def _scene(seed: int, w: int = 800, h: int = 480) -> np.ndarray:
    """RGB uint8 scene: gradients, a flat 'sky', random shapes and text."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.zeros((h, w, 3), np.float32)
    for c in range(3):
        img[..., c] = 60 + 80 * rng.uniform(0.5, 1) * xx / w + 40 * rng.uniform(0.5, 1) * yy / h
    img[: h // 4] = (150, 190, 230)
    img = img.astype(np.uint8)
    for _ in range(25):
        x0, y0 = int(rng.integers(0, w - 60)), int(rng.integers(h // 4, h - 40))
        colour = tuple(int(v) for v in rng.integers(0, 256, 3))
        if rng.random() < 0.5:
            x1, y1 = x0 + int(rng.integers(15, 120)), y0 + int(rng.integers(10, 80))
            cv2.rectangle(img, (x0, y0), (x1, y1), colour, -1)
        else:
            cv2.circle(img, (x0, y0), int(rng.integers(5, 40)), colour, -1)
    for i in range(4):
        org = (40 + 150 * i, h // 4 + 40 + 60 * i)
        cv2.putText(img, f"VisualKV {i}", org, cv2.FONT_HERSHEY_SIMPLEX, 0.9, (20, 20, 20), 2)
    return img


def _degrade(frame: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Camera noise (sigma 2) then a JPEG q75 round trip, like a mildly compressed video."""
    noisy = np.clip(frame.astype(np.float32) + rng.normal(0, 2.0, frame.shape), 0, 255)
    ok, buf = cv2.imencode(".jpg", noisy.astype(np.uint8), [cv2.IMWRITE_JPEG_QUALITY, 75])
    assert ok
    return cv2.imdecode(buf, cv2.IMREAD_UNCHANGED)


def _static(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(100 + seed)
    shot = _scene(seed)[:H, :W]
    return [_degrade(shot, rng) for _ in range(N_FRAMES)]


def _pan(px_per_frame: float, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(200 + seed)
    canvas = _scene(seed)
    frames = []
    for i in range(N_FRAMES):
        shift = np.float32([[1, 0, -i * px_per_frame], [0, 1, 0]])
        frames.append(_degrade(cv2.warpAffine(canvas, shift, (W, H)), rng))
    return frames


# -- temporal filter ----------------------------------------------------------------------------


def redundant_frames(frames: list[np.ndarray], cfg: MotionConfig | None = None) -> list[bool]:
    """True = the filter skips the frame."""
    return [d.redundant for d in frame_decisions(frames, cfg)]


def frame_to_frame(frames: list[np.ndarray], cfg: MotionConfig | None = None) -> list[FrameDecision]:
    """Each frame measured against the one before it (a pair through the filter: its first frame is kept)."""
    return [frame_decisions([a, b], cfg)[1] for a, b in itertools.pairwise(frames)]


@pytest.mark.parametrize("seed", [0, 1])
def test_static_noisy_compressed_shot_is_skipped_after_first_frame(seed: int) -> None:
    assert redundant_frames(_static(seed)) == [False] + [True] * (N_FRAMES - 1)


@pytest.mark.parametrize("px_per_frame", [1.0, 2.0])
def test_slow_pan_is_kept(px_per_frame: float) -> None:
    assert not any(redundant_frames(_pan(px_per_frame)))


def test_slow_drift_accumulates_against_last_kept_frame() -> None:
    frames = _pan(0.2)
    cfg = MotionConfig()
    # Frame to frame, the drift is below both thresholds...
    steps = frame_to_frame(frames, cfg)
    assert max(d.motion for d in steps) < cfg.threshold
    assert max(d.photometric for d in steps) < cfg.cut_threshold
    # ...but against the last kept frame it adds up, so frames are kept regularly.
    kept = [i for i, d in enumerate(frame_decisions(frames, cfg)) if not d.redundant]
    assert len(kept) >= 4
    assert max(np.diff(kept + [N_FRAMES])) <= 4


def test_hard_cut_is_kept() -> None:
    rng = np.random.default_rng(300)
    a, b = _scene(0)[:H, :W], _scene(1)[:H, :W]
    frames = [_degrade(a if i < 6 else b, rng) for i in range(N_FRAMES)]
    decisions = frame_decisions(frames, MotionConfig())
    assert [d.redundant for d in decisions] == [False] + [True] * 5 + [False] + [True] * 5
    assert decisions[6].photometric > 10 * MotionConfig().cut_threshold
    assert decisions[7].reference == 6


# Red is about as bright as the background there: only the colour changes.
@pytest.mark.parametrize("colour", [(230, 40, 40), (128, 128, 128), (40, 40, 230)])
def test_small_object_for_one_frame_is_kept(colour: tuple[int, int, int]) -> None:
    rng = np.random.default_rng(400)
    shot = _scene(0)[:H, :W]
    frames = []
    for i in range(N_FRAMES):
        f = shot.copy()
        if i == 6:
            f[200:230, 400:430] = colour  # 30x30 px at 640x360
        frames.append(_degrade(f, rng))
    skipped = redundant_frames(frames)
    assert skipped[6] is False
    # Frame 7 differs from the last kept frame (6, with the object): kept too, then static again.
    assert skipped == [False] + [True] * 5 + [False, False] + [True] * 4


def test_threshold_zero_never_skips_and_size_change_is_a_cut() -> None:
    frames = _static()[:4]
    assert not any(redundant_frames(frames, MotionConfig(threshold=0.0)))
    # The same content at another resolution is redundant; another aspect ratio is a cut.
    resized = frames[:2] + [cv2.resize(frames[2], (320, 180))]
    assert redundant_frames(resized) == [False, True, True]
    squeezed = frames[:2] + [cv2.resize(frames[2], (360, 360))]
    assert redundant_frames(squeezed) == [False, True, False]
    assert frame_to_frame(squeezed)[1].motion == float("inf")


def test_dis_flow_option_runs() -> None:
    frames = _pan(2.0)[:3]
    assert not any(redundant_frames(frames, MotionConfig(flow="dis", threshold=0.15)))
    with pytest.raises(ValueError):
        MotionConfig(flow="lucas")


# -- spatial saliency ---------------------------------------------------------------------------


def _grid_boxes(w: int, h: int, cell: int) -> np.ndarray:
    ys, xs = np.mgrid[0:h:cell, 0:w:cell]
    x0, y0 = xs.ravel(), ys.ravel()
    return np.stack([x0, y0, x0 + cell, y0 + cell], axis=1)


def _texture(h: int, w: int, seed: int) -> np.ndarray:
    """Dense detail everywhere: random colour blocks of 8 px and text."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8)
    img = cv2.resize(blocks, None, fx=8, fy=8, interpolation=cv2.INTER_NEAREST)[:h, :w]
    img = np.ascontiguousarray(img)
    for y in range(30, h, 40):
        cv2.putText(img, "SALIENT 42", (5, y), cv2.FONT_HERSHEY_SIMPLEX, 1.0, (0, 0, 0), 2)
    return img


def _half_textured(seed: int = 0) -> np.ndarray:
    """Left half: dense texture; right half: flat grey; mild noise and JPEG on both."""
    rng = np.random.default_rng(seed)
    frame = np.full((H, W, 3), 128, np.uint8)
    frame[:, : W // 2] = _texture(H, W // 2, seed)
    return _degrade(frame, rng)


def test_textured_boxes_beat_flat_boxes() -> None:
    frame = _half_textured()
    boxes = _grid_boxes(W, H, 40)
    sal = token_saliency([frame], boxes, np.zeros(len(boxes), int))
    assert sal.dtype == np.float32 and sal.shape == (len(boxes),)
    assert sal.min() >= 0.0 and sal.max() <= 1.0
    left = boxes[:, 2] <= W // 2
    assert np.median(sal[left]) > 0.2
    assert sal[~left].max() < 0.05
    assert np.median(sal[left]) > 5 * np.median(sal[~left])


def test_normalisation_is_global_not_per_frame() -> None:
    rng = np.random.default_rng(5)
    textured = _degrade(_texture(H, W, 0), rng)
    flat = _degrade(np.full((H, W, 3), (90, 120, 150), np.uint8), rng)
    boxes = _grid_boxes(W, H, 40)
    n = len(boxes)
    # Frame 1 is entirely flat; the last token is alone in its frame 2, also flat.
    all_boxes = np.concatenate([boxes, boxes, boxes[:1]])
    frame_of_token = np.concatenate([np.zeros(n, int), np.ones(n, int), [2]])
    sal = token_saliency([textured, flat, flat], all_boxes, frame_of_token)
    assert sal[n : 2 * n].max() < 0.05
    assert sal[-1] < 0.05
    assert np.median(sal[:n]) > 0.2
    # A video made only of flat frames stays low too (normalisation floors).
    alone = token_saliency([flat], boxes, np.zeros(n, int))
    assert alone.max() < 0.05


def test_banded_box_sums_are_the_whole_frames_and_hold_a_band_at_a_time(monkeypatch) -> None:
    """The LAB box sums come from integral images over bands of rows (a whole 4K frame's float64 integrals would
    take 400 MB): the same numbers as one whole-frame integral, for boxes of every height, overlapping (a
    global tile's large cells over a grid of small ones), empty or the whole frame."""
    from visualkv.media import saliency

    image = cv2.cvtColor(_half_textured(5), cv2.COLOR_RGB2LAB)
    rng = np.random.default_rng(11)
    x0, y0 = rng.integers(0, W, 300), rng.integers(0, H, 300)
    heights = np.where(rng.random(300) < 0.1, rng.integers(100, H, 300), rng.integers(0, 40, 300))
    boxes = np.stack([x0, y0, np.minimum(x0 + rng.integers(0, 90, 300), W), np.minimum(y0 + heights, H)], 1)
    boxes = np.concatenate([boxes, [[0, 0, W, H], [5, 7, 5, 7]]])
    whole_s, whole_sq = cv2.integral2(image, sdepth=cv2.CV_64F, sqdepth=cv2.CV_64F)
    band_rows = []
    integral2 = cv2.integral2

    def recorded(band, **kwargs):
        band_rows.append(band.shape[0])
        return integral2(band, **kwargs)

    monkeypatch.setattr(saliency.cv2, "integral2", recorded)
    sums, squares = _banded_box_sums(image, boxes)
    x0, y0, x1, y1 = boxes.T
    for integral, got in ((whole_s, sums), (whole_sq, squares)):
        want = integral[y1, x1] - integral[y0, x1] - integral[y1, x0] + integral[y0, x0]
        assert np.array_equal(got, want)
    short = (boxes[:, 3] - boxes[:, 1]) <= saliency._BAND_ROWS
    assert len(band_rows) > 1 and max(band_rows) <= 2 * saliency._BAND_ROWS
    assert len(band_rows) == len(np.unique(boxes[short, 1] // saliency._BAND_ROWS))


def test_box_statistics_match_direct_computation() -> None:
    frame = _half_textured(3)
    rng = np.random.default_rng(7)
    x0 = rng.integers(-20, W, 50)
    y0 = rng.integers(-20, H, 50)
    boxes = np.stack([x0, y0, x0 + rng.integers(0, 90, 50), y0 + rng.integers(0, 90, 50)], 1)
    edge, colour = _frame_signals(frame, boxes)

    grey = cv2.GaussianBlur(cv2.cvtColor(frame, cv2.COLOR_RGB2GRAY), (3, 3), 0)
    edges = cv2.Canny(grey, 50, 150) > 0
    lab = cv2.cvtColor(frame, cv2.COLOR_RGB2LAB).astype(np.float64)
    lab[..., 0] *= 100 / 255  # 8-bit L -> L in [0, 100]
    lab_true = cv2.cvtColor(frame.astype(np.float32) / 255.0, cv2.COLOR_RGB2LAB)
    for (a, b, c, d), e, v in zip(boxes, edge, colour, strict=True):
        a, c = np.clip([a, c], 0, W)
        b, d = np.clip([b, d], 0, H)
        if c <= a or d <= b:
            assert e == 0 and v == 0  # empty after clipping
            continue
        assert e == pytest.approx(edges[b:d, a:c].mean(), abs=1e-9)
        assert v == pytest.approx(lab[b:d, a:c].reshape(-1, 3).var(axis=0).mean(), abs=1e-6)
        # 8-bit LAB stays close to float LAB (the rounding adds < 0.1 variance per channel).
        direct = float(lab_true[b:d, a:c].reshape(-1, 3).var(axis=0).mean())
        assert v == pytest.approx(direct, abs=0.1 + 0.02 * direct)


def _python_calls(fn) -> int:
    """Function calls (Python and C) made while `fn` runs: a measure of work that does not depend on the load."""
    calls = 0

    def count(frame, event, arg) -> None:
        nonlocal calls
        calls += event in ("call", "c_call")

    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def test_many_boxes_on_4k_frame_are_vectorised() -> None:
    """10,686 token boxes on a 4K frame cost no more Python-level calls than 100 boxes, but for a few per band of
    rows: the per-box work is vectorised (summed-area tables), not a loop over boxes. (Counted, not timed: timing fails on a loaded CI.)"""
    from visualkv.media import saliency

    frame = cv2.resize(_half_textured(), (3840, 2160), interpolation=cv2.INTER_NEAREST)
    boxes = _grid_boxes(3840, 2160, 28)  # 137 x 78 = 10,686 tokens
    few = boxes[:100]
    token_saliency([frame], few, np.zeros(len(few), int))  # warm-up: one-time work (compiled patterns, caches)
    many_calls = _python_calls(lambda: token_saliency([frame], boxes, np.zeros(len(boxes), int)))
    few_calls = _python_calls(lambda: token_saliency([frame], few, np.zeros(len(few), int)))
    assert len(token_saliency([frame], boxes, np.zeros(len(boxes), int))) > 10_000
    # the LAB box sums are built a band of rows at a time (saliency._BAND_ROWS): a few calls per band
    bands = -(-2160 // saliency._BAND_ROWS)
    assert many_calls <= few_calls + 50 + 12 * bands, (few_calls, many_calls)


def test_saliency_input_validation() -> None:
    frame = _half_textured()
    with pytest.raises(ValueError):
        token_saliency([frame], np.zeros((3, 3), int), np.zeros(3, int))
    with pytest.raises(ValueError):
        token_saliency([frame], np.zeros((3, 4), int), np.zeros(2, int))
    with pytest.raises(ValueError):
        token_saliency([frame], np.zeros((1, 4), int), np.array([1]))
    empty = token_saliency([frame], np.zeros((0, 4), int), np.zeros(0, int))
    assert empty.shape == (0,)


# -- tiers --------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 7, 1000, 1001])
@pytest.mark.parametrize("fractions", [(0.43, 0.10, 0.29), (0.45, 0.1, 0.3), (1.0, 0.0, 0.0)])
def test_tiers_follow_fractions(n: int, fractions: tuple[float, float, float]) -> None:
    saliency = np.random.default_rng(n).random(n)
    tiers = assign_tiers(saliency, TierSpec(fractions))
    assert tiers.shape == (n,)
    expected = [*fractions, 1 - sum(fractions)]
    for tier, frac in zip((TIER_FULL, TIER_INT8, TIER_INT4, TIER_PRUNED), expected, strict=True):
        assert abs((tiers == tier).sum() - frac * n) <= 1
    # Higher saliency never lands in a lower-precision tier.
    for hi, lo in ((0, 1), (1, 2), (2, 3)):
        if (tiers == hi).any() and (tiers == lo).any():
            assert saliency[tiers == hi].min() >= saliency[tiers == lo].max()


def test_default_tiers_are_the_paper_split_renormalised() -> None:
    non_skipped = 1 - 0.267
    paper = (0.317 / non_skipped, 0.071 / non_skipped, 0.214 / non_skipped)
    assert np.allclose(TierSpec().fractions, paper, atol=0.01)
    assert TierSpec().pruned == pytest.approx(0.131 / non_skipped, abs=0.01)


def test_parse_tiers() -> None:
    assert parse_tiers("0.45,0.1,0.3") == TierSpec((0.45, 0.1, 0.3))
    assert parse_tiers(" 1, 0 ,0 ") == TierSpec((1.0, 0.0, 0.0))
    for bad in ("0.5,0.6,0.1", "1.2,0,0", "-0.1,0.2,0.2", "a,b,c", "0.5,0.5", "nan,0,0", ""):
        with pytest.raises(ValueError) as err:
            parse_tiers(bad)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError):
        assign_tiers(np.array([0.1, np.nan]), TierSpec())
