"""Needle-in-a-haystack accuracy of every method: ``python -m visualkv bench needle``.

On held-out generated scenes (:mod:`visualkv.bench.scenes`, seeds the demo model never saw) each method
answers a two-turn conversation: turn 1 about needle A (the ``single`` setting), turn 2 about a different
needle B from the cache turn 1 compressed (``followup``), which shows what query-aware eviction loses.
Budgets are fractions of the visual tokens; methods without a token budget get an equivalent operating point
(`kept_share_options`: EVS, FastV, VisionZip and Sali-Cache set to keep the same fraction; LightKV one merge
setting) and report their measured kept fraction. Videos
(``--videos N``) ask a needle's colour and when it appeared. A turn is correct when the greedy answer equals
the expected one (case-insensitive); results go to JSON (``results``: method, budget_fraction, setting,
size, accuracy, n, kept_fraction, by_kind) and a Plotly chart.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from visualkv.bench import provenance
from visualkv.bench.scenes import (
    Question,
    Scene,
    answer_matches,
    make_scene,
    make_video_scene,
    scene_media,
    video_media,
)
from visualkv.errors import ConfigError

DEFAULT_NEEDLE_SIZES: tuple[tuple[int, int], ...] = ((560, 315), (672, 378), (3840, 2160))
DEFAULT_FRACTIONS: tuple[float, ...] = (0.05, 0.1, 0.25)
DEFAULT_LARGE_FRACTIONS: tuple[float, ...] = (0.1,)  # the CLI's: one budget where a case costs seconds
EVICTION_METHODS = ("blockwise-snapkv", "blockwise-keydiff", "post-snapkv")
KIND_WEIGHTS = {"color": 0.5, "quadrant": 0.25, "count": 0.15, "presence": 0.1}
LARGE_PIXELS = 2_000_000  # sizes above this use --scenes-large scenes


@dataclass
class NeedleCase:
    size: str
    scene: Any  # Scene or VideoScene
    first: Question
    second: Question
    video: bool = False


def _pick(questions: list[Question], rng: np.random.Generator) -> Question:
    kinds = sorted({q.kind for q in questions})
    w = np.array([KIND_WEIGHTS.get(k, 0.1) for k in kinds])
    kind = kinds[int(rng.choice(len(kinds), p=w / w.sum()))]
    cands = [q for q in questions if q.kind == kind]
    return cands[int(rng.integers(len(cands)))]


def make_cases(size: tuple[int, int], n: int, seed0: int = 0) -> list[NeedleCase]:
    """n held-out two-question cases at ``size``: turn 1 about needle A, turn 2 about needle B != A."""
    cases = []
    label = f"{size[0]}x{size[1]}"
    seed = seed0
    while len(cases) < n:
        if seed - seed0 > 20 * n + 100:  # a scene places 2+ needle shapes in most seeds; a guard, not a limit
            raise ConfigError(f"scenes of {label} rarely hold two needles; use a larger size")
        rng = np.random.default_rng(seed + 424_242)
        scene: Scene = make_scene(seed, size, n_shapes=int(rng.integers(2, 4)))
        seed += 1
        present = sorted({o.shape for o in scene.needles})
        if len(present) < 2:
            continue
        a, b = (present[i] for i in rng.permutation(len(present))[:2])
        qa = _pick([q for q in scene.questions if q.target == a], rng)
        qb = _pick([q for q in scene.questions if q.target == b], rng)
        cases.append(NeedleCase(label, scene, qa, qb))
    return cases


def make_video_cases(n: int, seed0: int = 0, size: tuple[int, int] = (224, 224)) -> list[NeedleCase]:
    cases = []
    for i in range(n):
        video = make_video_scene(seed0 + i, size)
        color = next(q for q in video.questions if q.kind == "color")
        when = next(q for q in video.questions if q.kind == "when")
        cases.append(NeedleCase(f"video {size[0]}x{size[1]}x{video.num_frames}", video, color, when, video=True))
    return cases


#: methods that act on video only (EVS compares a frame with the one before it: a still image is kept whole)
VIDEO_ONLY = ("evs",)
#: VisionZip's paper split of what it keeps: 54 dominant to 10 contextual tokens
VISIONZIP_DOMINANT_SHARE = 54 / 64


def kept_share_options(method: str, fraction: float) -> dict[str, Any]:
    """The options that make a method without a token budget keep `fraction` of the visual tokens: EVS drops
    1 - f of a video (never less than its first frame), FastV drops 1 - f after layer K (every layer below K keeps
    all), VisionZip keeps f of each unit, split dominant / contextual as the paper's 54 / 10; Sali-Cache keeps f at
    its tiers (f/2, f/2, f). Budget methods get f x the visual tokens as M instead: no options."""
    if method == "evs":
        return {"pruning_rate": 1 - fraction}
    if method == "fastv":
        return {"ratio": 1 - fraction}
    if method == "visionzip":
        dominant = fraction * VISIONZIP_DOMINANT_SHARE
        return {"dominant": dominant, "contextual": fraction - dominant}
    if method == "salicache":
        return {"tiers": (fraction / 2, fraction / 2, fraction)}
    return {}


def operating_point(method: str, fraction: float) -> tuple[float | None, dict[str, Any]]:
    """(nominal fraction, or None for a fixed operating point; method_options) of `method` at budget fraction f:
    `full` keeps everything, LightKV one merge setting, every other method f (`kept_share_options`)."""
    if method == "full":
        return 1.0, {}
    if method == "lightkv":
        return None, {"ratios": (1.0,)}
    return fraction, kept_share_options(method, fraction)


def method_points(methods: list[str], fractions: list[float]) -> list[tuple[str, float | None, dict]]:
    """(method, nominal fraction or None for a fixed operating point, method_options)."""
    points: list[tuple[str, float | None, dict]] = []
    for m in methods:
        # one point for a method whose point does not follow f, one per fraction otherwise
        for f in fractions[:1] if m in ("full", "lightkv") else fractions:
            points.append((m, *operating_point(m, f)))
    return points


def run_case(
    adapter,
    case: NeedleCase,
    method: str,
    fraction: float | None,
    options: dict,
    media,
    block_size: int | None,
    max_new_tokens: int,
) -> dict[str, Any]:
    from visualkv.methods import method_traits
    from visualkv.runtime.session import ChatSession, SessionConfig

    n_visual = adapter_visual_tokens(adapter, media)
    budget = None
    if method_traits(method).needs_budget:
        budget = max(1, round((fraction or 1.0) * n_visual))
    cfg = SessionConfig(
        method=method, budget=budget, block_size=block_size, max_new_tokens=max_new_tokens, method_options=dict(options)
    )
    session = ChatSession(adapter, cfg)
    t0 = time.perf_counter()
    r1 = session.ask(case.first.question, media)
    kept = float(session.retained().mean()) if n_visual else 1.0
    first_report = session.report()  # KV held after the first turn: what the method kept of the media
    r2 = session.ask(case.second.question)
    return {
        "n_visual": n_visual,
        "kept_fraction": kept,
        "final_kv_bytes": first_report["final_kv_bytes"],
        "full_kv_bytes": first_report["full_kv_bytes"],
        "answers": [r1.answer, r2.answer],
        "correct": [answer_matches(r1.answer, case.first.answer), answer_matches(r2.answer, case.second.answer)],
        "seconds": time.perf_counter() - t0,
    }


_N_VISUAL_CACHE: dict[int, int] = {}


def adapter_visual_tokens(adapter, media) -> int:
    key = id(media)
    if key not in _N_VISUAL_CACHE:
        _N_VISUAL_CACHE[key] = int(adapter.prepare(media, "?").layout.n_visual)
    return _N_VISUAL_CACHE[key]


def run_needle(
    model: str = "visualkv-demo",
    sizes: list[tuple[int, int]] | None = None,
    n_scenes: int = 30,
    n_large: int = 6,
    n_videos: int = 10,
    fractions: list[float] | None = None,
    large_fractions: list[float] | None = None,
    methods: list[str] | None = None,
    block_size: int | None = None,
    max_new_tokens: int = 6,
    device: str = "cpu",
    dtype: str = "auto",
    seed0: int = 0,
    log=print,
) -> dict[str, Any]:
    """Run the benchmark and return ``{"results": [...], "cases": [...], ...}``."""
    from visualkv.methods import METHODS, method_traits
    from visualkv.models.registry import load_model

    sizes = sizes or list(DEFAULT_NEEDLE_SIZES)
    fractions = fractions or list(DEFAULT_FRACTIONS)
    if methods is None:
        methods = ["full", *EVICTION_METHODS, *(m for m in ("salicache", "lightkv") if m in METHODS)]
    for m in methods:
        method_traits(m)  # ConfigError (one line) for an unknown or refused name
    cases: list[NeedleCase] = []
    for size in sizes:
        n = n_large if size[0] * size[1] > LARGE_PIXELS else n_scenes
        cases += make_cases(size, n, seed0)
    if n_videos:
        cases += make_video_cases(n_videos, seed0)
    if not cases:
        raise ConfigError(
            "nothing to run: no scenes for these sizes and no videos (see --scenes, --scenes-large, --videos)"
        )
    adapter = load_model(model, device=device, dtype=dtype)
    points = method_points(methods, fractions)
    large_points = method_points(methods, large_fractions or fractions)
    per_case: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    for ci, case in enumerate(cases):
        media = video_media(case.scene) if case.video else scene_media(case.scene)
        large = not case.video and case.scene.width * case.scene.height > LARGE_PIXELS
        for method, fraction, options in large_points if large else points:
            try:
                out = run_case(adapter, case, method, fraction, options, media, block_size, max_new_tokens)
            except Exception as exc:  # noqa: BLE001 - one failing method must not sink the benchmark
                log(f"  {method} f={fraction}: failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
                continue
            per_case.append(
                {
                    "case": ci,
                    "size": case.size,
                    "video": case.video,
                    "seed": case.scene.seed,
                    "method": method,
                    "budget_fraction": fraction,
                    "questions": [case.first.question, case.second.question],
                    "expected": [case.first.answer, case.second.answer],
                    "kinds": [case.first.kind, case.second.kind],
                    **out,
                }
            )
        _N_VISUAL_CACHE.pop(id(media), None)
        full = [r for r in per_case if r["case"] == ci and r["method"] == "full"]
        log(
            f"[{ci + 1}/{len(cases)}] {case.size} seed {case.scene.seed}: "
            f"{case.first.question} -> {case.first.answer} / {case.second.question} -> {case.second.answer}; "
            f"full: {full[0]['answers'] if full else '-'}  ({time.perf_counter() - t_start:.0f}s)"
        )
    results = aggregate(per_case)
    return {
        "kind": "needle",
        "model": model,
        "fractions": fractions,
        "methods": methods,
        "block_size": block_size,
        "seconds": round(time.perf_counter() - t_start, 1),
        "results": results,
        "cases": per_case,
    }


def aggregate(per_case: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Accuracy per (method, budget_fraction, setting, size)."""
    groups: dict[tuple, list[tuple[bool, str, float]]] = {}
    kv_bytes: dict[tuple, list[int]] = {}
    for r in per_case:
        if r["video"]:
            turns = [(f"single ({r['kinds'][0]})", 0), (f"single ({r['kinds'][1]})", 1)]
        else:
            turns = [("single", 0), ("followup", 1)]
        for setting, t in turns:
            key = (r["method"], r["budget_fraction"], setting, r["size"])
            groups.setdefault(key, []).append((r["correct"][t], r["kinds"][t], r["kept_fraction"]))
            if "final_kv_bytes" in r:  # runs recorded before this field lack it
                kv_bytes.setdefault(key, []).append(r["final_kv_bytes"])
    rows = []
    for (method, fraction, setting, size), items in groups.items():
        by_kind: dict[str, list[bool]] = {}
        for ok, kind, _ in items:
            by_kind.setdefault(kind, []).append(ok)
        kept = float(np.mean([k for _, _, k in items]))
        rows.append(
            {
                "method": method,
                "budget_fraction": round(kept, 3) if fraction is None else fraction,
                "setting": "single" if setting.startswith("single") else setting,
                "question": setting.split("(")[1].rstrip(")") if "(" in setting else None,
                "size": size,
                "accuracy": sum(ok for ok, _, _ in items) / len(items),
                "n": len(items),
                "kept_fraction": round(kept, 4),
                "by_kind": {k: round(sum(v) / len(v), 3) for k, v in sorted(by_kind.items())},
            }
        )
        held = kv_bytes.get((method, fraction, setting, size))
        if held:
            rows[-1]["mean_final_kv_bytes"] = round(float(np.mean(held)))
    rows.sort(key=lambda r: (r["size"], r["setting"], r["method"], r["budget_fraction"]))
    return rows


