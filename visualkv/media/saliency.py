"""Sali-Cache's two signals, computed from pixels only (numpy / OpenCV, no model).

1. Temporal: is a sampled video frame redundant? Dense optical flow (Farneback or DIS) on grey
   frames downscaled to ``MotionConfig.downscale_width`` measures motion; a local photometric check
   catches cuts, flashes and small objects that flow misses. A redundant frame never reaches the
   vision encoder: the last kept frame's entries stand in for it.
2. Spatial: how much does each visual token's pixel box deserve? Canny edge density and LAB colour
   variance inside the box, normalised over all tokens of the video (or image), give a saliency in
   [0, 1]; saliency quantiles map tokens to tiers FP16 / INT8 / INT4 / pruned.

Units. Motion scores are flow magnitudes in pixels *of the downscaled frame* (160 px wide by
default), so they do not depend on the input resolution: 0.1 means 1/1600 of the frame width.
Photometric change is a local mean absolute RGB difference on the 0-255 scale.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import cv2
import numpy as np

from visualkv.errors import PrefillStopped

# ----------------------------------------------------------------------------------------------
# Temporal filter
# ----------------------------------------------------------------------------------------------

_FLOWS = ("farneback", "dis")
#: widest frames the flow runs on: its cost grows with the pixels (about 3 ms a frame at 160 px, 50 ms at 640)
MAX_DOWNSCALE_WIDTH = 640
#: largest flow threshold (downscaled px; a frame moving that much is never still) and photometric cut (0-255)
MAX_FLOW_THRESHOLD = 1000.0
MAX_CUT_THRESHOLD = 255.0


@dataclass(frozen=True)
class MotionConfig:
    """Temporal redundancy test: a frame is skipped only if *both* signals stay below threshold.

    Defaults are calibrated for Farneback on synthetic 640x360 clips (tests/test_saliency.py):
    - static shot, per-frame Gaussian noise sigma 2 + JPEG q75: motion <= 0.03,
      photometric <= 2.4 (sigma 4: 0.04 / 2.9; the same shot at 320x180, where downscaling
      averages less noise: 0.06 / 4.5);
    - pan of 0.5 / 1 / 2 px per frame at 640 px: motion 0.14 / 0.27 / 0.52;
    - hard cut: photometric ~100; a 30x30 object appearing at 640x360: photometric 24
      (mid-grey on a light wall) to 120 (saturated red), 69 for red on a background of
      the same brightness.
    ``threshold`` = 0.1 is 3.5x the target noise floor and 1.75x the worst one measured:
    every frame of a pan of >= 0.4 px/frame (at 640 px) is kept, and slower drift
    accumulates against the last kept frame (0.25 px/frame keeps every other frame).
    ``cut_threshold`` = 8 is 3.5x the target noise floor and 1.8x the worst one measured; a
    30x30 object at 640x360 is caught from ~9 levels of mean RGB contrast, and a moving
    object of any size after a few pixels of accumulated displacement.

    Limits: DIS flow is noisier (static floor up to 0.12 with the same settings): use a
    threshold of ~0.15 with ``flow="dis"``. Stronger noise (heavy codec flicker, film grain
    at low resolution) can lift the scores over the thresholds: frames are then kept, never
    wrongly skipped. Camera shake of ~0.1 downscaled px counts as motion. ``threshold = 0``
    disables skipping entirely (every score is >= 0).
    """

    downscale_width: int = 160
    flow: str = "farneback"
    threshold: float = 0.1
    cut_threshold: float = 8.0

    def __post_init__(self) -> None:
        if not 16 <= self.downscale_width <= MAX_DOWNSCALE_WIDTH:
            raise ValueError(f"downscale_width must be from 16 to {MAX_DOWNSCALE_WIDTH}, got {self.downscale_width}")
        if self.flow not in _FLOWS:
            raise ValueError(f"flow must be one of {_FLOWS}, got {self.flow!r}")
        if not (self.threshold >= 0 and self.cut_threshold >= 0):
            raise ValueError("threshold and cut_threshold must be >= 0")


@dataclass(frozen=True)
class FrameDecision:
    """Why a frame was kept or skipped: scores against ``reference`` (the last kept frame)."""

    index: int
    reference: int | None  # None for the first frame
    motion: float
    photometric: float
    redundant: bool


# Gradient magnitude (Sobel on the 3x3-blurred downscaled grey frame) above which a pixel counts as
# textured. Flow is only measurable there; on flat areas it is noise (aperture problem). Noise of
# sigma 2 at 640 px gives gradients ~1 after downscaling and blurring.
_TEXTURE_GRADIENT = 8.0
_MIN_TEXTURED_PIXELS = 20
# The motion score is this percentile of flow magnitude over textured pixels: robust to the
# spurious vectors noise produces (p90 doubled the noise floor of 320 px sources), yet motion of a
# quarter of the texture counts; smaller moving objects are the photometric check's job.
_MOTION_PERCENTILE = 75.0
# Photometric window side, as a fraction of the downscaled width (8 px at 160 px wide): a
# 30x30 object at 640x360 (7.5 px after downscaling) nearly fills one window.
_PHOTOMETRIC_WINDOW = 1 / 20


def _small(frame: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """RGB uint8 frame -> (grey, RGB) uint8, resized to ``width`` (aspect kept)."""
    if frame.ndim != 3 or frame.shape[2] != 3 or frame.dtype != np.uint8:
        raise ValueError(f"frames must be RGB uint8 (H, W, 3), got {frame.dtype} {frame.shape}")
    h, w = frame.shape[:2]
    height = max(1, round(h * width / w))
    interp = cv2.INTER_AREA if w > width else cv2.INTER_LINEAR
    rgb = cv2.resize(frame, (width, height), interpolation=interp)
    return cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY), rgb


def _flow_magnitude(ref: np.ndarray, cur: np.ndarray, flow: str) -> np.ndarray:
    if flow == "farneback":
        # pyr_scale, levels, winsize, iterations, poly_n, poly_sigma, flags
        field = cv2.calcOpticalFlowFarneback(ref, cur, None, 0.5, 3, 15, 3, 5, 1.1, 0)
    else:
        field = cv2.DISOpticalFlow_create(cv2.DISOPTICAL_FLOW_PRESET_MEDIUM).calc(ref, cur, None)
    return np.hypot(field[..., 0], field[..., 1])


def _motion(ref: np.ndarray, cur: np.ndarray, flow: str) -> float:
    """Percentile of flow magnitude over the reference's textured pixels (downscaled px)."""
    if ref.shape != cur.shape:
        return math.inf
    mag = _flow_magnitude(ref, cur, flow)
    blurred = cv2.GaussianBlur(ref, (3, 3), 0).astype(np.float32)
    grad = np.hypot(
        cv2.Sobel(blurred, cv2.CV_32F, 1, 0, ksize=3),
        cv2.Sobel(blurred, cv2.CV_32F, 0, 1, ksize=3),
    )
    textured = grad > _TEXTURE_GRADIENT
    # A (nearly) flat frame shows no motion by flow; the photometric check still sees changes.
    values = mag[textured] if textured.sum() >= _MIN_TEXTURED_PIXELS else mag.ravel()
    return float(np.percentile(values, _MOTION_PERCENTILE))


