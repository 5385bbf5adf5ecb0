"""`python -m visualkv bench gpu`: every method against transformers' own `generate`, on the GPU.

One process, the model built (or loaded) once. Two inputs: a 4K image (3840 x 2160) and a long synthetic
video (default 512 s at 1 fps, 640 x 360). For each input, every method runs one turn through
`ChatSession`, and transformers' `model.generate` runs on the same input as the reference a user would
otherwise run. Per case the CUDA peak is reset and the case reports:

- `peak_over_weights_bytes`: CUDA peak allocated during the case minus what was allocated before it
  (the weights and nothing else: inputs are built on the host),
- `guard_estimate_bytes` (the methods' rows): the memory guard's estimate of what the prefill was to allocate
  (`visualkv.runtime.memory_guard`), to set beside the peak above (which also holds the media's decoding and the decode),
- `cache_peak_bytes`: the KV cache's own high-water mark (ours: `peak_kv_bytes`; generate: the bytes of
  the returned cache, which only grows),
- `ttft_seconds`: from the raw media (processor included, for both) to the first new token; on a video
  also `ttft_seconds_per_hour` (scaled to an hour of video),
- `decode_tokens_per_second` over `new_tokens` tokens (EOS is ignored so every case decodes as many),
- ratios of each to `generate` on the same input.

The video is a generated file (`visualkv.bench.long_video`: ``mix``, static shots, pans and cuts like the
example video, or ``moving``, every frame moves; cached under `video_dir`) loaded like a user's upload, so
its frames are decoded lazily, per block, for every case. Each case loads it with its own frame cap: none
for a method whose memory is bounded (`visualkv.methods.media_limits`); `FULL_FRAME_CAP` (512 frames) for
`full` and the other bulk methods, and `reference_max_frames` (the same 512 by default) for transformers'
`generate`, which stacks every frame in host memory and encodes them in one vision call. A case past its
cap is a row with `refused` (the one-line reason) instead of figures: an hour of video (3,600 frames,
~540k visual tokens on Qwen2.5-VL) runs the bounded methods and shows the others refused.

Memory needs CUDA; on CPU (the test, or a dry run) the same code runs with small sizes and the memory
fields are null. GPU code paths import neither plotly, gradio, decord nor kaleido: the chart is written
only when plotly imports. The JSON and the table are rewritten after every case, so a run cut short by a
time limit keeps what it measured (`complete` is false until the last case).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from visualkv.bench import gpu_targets, provenance
from visualkv.bench.gpu_targets import case_label, input_label, measured
from visualkv.bench.synthetic import image_media, video_media
from visualkv.errors import MediaError
from visualkv.media import FrameSampling, Media, MediaLimits, load_media
from visualkv.methods import FULL_FRAME_CAP, METHODS, media_limits, method_traits
from visualkv.models.base import ModelAdapter, video_metadata
from visualkv.models.registry import load_model
from visualkv.report.telemetry import peak_rss_bytes
from visualkv.runtime.session import ChatSession, SessionConfig

REFERENCE = gpu_targets.REFERENCE  # transformers' own processor + generate, the row every ratio divides by
PROMPT = "Describe what you see in detail."
HOUR = 3600.0  # seconds of video `ttft_seconds_per_hour` is scaled to


@dataclass
class GpuBenchConfig:
    """What `bench gpu` runs (all of it is written into the JSON)."""

    model: str = "shape-qwen2.5-vl-7b"
    device: str = "cuda"
    dtype: str = "auto"
    methods: tuple[str, ...] = tuple(METHODS)
    budget: int = 1024
    block_size: int | None = None
    image_size: tuple[int, int] = (3840, 2160)
    video_seconds: int = 512
    video_fps: float = 1.0
    video_size: tuple[int, int] = (640, 360)
    video_kinds: tuple[str, ...] = ("mix",)  # visualkv.bench.long_video.VIDEO_KINDS; one video input each
    video_dir: str | None = None  # where generated videos are cached; None: long_video.default_video_dir()
    # transformers' generate stacks every frame and encodes them at once: refused past this many frames
    reference_max_frames: int = FULL_FRAME_CAP
    new_tokens: int = 64
    inputs: tuple[str, ...] = ("image", "video")
    out: str = "bench_out"
    # SessionConfig fields set for every method case (not the reference), e.g. {"decode": "eager"}
    session_overrides: dict[str, Any] = field(default_factory=dict)
    # also run each method whose default prefill is hybrid with every block of b tokens (prefill "blockwise"):
    # the TTFT target holds for both plans
    forced_blockwise: bool = False
    # also run each method whose default prefill is hybrid with this many blocks' media per vision-tower call
    # (SessionConfig.vision_ahead; 1: no such rows): the tower-launch lever beside the default
    vision_ahead: int = 1
    # also run each method with the fixed-shape decode's attention forced to each of these ("model", "grouped"),
    # beside its default ("auto"): SessionConfig.decode_attention, measured side by side on the same input
    decode_attention_rows: tuple[str, ...] = ()
    # run every case once, untimed, on a small image before the measured ones: the first CUDA call of each
    # code path pays one-off costs (library handles, lazily loaded kernels, the first graph capture) that a
    # user pays once per process, not per question; without it the first rows' TTFT carries them
    warmup: bool = True


def machine() -> str:
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return f"{props.name} ({props.total_memory / 2**30:.0f} GiB), {torch.cuda.device_count()} GPU(s)"
    return f"CPU only ({os.cpu_count()} cores, {platform.processor() or platform.machine()})"


# -- measuring -------------------------------------------------------------------------------------------------------
def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _start_case() -> int | None:
    """Free what the previous case left, reset the CUDA peak; returns the bytes allocated now (the weights)."""
    import gc

    gc.collect()
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return int(torch.cuda.memory_allocated())


def _peak_over(base: int | None) -> int | None:
    if base is None:
        return None
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated()) - base


@contextlib.contextmanager
def _ignoring_eos(adapter: ModelAdapter) -> Iterator[None]:
    """Make every case decode exactly `new_tokens` (random weights may hit EOS at any step)."""
    cls = type(adapter)
    adapter.__class__ = type(f"{cls.__name__}NoEos", (cls,), {"eos_token_ids": property(lambda self: set())})
    try:
        yield
    finally:
        adapter.__class__ = cls


def run_method(
    adapter: ModelAdapter,
    media: Media,
    method: str,
    cfg: GpuBenchConfig,
    prefill: str | None = None,
    vision_ahead: int = 1,
    decode_attention: str | None = None,
) -> dict[str, Any]:
    """One turn of `method` through ChatSession; `prefill` forces a prefill plan (None: the method's default);
    `vision_ahead` > 1: that many blocks' media per vision-tower call; `decode_attention` forces the fixed-shape
    decode's attention (None: the session's)."""
    base = _start_case()
    budget = cfg.budget if method_traits(method).needs_budget else None
    options = {"method": method, "budget": budget, "block_size": cfg.block_size, "max_new_tokens": cfg.new_tokens}
    options.update(cfg.session_overrides)
    if prefill is not None:
        options["prefill"] = prefill
    if vision_ahead > 1:
        options["vision_ahead"] = vision_ahead
    if decode_attention is not None:
        options["decode_attention"] = decode_attention
    session = ChatSession(adapter, SessionConfig(**options))
    with _ignoring_eos(adapter):
        record = session.ask(PROMPT, media)
    _sync()
    report = session.report()
    return {
        "ttft_seconds": record.ttft_seconds,
        "decode_tokens_per_second": record.decode_tokens_per_second,
        "decode_mode": record.decode_mode,  # graph / static / eager (visualkv.runtime.static_decode)
        "decode_attention": record.decode_attention,  # a fixed-shape step's: model / grouped ("" when eager)
        "prefill_attention": record.prefill_attention,  # blocks after the cache: flash / gqa / stock (block_attention)
        # building that decoder (a CUDA graph's capture), counted in the tokens/s above; the steady rate without it
        "decode_setup_seconds": record.decode_setup_seconds,
        "decode_steady_tokens_per_second": _steady_rate(record),
        "new_tokens": len(record.token_ids),
        "peak_over_weights_bytes": _peak_over(base),
        # the memory guard's estimate of what the prefill was to allocate (media decoding and decode aside)
        "guard_estimate_bytes": (report["memory_estimate"] or {}).get("to_allocate_bytes"),
        "cache_peak_bytes": report["peak_kv_bytes"],
        "cache_final_bytes": report["final_kv_bytes"],
        "full_kv_bytes": report["full_kv_bytes"],
        "visual_tokens": report["visual_tokens"],
        "prompt_tokens": report["prompt_tokens"],
        "prefill": report["prefill"],
        "block_size": report["block_size"],
        # the process's high-water mark so far: it never goes down, so a case includes the ones before it
        "process_peak_rss_bytes": report["peak_rss_bytes"],
    }


def _steady_rate(record) -> float:
    """Decode tokens/s without the decoder's setup (its capture): what every token after it costs."""
    n = len(record.token_ids)
    if n < 2 or not record.decode_tokens_per_second:
        return 0.0
    seconds = (n - 1) / record.decode_tokens_per_second - record.decode_setup_seconds
    return (n - 1) / seconds if seconds > 0 else 0.0