def needle_figure(results: list[dict[str, Any]]):
    """Accuracy vs budget fraction, one panel per size, one colour per method, dashed = follow-up."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    sizes = list(dict.fromkeys(r["size"] for r in results))
    fig = make_subplots(rows=1, cols=len(sizes), subplot_titles=sizes, shared_yaxes=True)
    palette = ["#222222", "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]
    methods = list(dict.fromkeys(r["method"] for r in results))
    colors = {m: palette[i % len(palette)] for i, m in enumerate(methods)}
    for col, size in enumerate(sizes, start=1):
        for method in methods:
            for setting, dash in (("single", "solid"), ("followup", "dash")):
                rows = [
                    r
                    for r in results
                    if r["size"] == size
                    and r["method"] == method
                    and r["setting"] == setting
                    and r.get("question") in (None, "color")
                ]
                if not rows:
                    continue
                rows.sort(key=lambda r: r["budget_fraction"])
                xs = [r["budget_fraction"] for r in rows]
                ys = [r["accuracy"] for r in rows]
                if method == "full":
                    xs, ys = [0.04, 1.0], [ys[0], ys[0]]
                fig.add_trace(
                    go.Scatter(
                        x=xs,
                        y=ys,
                        mode="lines+markers",
                        name=f"{method} ({setting})",
                        legendgroup=f"{method}{setting}",
                        showlegend=col == 1,
                        line={"color": colors[method], "dash": dash},
                        marker={"size": 7},
                        hovertemplate=f"{method} {setting}<br>budget %{{x:.0%}}<br>accuracy %{{y:.0%}}<extra></extra>",
                    ),
                    row=1,
                    col=col,
                )
        fig.update_xaxes(type="log", title_text="budget (fraction of visual tokens)", tickformat=".0%", row=1, col=col)
    fig.update_yaxes(title_text="accuracy", range=[0, 1.05], tickformat=".0%", row=1, col=1)
    fig.update_layout(
        title="Needle accuracy vs KV budget (visualkv-demo, held-out scenes; dashed = follow-up)",
        height=460,
        width=max(700, 430 * len(sizes)),
        template="plotly_white",
    )
    return fig


def format_table(results: list[dict[str, Any]]) -> str:
    lines = [f"{'size':>16} {'setting':>9} {'method':>18} {'budget':>7} {'kept':>6} {'acc':>6} {'n':>4}"]
    for r in results:
        setting = r["setting"] + (f"/{r['question']}" if r.get("question") else "")
        lines.append(
            f"{r['size']:>16} {setting:>9} {r['method']:>18} {r['budget_fraction']:>7.3f} "
            f"{r['kept_fraction']:>6.3f} {r['accuracy']:>6.1%} {r['n']:>4}"
        )
    return "\n".join(lines)


def bench_needle(args) -> int:
    """CLI entry (`python -m visualkv bench needle`)."""
    from visualkv.report.viz import save_figure

    out = run_needle(
        args.model,
        args.needle_sizes,
        args.scenes,
        args.scenes_large,
        args.videos,
        args.fractions,
        args.large_fractions,
        args.methods,
        args.block_size,
        device=args.device,
        dtype=args.dtype,
    )
    os.makedirs(args.out, exist_ok=True)
    path = args.json_out or os.path.join(args.out, "needle.json")
    out = provenance.save_json(out, path, getattr(args, "provenance", None))
    print(format_table(out["results"]))
    saved = save_figure(needle_figure(out["results"]), os.path.join(args.out, "needle"))
    print("saved", path, *saved)
    return 0