def _photometric(ref: np.ndarray, cur: np.ndarray) -> float:
    """Largest local mean absolute difference (0-255) over windows of 1/20 of the width.

    Per pixel the difference is averaged over R, G and B (not taken on grey), so that a change of
    colour at equal brightness (red on grey) counts too; the mean rather than the max over
    channels keeps JPEG chroma noise low. A cut or flash gives a large value everywhere; a small
    object appearing, a large value in one window. Noise averages out inside the window.
    """
    if ref.shape != cur.shape:
        return math.inf
    side = max(3, round(ref.shape[1] * _PHOTOMETRIC_WINDOW))
    diff = cv2.absdiff(ref, cur).astype(np.float32).mean(axis=2)
    local = cv2.blur(diff, (side, side), borderType=cv2.BORDER_REFLECT)
    return float(local.max())


class MotionFilter:
    """Streaming form of the temporal filter: push frames one by one, get a ``FrameDecision`` each.

    Holds only the last kept frame, downscaled, so a long video never has to sit in memory.
    Comparing with the last kept frame (not the previous one) makes slow drift accumulate until a
    frame is kept, so a skipped frame is always close to the frame that stands in for it. The first
    frame is always kept. A frame is redundant iff motion < ``threshold`` and photometric <
    ``cut_threshold``. Cost: one flow per frame (about 3 ms at 160x90) plus the downscaling.
    """

    def __init__(self, cfg: MotionConfig | None = None) -> None:
        self.cfg = cfg or MotionConfig()
        self._ref: tuple[np.ndarray, np.ndarray] | None = None
        self._ref_index: int | None = None
        self._count = 0

    def push(self, frame: np.ndarray) -> FrameDecision:
        index = self._count
        self._count += 1
        grey, rgb = _small(frame, self.cfg.downscale_width)
        if self._ref is None:
            decision = FrameDecision(index, None, math.inf, math.inf, False)
        else:
            ref_grey, ref_rgb = self._ref
            photometric = _photometric(ref_rgb, rgb)
            motion = _motion(ref_grey, grey, self.cfg.flow)
            redundant = motion < self.cfg.threshold and photometric < self.cfg.cut_threshold
            decision = FrameDecision(index, self._ref_index, motion, photometric, redundant)
        if not decision.redundant:
            self._ref, self._ref_index = (grey, rgb), index
        return decision