class _Clock:
    """A `generate` streamer that only records when each step's tokens arrive (the first call is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_generate(adapter: ModelAdapter, media: Media, cfg: GpuBenchConfig) -> dict[str, Any]:
    """transformers' own processor + `generate` on the same media, device and dtype: the model as users get it
    (VisualKV changes it only inside the sessions' own `visualkv.attention.patched`)."""
    base = _start_case()
    t0 = time.perf_counter()
    proc = adapter.processor
    text = adapter.chat_text(media, PROMPT)
    if media.kind == "image":
        from PIL import Image

        pil = Image.fromarray(media.frames[0])
        enc = proc(text=[text], images=[[pil]] if adapter.family == "smolvlm" else [pil], return_tensors="pt")
    else:
        enc = proc(
            text=[text],
            videos=[np.stack(list(media.frames))],  # decodes every frame of a lazy video: hence its frame cap
            video_metadata=[video_metadata(media)],
            do_sample_frames=False,
            return_tensors="pt",
        )
    enc = {k: v.to(adapter.device) if isinstance(v, torch.Tensor) else v for k, v in enc.items()}
    clock = _Clock()
    with torch.no_grad():
        out = adapter.model.generate(
            **enc,
            max_new_tokens=cfg.new_tokens,
            min_new_tokens=cfg.new_tokens,
            do_sample=False,
            streamer=clock,
            return_dict_in_generate=True,
        )
    _sync()
    t_end = time.perf_counter()
    steps = clock.times[1:]  # [0] is the prompt
    n_new = int(out.sequences.shape[1] - enc["input_ids"].shape[1])
    cache_bytes = _cache_bytes(out.past_key_values)
    return {
        "ttft_seconds": (steps[0] if steps else t_end) - t0,
        "decode_tokens_per_second": (n_new - 1) / max(t_end - steps[0], 1e-9) if len(steps) > 1 else 0.0,
        "new_tokens": n_new,
        "peak_over_weights_bytes": _peak_over(base),
        "cache_peak_bytes": cache_bytes,
        "cache_final_bytes": cache_bytes,
        "prompt_tokens": int(enc["input_ids"].shape[1]),
        "process_peak_rss_bytes": peak_rss_bytes(),
    }


def _cache_bytes(cache) -> int:
    """Bytes of the K/V tensors a transformers cache holds."""
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.nbytes
    return total


# -- the benchmark -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class VideoInput:
    """A generated video file every case loads for itself (lazily, with its own frame cap)."""

    kind: str  # "mix" or "moving"
    path: str
    frames: int  # sampled frames (the file holds exactly these: its fps is the sampling fps)
    seconds: float  # of video
    generation_seconds: float  # writing the file in this run (0.0: it was already cached)


def video_input(cfg: GpuBenchConfig, kind: str, log: Callable[[str], None] = print) -> VideoInput:
    """Write (once; later runs reuse the cached file) the `kind` video of `cfg.video_seconds` seconds."""
    # imported here: writing needs OpenCV, which an image-only run (and importing this module) does not
    from visualkv.bench.long_video import LongVideoSpec, default_video_dir, write_long_video

    width, height = cfg.video_size
    # the default seed: the cached file is shared with `bench memory --minutes` (its name omits the seed)
    spec = LongVideoSpec(cfg.video_seconds / 60, kind, width, height, fps=cfg.video_fps)
    folder = cfg.video_dir or default_video_dir()
    cached = os.path.exists(os.path.join(folder, spec.file_name()))
    t0 = time.perf_counter()
    path = write_long_video(spec, folder)
    took = 0.0 if cached else time.perf_counter() - t0
    how = "cached" if cached else f"written in {took:.1f} s"
    log(f"video {kind}: {spec.frame_count} frames {width}x{height} at {cfg.video_fps:g} fps, {how}: {path}")
    return VideoInput(kind, path, spec.frame_count, spec.frame_count / cfg.video_fps, took)


def case_limits(method: str, cfg: GpuBenchConfig) -> MediaLimits:
    """The frame cap a case loads the video with: the method's (none if bounded), or the reference's
    (capped like `full`: it holds every frame's KV too), with its own cap and name in the refusal."""
    limits = media_limits("full" if method == REFERENCE else method)
    if method == REFERENCE:
        limits = dataclasses.replace(limits, max_frames=cfg.reference_max_frames, cap_method=REFERENCE)
    # the refusal names this command's own option (bench gpu reads every frame of its generated videos)
    return dataclasses.replace(limits, fewer_frames="or shorten the video (--video-seconds)")


def load_case_media(method: str, video: VideoInput, cfg: GpuBenchConfig) -> Media:
    """The video as `method` gets it: decoded lazily; MediaError (one line) past the case's frame cap."""
    sampling = FrameSampling(fps=cfg.video_fps, max_frames=None)
    return load_media(video.path, case_limits(method, cfg), sampling)


@dataclass(frozen=True)
class Case:
    """One row of the bench on one input: a method (or the reference), with its prefill plan forced or not."""

    method: str
    forced_prefill: str | None = None  # "blockwise": every block of b tokens; None: the method's default plan
    vision_ahead: int = 1  # blocks' media per vision-tower call (SessionConfig.vision_ahead)
    decode_attention: str | None = None  # a fixed-shape decode's attention forced; None: the session's default

    @property
    def label(self) -> str:
        if self.forced_prefill is not None:
            return f"{self.method} ({self.forced_prefill} forced)"
        if self.decode_attention is not None:
            return f"{self.method} (decode attention {self.decode_attention})"
        return self.method if self.vision_ahead == 1 else f"{self.method} (vision ahead {self.vision_ahead})"


def cases(cfg: GpuBenchConfig) -> list[Case]:
    """The reference, then every method in `cfg.methods`, each block-wise one followed by its forced
    block-wise variant when `cfg.forced_blockwise` (a hybrid plan may give the first block more tokens) and by
    its vision-ahead variant when `cfg.vision_ahead` > 1; every method by one row per `cfg.decode_attention_rows`."""
    out = [Case(REFERENCE)]
    for method in cfg.methods:
        out.append(Case(method))
        hybrid = method_traits(method).default_prefill == "hybrid"
        if cfg.forced_blockwise and hybrid:
            out.append(Case(method, "blockwise"))
        if cfg.vision_ahead > 1 and hybrid:
            out.append(Case(method, vision_ahead=cfg.vision_ahead))
        out.extend(Case(method, decode_attention=attention) for attention in cfg.decode_attention_rows)
    return out


def run_case(adapter: ModelAdapter, media: Media, case: Case, cfg: GpuBenchConfig) -> dict[str, Any]:
    if case.method == REFERENCE:
        return run_generate(adapter, media, cfg)
    return run_method(
        adapter,
        media,
        case.method,
        cfg,
        prefill=case.forced_prefill,
        vision_ahead=case.vision_ahead,
        decode_attention=case.decode_attention,
    )


def run_gpu_bench(
    cfg: GpuBenchConfig, log: Callable[[str], None] = print, on_case: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """Run every case; a case past its frame cap is a `refused` row, one that fails is recorded with its
    one-line error, and the rest go on. `on_case(result)` after each case (to save partial results)."""
    t_load = time.perf_counter()
    adapter = load_model(cfg.model, device=cfg.device, dtype=cfg.dtype)
    _sync()
    load_seconds = time.perf_counter() - t_load
    weights = sum(p.nbytes for p in adapter.model.parameters())
    result: dict[str, Any] = {
        "bench": "gpu",
        "command": " ".join(["python -m visualkv", *sys.argv[1:]]) if sys.argv else "",
        "machine": machine(),
        "torch": torch.__version__,
        "transformers": _transformers_version(),
        "config": asdict(cfg),
        "model_info": adapter.describe(),
        "weights_bytes": weights,
        "load_seconds": load_seconds,
        "videos": [],
        "complete": False,
        "cases": [],
    }
    log(f"{cfg.model}: {weights / 2**30:.2f} GiB of weights, built/loaded in {load_seconds:.1f} s on {machine()}")
    sources: list[Media | VideoInput] = []  # the image in memory; a video as a file each case loads
    if "image" in cfg.inputs:
        sources.append(image_media(*cfg.image_size, seed=7))
    if "video" in cfg.inputs:
        for kind in cfg.video_kinds:
            video = video_input(cfg, kind, log)
            result["videos"].append(asdict(video))
            sources.append(video)
    if cfg.warmup:
        result["warmup_seconds"] = warm_up(adapter, cfg)
        video = f" and a {WARMUP_VIDEO_FRAMES}-frame video" if "video" in cfg.inputs else ""
        size = "x".join(map(str, warmup_size(cfg)))
        log(f"warm-up: every case once on a {size} image{video}, untimed: {result['warmup_seconds']:.1f} s")
    for source in sources:
        rows = []
        for case in cases(cfg):
            row = _one_case(adapter, source, case, cfg)
            rows.append(row)
            result["cases"].append(row)
            _add_ratios(rows)
            log(_line(row))
            if on_case is not None:
                on_case(result)
    result["complete"] = True
    return result


WARMUP_MAX_SIZE = (1344, 756)  # ~1.3k visual tokens on Qwen2.5-VL: past the default budget, so eviction runs too
WARMUP_VIDEO_FRAMES = 8  # a video's own paths (its processor, the tower's temporal patches) warm up too


def warmup_size(cfg: GpuBenchConfig) -> tuple[int, int]:
    """The warm-up image: the bench's image size, at most `WARMUP_MAX_SIZE`."""
    return (min(cfg.image_size[0], WARMUP_MAX_SIZE[0]), min(cfg.image_size[1], WARMUP_MAX_SIZE[1]))


def warm_up(adapter: ModelAdapter, cfg: GpuBenchConfig) -> float:
    """Every case once on a small image (and a short video when the bench has one) with two new tokens,
    results dropped; returns the seconds it took. A failing case is left to fail again, measured, in its own
    row (the warm-up never stops the bench)."""
    t0 = time.perf_counter()
    small = dataclasses.replace(cfg, new_tokens=2)
    width, height = warmup_size(cfg)
    inputs = [image_media(width, height, seed=11)]
    if "video" in cfg.inputs:
        inputs.append(video_media(WARMUP_VIDEO_FRAMES, *cfg.video_size, fps=cfg.video_fps, seed=11))
    for media in inputs:
        for case in cases(cfg):
            with contextlib.suppress(Exception):
                run_case(adapter, media, case, small)
    _sync()
    return time.perf_counter() - t0


def _one_case(adapter: ModelAdapter, source: Media | VideoInput, case: Case, cfg: GpuBenchConfig) -> dict[str, Any]:
    head: dict[str, Any] = {"input": "image" if isinstance(source, Media) else "video", "method": case.method}
    if case.forced_prefill is not None:
        head.update(case=case.label, forced_prefill=case.forced_prefill)
    if case.vision_ahead > 1:
        head.update(case=case.label, vision_ahead=case.vision_ahead)
    if case.decode_attention is not None:
        head.update(case=case.label, forced_decode_attention=case.decode_attention)
    if isinstance(source, VideoInput):
        head.update(video_kind=source.kind, video_frames=source.frames, video_seconds=source.seconds)
    try:
        media = source if isinstance(source, Media) else load_case_media(case.method, source, cfg)
    except MediaError as exc:  # past the case's frame cap (or the video-length limit): nothing decoded yet
        return {**head, "refused": str(exc).splitlines()[0]}
    try:
        row = run_case(adapter, media, case, cfg)
    except Exception as exc:  # noqa: BLE001 - one failed case must not lose the others
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        return {**head, "error": f"{type(exc).__name__}: {first}", "traceback": traceback.format_exc()[-2000:]}
    if isinstance(source, VideoInput):
        row["ttft_seconds_per_hour"] = row["ttft_seconds"] * HOUR / source.seconds
    return {**head, **row}


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each case's figures over the reference's on the same input (refused and failed rows have none)."""
    ref = next((r for r in rows if r["method"] == REFERENCE and measured(r)), None)
    visual = next((r.get("visual_tokens") for r in rows if r.get("visual_tokens")), None)
    for row in rows:
        if not row.get("visual_tokens"):
            row["visual_tokens"] = visual
        if ref is None or not measured(row):
            continue
        ratios = {}
        for key in ("ttft_seconds", "decode_tokens_per_second", "peak_over_weights_bytes", "cache_peak_bytes"):
            a, b = row.get(key), ref.get(key)
            ratios[key] = a / b if a is not None and b else None
        row["vs_generate"] = ratios


def _line(row: dict[str, Any]) -> str:
    head = f"  {input_label(row):18s} {case_label(row):28s}"
    if "refused" in row:
        return f"{head} refused: {row['refused']}"
    if "error" in row:
        return f"{head} FAILED {row['error']}"
    peak = row["peak_over_weights_bytes"]
    peak_txt = f"{peak / 2**20:9.0f} MiB over weights" if peak is not None else "  (no CUDA peak)"
    per_hour = row.get("ttft_seconds_per_hour")
    return (
        f"{head} TTFT {row['ttft_seconds']:7.2f} s"
        + (f" ({per_hour:.0f} s per hour of video)" if per_hour is not None else "")
        + f"  decode {row['decode_tokens_per_second']:7.1f} tok/s ({_decode_how(row)})  {peak_txt}  "
        f"cache peak {row['cache_peak_bytes'] / 2**20:9.1f} MiB"
    )


def _decode_how(row: dict[str, Any]) -> str:
    """ "graph, grouped" (the decode mode and a fixed-shape step's attention), or "generate" for the reference."""
    return ", ".join(x for x in (row.get("decode_mode"), row.get("decode_attention")) if x) or "generate"


def markdown_table(result: dict[str, Any]) -> str:
    """The README table: one row per (input, method); refused and failed cases say why."""
    columns = ["input", "method", "TTFT s", "TTFT s per hour of video", "decode tok/s", "peak over weights MiB"]
    columns += ["cache peak MiB", "peak / generate"]
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for r in result["cases"]:
        label = f"{input_label(r)} ({r.get('visual_tokens') or '?'} visual tokens)"
        if "refused" in r or "error" in r:
            why = f"refused: {r['refused']}" if "refused" in r else f"failed: {r['error']}"
            lines.append(f"| {label} | {case_label(r)} | {why.replace('|', '/')} | | | | | |")
            continue
        peak = r["peak_over_weights_bytes"]
        ratio = (r.get("vs_generate") or {}).get("peak_over_weights_bytes")
        per_hour = r.get("ttft_seconds_per_hour")
        mode = f" ({_decode_how(r)})" if r.get("decode_mode") else ""
        # the kernel of the prefill's blocks after the cache (block_attention): rows measured before it have none
        attention = f" ({r['prefill_attention']})" if r.get("prefill_attention") else ""
        lines.append(
            f"| {label} | {case_label(r)} | {r['ttft_seconds']:.2f}{attention} | "
            f"{'' if per_hour is None else f'{per_hour:,.0f}'} | "
            f"{r['decode_tokens_per_second']:.1f}{mode} | {'' if peak is None else f'{peak / 2**20:,.0f}'} | "
            f"{r['cache_peak_bytes'] / 2**20:,.1f} | {'' if ratio is None else f'{ratio:.3f}'} |"
        )
    return "\n".join(lines)


def save(result: dict[str, Any], out: str, prov: dict[str, Any] | None = None, chart: bool = True) -> list[str]:
    """JSON and the Markdown table (always) and a Plotly chart (HTML, with `chart` when plotly imports) under
    `out`, named after the model (runs of one model on other inputs need another `out`)."""
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, f"gpu_{result['config']['model']}")
    paths = [stem + ".json"]
    verdicts = gpu_targets.evaluate(result)  # the GPU targets, judged on the rows so far
    result = {**result, "targets": gpu_targets.as_json(verdicts)}
    result = provenance.save_json(result, paths[0], prov)  # with the command, machine and load
    with open(stem + ".md", "w") as fh:
        fh.write(markdown_table(result) + "\n\n" + gpu_targets.markdown(result, verdicts) + "\n")
    paths.append(stem + ".md")
    if not chart:
        return paths
    try:
        from plotly.subplots import make_subplots
    except ImportError:
        return paths  # the GPU box has no plotly: JSON + table only
    ok = [r for r in result["cases"] if measured(r)]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("CUDA peak over weights (MiB; cache peak on CPU)", "TTFT (s)"))
    for kind in dict.fromkeys(input_label(r) for r in ok):
        rows = [r for r in ok if input_label(r) == kind]
        names = [case_label(r) for r in rows]
        mem = [
            (r["peak_over_weights_bytes"] if r["peak_over_weights_bytes"] is not None else r["cache_peak_bytes"])
            / 2**20
            for r in rows
        ]
        fig.add_bar(x=names, y=mem, name=f"{kind} memory", row=1, col=1)
        fig.add_bar(x=names, y=[r["ttft_seconds"] for r in rows], name=f"{kind} TTFT", row=1, col=2)
    fig.update_layout(title=f"bench gpu: {result['config']['model']} on {result['machine']}", barmode="group")
    fig.write_html(stem + ".html", include_plotlyjs="cdn")
    paths.append(stem + ".html")
    return paths


#: `bench` CLI options handed to SessionConfig as they are, when given (a SessionConfig field of the same name);
#: exposing another session option to `bench gpu` is one name here plus its argparse option
SESSION_OPTIONS: tuple[str, ...] = ("decode", "decode_attention")


def session_overrides(args) -> dict[str, Any]:
    return {name: getattr(args, name) for name in SESSION_OPTIONS if getattr(args, name, None) is not None}


def bench_gpu(args) -> int:
    """CLI entry (`python -m visualkv bench gpu`)."""
    cfg = GpuBenchConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        methods=tuple(args.methods),
        budget=args.budget,
        block_size=args.block_size,
        image_size=tuple(args.image_size),
        video_seconds=args.video_seconds,
        video_fps=args.fps,
        video_size=tuple(args.video_size),
        video_kinds=tuple(args.video_kinds or GpuBenchConfig.video_kinds),
        video_dir=getattr(args, "video_dir", None),
        new_tokens=args.new_tokens,
        inputs=tuple(args.inputs),
        out=args.out,
        session_overrides=session_overrides(args),
        forced_blockwise=bool(getattr(args, "forced_blockwise", False)),
        vision_ahead=getattr(args, "vision_ahead", 1),
        decode_attention_rows=tuple(getattr(args, "decode_attention_rows", None) or ()),
        warmup=not getattr(args, "no_warmup", False),
    )
    prov = getattr(args, "provenance", None)
    # rewritten after every case: a run stopped by a time limit keeps what it measured
    result = run_gpu_bench(cfg, on_case=lambda partial: save(partial, cfg.out, prov, chart=False))
    for path in save(result, cfg.out, prov):
        print(f"wrote {path}")
    print(markdown_table(result))
    print()
    print(gpu_targets.markdown(result))
    return 0 if all("error" not in r for r in result["cases"]) else 1