#: float32 values the flow holds per downscaled pixel (Farneback: both frames' polynomial expansions, their
#: pyramids, the matrices it solves and the field; DIS holds less)
_FLOW_FLOATS_PER_PIXEL = 40


def motion_pass_bytes(frame_size: tuple[int, int], cfg: MotionConfig | None = None) -> int:
    """Bytes the temporal filter holds at once for frames of ``frame_size`` (width, height), besides the decoded
    frame itself: the reference and the current frame downscaled (grey and RGB) and the flow's float32 work."""
    cfg = cfg or MotionConfig()
    width, height = frame_size
    pixels = cfg.downscale_width * max(1, round(height * cfg.downscale_width / width))
    return pixels * (2 * (1 + 3) + 4 * _FLOW_FLOATS_PER_PIXEL)


#: bytes `_frame_signals` holds at once per pixel of the frame it scores: the grey and blurred copies, Canny's
#: gradients and edge maps, the edges' int32 integral image, the 8-bit LAB copy (a whole Sali-Cache turn's growth
#: on the 4K example image is 11.1-12.7 per pixel over the five families; 16-20 on it at 1920x1080 and on uniform
#: noise, where this count is low)
_SIGNALS_BYTES_PER_PIXEL = 13


def saliency_pass_bytes(frame_size: tuple[int, int]) -> int:
    """Bytes `token_saliency` holds at once for frames of ``frame_size`` (width, height), besides the decoded
    frame itself: one frame's signals at a time (see `_frame_signals`)."""
    width, height = frame_size
    return _SIGNALS_BYTES_PER_PIXEL * width * height


def frame_decisions(
    frames: Iterable[np.ndarray], cfg: MotionConfig | None = None, should_stop: Callable[[], bool] | None = None
) -> list[FrameDecision]:
    """Decisions for a whole sequence of frames (see ``MotionFilter``). ``should_stop`` (a turn's Stop or time
    limit) is asked after every frame: when it says yes, ``PrefillStopped`` ends the pass."""
    motion_filter = MotionFilter(cfg)
    decisions = []
    for frame in frames:
        decisions.append(motion_filter.push(frame))
        _stop_if_asked(should_stop)  # before the next frame is decoded
    return decisions


def _stop_if_asked(should_stop: Callable[[], bool] | None) -> None:
    if should_stop is not None and should_stop():
        raise PrefillStopped()


# ----------------------------------------------------------------------------------------------
# Spatial saliency
# ----------------------------------------------------------------------------------------------

# Canny hysteresis thresholds on the 3x3-blurred grey frame: fixed (not per-frame adaptive) so that
# densities are comparable across frames; sigma-2 noise produces no edges.
_CANNY_LOW, _CANNY_HIGH = 50, 150
# Global normalisation: each signal is divided by its 99th percentile over all tokens, but never by
# less than these floors, so that a uniformly flat video (where the percentile itself is tiny
# noise) stays low instead of being stretched to 1. Edge density: 2 % of the box on edges. LAB
# variance: 25 (a standard deviation of 5 LAB units, L in 0-100).
_EDGE_FLOOR = 0.02
_COLOUR_FLOOR = 25.0
_NORM_PERCENTILE = 99.0
# Variance of 8-bit LAB channels -> variance in LAB units (L in [0, 100], a/b unscaled).
_LAB8_VARIANCE_SCALE = np.array([(100 / 255) ** 2, 1.0, 1.0])


def _box_sums(integral: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    """Sums over half-open boxes from an (H+1, W+1[, C]) integral image; boxes already clipped."""
    x0, y0, x1, y1 = boxes.T
    return integral[y1, x1] - integral[y0, x1] - integral[y1, x0] + integral[y0, x0]


#: rows of a frame whose float64 integral images (sum and squares, 3 channels) are built at once, plus the height of
#: the band's boxes: a whole 4K frame's would take 400 MB, the largest transient of a Sali-Cache prefill
#: (scripts/guard_check.py found it); a band of 128 + 28 rows takes 29 MB
_BAND_ROWS = 128


def _banded_box_sums(image: np.ndarray, boxes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel sums and sums of squares of an (H, W, C) uint8 image over clipped half-open boxes (n, 4).

    Boxes at most `_BAND_ROWS` tall go by the band of rows their top lies in, each band's integral images
    built over its rows only; taller boxes (a global tile's cells) are summed directly, `_BAND_ROWS` rows
    at a time. The same integers as one whole-frame integral (exact: float64 holds sums of 8-bit values
    and their squares exactly), for a band's memory instead of the frame's; a few calls per band, none
    per box."""
    n, channels = boxes.shape[0], image.shape[2]
    sums, squares = np.zeros((n, channels)), np.zeros((n, channels))
    height = boxes[:, 3] - boxes[:, 1]
    tall = height > _BAND_ROWS
    short = np.flatnonzero(~tall)
    band_of = boxes[short, 1] // _BAND_ROWS
    for band in np.unique(band_of):
        rows = short[band_of == band]
        top = int(band) * _BAND_ROWS
        bottom = int(boxes[rows, 3].max())
        s, sq = cv2.integral2(image[top:bottom], sdepth=cv2.CV_64F, sqdepth=cv2.CV_64F)
        local = boxes[rows] - np.array([0, top, 0, top])
        sums[rows], squares[rows] = _box_sums(s, local), _box_sums(sq, local)
    for i in np.flatnonzero(tall):
        x0, y0, x1, y1 = (int(v) for v in boxes[i])
        for start in range(y0, y1, _BAND_ROWS):
            part = image[start : min(start + _BAND_ROWS, y1), x0:x1].reshape(-1, channels).astype(np.int64)
            sums[i] += part.sum(0)
            squares[i] += (part * part).sum(0)
    return sums, squares


def _frame_signals(frame: np.ndarray, boxes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Edge density and mean per-channel LAB variance of each box of one frame."""
    if frame.ndim != 3 or frame.shape[2] != 3 or frame.dtype != np.uint8:
        raise ValueError(f"frames must be RGB uint8 (H, W, 3), got {frame.dtype} {frame.shape}")
    h, w = frame.shape[:2]
    clipped = boxes.copy()
    clipped[:, [0, 2]] = np.clip(clipped[:, [0, 2]], 0, w)
    clipped[:, [1, 3]] = np.clip(clipped[:, [1, 3]], 0, h)
    clipped[:, 2] = np.maximum(clipped[:, 2], clipped[:, 0])
    clipped[:, 3] = np.maximum(clipped[:, 3], clipped[:, 1])
    area = ((clipped[:, 2] - clipped[:, 0]) * (clipped[:, 3] - clipped[:, 1])).astype(np.float64)
    safe_area = np.maximum(area, 1.0)

    grey = cv2.GaussianBlur(cv2.cvtColor(frame, cv2.COLOR_RGB2GRAY), (3, 3), 0)
    edges = (cv2.Canny(grey, _CANNY_LOW, _CANNY_HIGH) > 0).astype(np.uint8)
    edge_density = _box_sums(cv2.integral(edges, sdepth=cv2.CV_32S), clipped) / safe_area

    # 8-bit LAB (4x cheaper than float at 4K): L is stored as L * 255 / 100, a and b with a
    # +128 offset, so only L's variance needs rescaling to true LAB units. The 8-bit rounding
    # adds < 0.1 to a variance, far below the normalisation floor.
    lab = cv2.cvtColor(frame, cv2.COLOR_RGB2LAB)
    sums, squares = _banded_box_sums(lab, clipped)
    mean = sums / safe_area[:, None]
    var = squares / safe_area[:, None] - mean**2
    var *= _LAB8_VARIANCE_SCALE
    # E[x^2] - E[x]^2 can cancel to slightly below zero on flat boxes.
    colour_var = np.maximum(var, 0.0).mean(axis=1)

    empty = area == 0
    edge_density[empty] = 0.0
    colour_var[empty] = 0.0
    return edge_density, colour_var


def _normalise(values: np.ndarray, floor: float) -> np.ndarray:
    if values.size == 0:
        return values
    scale = max(float(np.percentile(values, _NORM_PERCENTILE)), floor)
    return np.clip(values / scale, 0.0, 1.0)


def token_saliency(
    frames: Sequence[np.ndarray],
    boxes: np.ndarray,
    frame_of_token: np.ndarray,
    *,
    edge_weight: float = 0.5,
    box_index: np.ndarray | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> np.ndarray:
    """Per-token saliency in [0, 1] from the token's pixel box (``should_stop``: asked before every frame is read;
    a yes raises ``PrefillStopped``).

    ``boxes``: (n_tokens, 4) int ``x0, y0, x1, y1`` (half-open, clipped to the frame; an empty box
    scores 0) in the pixel coordinates of frame ``frame_of_token[i]``; with ``box_index`` (n_tokens,),
    token i's box is ``boxes[box_index[i]]`` instead (a long video's layout boxes are then never copied
    whole). Saliency = ``edge_weight * edge + (1 - edge_weight) * colour`` where edge is the fraction
    of Canny edge pixels in the box and colour the mean per-channel LAB variance, each normalised over
    ALL tokens of the call (the whole video or image, not per frame) by their 99th percentile, with
    floors so that an all-flat video stays low. Canny and LAB run once per referenced frame, in
    ascending frame order (one frame decoded at a time for a lazy video), box statistics come from
    integral images: O(pixels + tokens log tokens); ~0.7 s for a 4K frame with 10,000 boxes on 2 CPU
    cores (Canny dominates).

    Limits: absolute Canny thresholds (no adaptation to low-contrast footage); variance in a box
    straddling two flat colours is high although the box holds no detail; a saliency of exactly
    tied tokens is split between tiers by token order (see ``assign_tiers``).
    """
    boxes = np.asarray(boxes)
    frame_of_token = np.asarray(frame_of_token)
    n = frame_of_token.shape[0] if frame_of_token.ndim == 1 else -1
    if boxes.ndim != 2 or boxes.shape[1] != 4:
        raise ValueError(f"boxes must be (n_tokens, 4), got {boxes.shape}")
    if box_index is None and frame_of_token.shape != (boxes.shape[0],):
        raise ValueError(f"frame_of_token must be ({boxes.shape[0]},), got {frame_of_token.shape}")
    if box_index is not None and (n < 0 or np.shape(box_index) != (n,)):
        raise ValueError(f"box_index must be ({n},) like frame_of_token, got {np.shape(box_index)}")
    if not 0.0 <= edge_weight <= 1.0:
        raise ValueError(f"edge_weight must be in [0, 1], got {edge_weight}")
    if n and (frame_of_token.min() < 0 or frame_of_token.max() >= len(frames)):
        raise ValueError("frame_of_token points outside frames")
    edge = np.zeros(n)
    colour = np.zeros(n)
    # tokens grouped by frame in one sort (a per-frame scan over all tokens is frames x tokens)
    order = np.argsort(frame_of_token, kind="stable")
    sorted_frames = frame_of_token[order]
    starts = np.flatnonzero(np.r_[True, sorted_frames[1:] != sorted_frames[:-1]]) if n else np.zeros(0, int)
    for start, end in zip(starts, [*starts[1:], n][: len(starts)], strict=True):
        _stop_if_asked(should_stop)
        sel = order[start:end]
        rows = sel if box_index is None else np.asarray(box_index)[sel]
        edge[sel], colour[sel] = _frame_signals(frames[int(sorted_frames[start])], boxes[rows].astype(np.int64))
    edge_n = _normalise(edge, _EDGE_FLOOR)
    colour_n = _normalise(colour, _COLOUR_FLOOR)
    return (edge_weight * edge_n + (1 - edge_weight) * colour_n).astype(np.float32)


# ----------------------------------------------------------------------------------------------
# Tiers
# ----------------------------------------------------------------------------------------------

TIER_FULL, TIER_INT8, TIER_INT4, TIER_PRUNED = 0, 1, 2, 3


def _check_fractions(fractions: Sequence[float]) -> None:
    if len(fractions) != 3:
        raise ValueError(f"tiers need 3 fractions (full, int8, int4), got {len(fractions)}")
    for f in fractions:
        if not 0.0 <= f <= 1.0:  # also rejects NaN
            raise ValueError(f"each tier fraction must be in [0, 1], got {f}")
    if sum(fractions) > 1.0 + 1e-9:
        raise ValueError(f"tier fractions must sum to <= 1, got {sum(fractions):g}")


@dataclass(frozen=True)
class TierSpec:
    """Fractions of (non-skipped) visual tokens, by saliency rank: the top ``fractions[0]`` stay
    full precision, the next ``fractions[1]`` go INT8, the next ``fractions[2]`` INT4, the rest
    are pruned.

    Default (0.43, 0.10, 0.29), pruned 0.18: the Sali-Cache paper's patch split (FP16 31.7 %,
    INT8 7.1 %, INT4 21.4 %, pruned 13.1 %, skipped 26.7 % of all patches) renormalised over the
    73.3 % of patches in non-skipped frames: 43.2 / 9.7 / 29.2 / 17.9 %, rounded.
    """

    fractions: tuple[float, float, float] = (0.43, 0.10, 0.29)

    def __post_init__(self) -> None:
        _check_fractions(self.fractions)

    @property
    def pruned(self) -> float:
        return max(0.0, 1.0 - sum(self.fractions))


def parse_tiers(text: str) -> TierSpec:
    """``"0.45,0.1,0.3"`` -> ``TierSpec((0.45, 0.1, 0.3))``; ValueError with a one-line message."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 3:
        raise ValueError(f"tiers must be 'full,int8,int4' fractions, got {text!r}")
    try:
        fractions = tuple(float(p) for p in parts)
    except ValueError:
        raise ValueError(f"tiers must be three numbers like '0.45,0.1,0.3', got {text!r}") from None
    return TierSpec(fractions)  # type: ignore[arg-type]


def assign_tiers(saliency: np.ndarray, spec: TierSpec | None = None) -> np.ndarray:
    """Tier per token (``TIER_*``, int64), by saliency rank.

    Counts are ``round(cumsum(fractions) * n)`` boundaries, so each tier is within one token of its
    fraction; ties are broken by token order (stable), so equal saliencies may straddle a boundary.
    """
    spec = spec or TierSpec()
    saliency = np.asarray(saliency, dtype=np.float64).ravel()
    if np.isnan(saliency).any():
        raise ValueError("saliency contains NaN")
    n = saliency.size
    order = np.argsort(-saliency, kind="stable")
    bounds = np.rint(np.cumsum(spec.fractions) * n).astype(np.int64).clip(0, n)
    tier_by_rank = np.searchsorted(bounds, np.arange(n), side="right")
    tiers = np.empty(n, dtype=np.int64)
    tiers[order] = tier_by_rank
    return tiers
