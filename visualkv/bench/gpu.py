"""`python -m visualkv bench gpu`: every method against transformers' own `generate` and VisualKV's `full`, on the GPU.

One process, the model built once; a 4K image and a long synthetic video. The reference rows (`generate`,
`generate-static`, `full`) run first on the untouched model, then every method through `ChatSession`, all with
the same SDPA backends pinned, each case warmed once on its exact input and then timed `repeats` times (every
figure is median/min/max/n). Rows carry their share of the device's limits (`visualkv.bench.limits`). On CPU the
same code runs with small sizes and null memory fields. The JSON is rewritten after every case, so a run cut short
keeps what it measured. What each figure measures: docs/RESULTS.md#how-a-row-is-measured.
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

from visualkv.bench import device_peaks, gpu_targets, provenance
from visualkv.bench.gpu_targets import (
    GENERATE,
    GENERATE_ROWS,
    GENERATE_STATIC,
    case_label,
    input_label,
    measured,
    median,
    stats,
)
from visualkv.bench.limits import ModelWork, model_work, row_limits, work_json
from visualkv.bench.synthetic import image_media
from visualkv.bench.tables.gpu import console_line, markdown_table
from visualkv.errors import MediaError
from visualkv.media import FrameSampling, Media, MediaLimits, load_media
from visualkv.methods import METHODS, method_traits
from visualkv.models.base import ModelAdapter, video_metadata
from visualkv.models.registry import load_model
from visualkv.report.telemetry import peak_rss_bytes
from visualkv.runtime.decode_loop import read_interval
from visualkv.runtime.frame_cap import FULL_FRAME_CAP, media_limits
from visualkv.runtime.session import ChatSession, SessionConfig

REFERENCE = GENERATE  # the memory ratios (`vs_generate`) divide by this row
PROMPT = "Describe what you see in detail."
HOUR = 3600.0  # seconds of video `ttft_seconds_per_hour` is scaled to
TTFT_DEFINITION = (
    "from the decoded media in host memory to the first generated token id on the host, including the processor, "
    "the vision tower and the prefill"
)
#: every SDPA backend but cuDNN's (its execution graph is rebuilt for every new sequence length)
PINNED_SDPA_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")
#: figures measured on every repeat: {"median", "min", "max", "n"} in the JSON
TIMED = (
    "ttft_seconds",
    "decode_tokens_per_second",
    "decode_steady_tokens_per_second",
    "decode_setup_seconds",
    "peak_over_weights_bytes",
)


@dataclass
class GpuBenchConfig:
    """What `bench gpu` runs (all of it is written into the JSON)."""

    model: str = "shape-qwen2.5-vl-7b"
    device: str = "cuda"
    dtype: str = "auto"
    methods: tuple[str, ...] = tuple(METHODS)  # `full` always runs, as a reference
    budget: int = 1024
    block_size: int | None = None
    image_size: tuple[int, int] = (3840, 2160)
    video_seconds: int = 512
    video_fps: float = 1.0
    video_size: tuple[int, int] = (640, 360)
    video_kinds: tuple[str, ...] = ("mix",)  # visualkv.bench.long_video.VIDEO_KINDS; one video input each
    video_dir: str | None = None  # where generated videos are cached; None: long_video.default_video_dir()
    # the generate rows stack every frame and encode them at once: refused past this many frames
    reference_max_frames: int = FULL_FRAME_CAP
    new_tokens: int = 64
    inputs: tuple[str, ...] = ("image", "video")
    out: str = "bench_out"
    # SessionConfig fields set for every VisualKV case (not the generate rows), e.g. {"decode": "eager"}
    session_overrides: dict[str, Any] = field(default_factory=dict)
    # also run each method whose default prefill is hybrid with every block of b tokens (prefill "blockwise"):
    # the block-wise TTFT target holds for both plans
    forced_blockwise: bool = False
    # also run each method whose default prefill is hybrid with this many blocks' media per vision-tower call
    # (SessionConfig.vision_ahead; 1: no such rows): the tower-launch lever beside the default
    vision_ahead: int = 1
    # also run each method with the fixed-shape decode's attention forced to each of these ("model", "grouped"),
    # beside its default ("auto"): SessionConfig.decode_attention, measured side by side on the same input
    decode_attention_rows: tuple[str, ...] = ()
    # run each case once, untimed, on the exact input and token count it is measured on, before its repeats:
    # kernels, library handles, transformers' compile of the static decode and per-shape graphs are built there
    warmup: bool = True
    repeats: int = 3  # timed runs per case: each figure is their median, min and max
    # torch.nn.attention.SDPBackend names allowed for every row (warm-ups included); () leaves torch's choice
    sdpa_backends: tuple[str, ...] = PINNED_SDPA_BACKENDS


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
        # sampled tokens per host read while decoding (visualkv.runtime.decode_loop)
        "decode_read_every": read_interval(session.config.decode_read_every, adapter.device),
        "prefill_attention": record.prefill_attention,  # blocks after the cache: flash / gqa / stock (block_attention)
        # building that decoder (a CUDA graph's capture), counted in the tokens/s above; the steady rate without it
        "decode_setup_seconds": record.decode_setup_seconds,
        "decode_steady_tokens_per_second": _steady_rate(record),
        "new_tokens": len(record.token_ids),
        "peak_over_weights_bytes": _peak_over(base),
        "allocated_before_bytes": base,  # what the peak above is counted from (the weights, and anything held)
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


def run_generate(adapter: ModelAdapter, media: Media, cfg: GpuBenchConfig, static: bool = False) -> dict[str, Any]:
    """transformers' own processor + `model.generate` on the same media, device and dtype, on the untouched model;
    `static`: with `cache_implementation="static"`."""
    base = _start_case()
    t0 = time.perf_counter()
    enc = _processor_inputs(adapter, media)
    clock = _Clock()
    options = {"cache_implementation": "static"} if static else {}
    with torch.no_grad():
        out = adapter.model.generate(
            **enc,
            max_new_tokens=cfg.new_tokens,
            min_new_tokens=cfg.new_tokens,
            do_sample=False,
            streamer=clock,
            return_dict_in_generate=True,
            **options,
        )
    _sync()
    t_end = time.perf_counter()
    steps = clock.times[1:]  # [0] is the prompt; each put() receives the new token ids already on the host
    n_new = int(out.sequences.shape[1] - enc["input_ids"].shape[1])
    cache_bytes = _cache_bytes(out.past_key_values)
    return {
        "ttft_seconds": (steps[0] if steps else t_end) - t0,
        "decode_tokens_per_second": (n_new - 1) / max(t_end - steps[0], 1e-9) if len(steps) > 1 else 0.0,
        "new_tokens": n_new,
        "peak_over_weights_bytes": _peak_over(base),
        "allocated_before_bytes": base,  # what the peak above is counted from (the weights, and anything held)
        "cache_peak_bytes": cache_bytes,
        "cache_final_bytes": cache_bytes,
        "prompt_tokens": int(enc["input_ids"].shape[1]),
        "process_peak_rss_bytes": peak_rss_bytes(),
    }


def _processor_inputs(adapter: ModelAdapter, media: Media) -> dict[str, Any]:
    """The processor's tensors for `media` and the prompt, on the model's device."""
    proc = adapter.processor
    text = adapter.chat_text(media, PROMPT)
    if media.kind == "image":
        from PIL import Image

        pil = Image.fromarray(media.frames[0])
        enc = proc(text=[text], images=[[pil]] if adapter.family == "smolvlm" else [pil], return_tensors="pt")
    else:
        enc = proc(
            text=[text],
            videos=[np.stack(list(media.frames))],
            video_metadata=[video_metadata(media)],
            do_sample_frames=False,
            return_tensors="pt",
        )
    return {k: v.to(adapter.device) if isinstance(v, torch.Tensor) else v for k, v in enc.items()}


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
    """The frame cap a case loads the video with: the method's (none if bounded), or the generate rows'
    (capped like `full`: they hold every frame's KV too), with its own cap and name in the refusal."""
    reference = method in GENERATE_ROWS
    limits = media_limits("full" if reference else method)
    if reference:
        limits = dataclasses.replace(limits, max_frames=cfg.reference_max_frames, cap_method=method)
    # the refusal names this command's own option (bench gpu reads every frame of its generated videos)
    return dataclasses.replace(limits, fewer_frames="or shorten the video (--video-seconds)")


def load_case_media(method: str, video: VideoInput, cfg: GpuBenchConfig) -> Media:
    """The video as `method` gets it, opened lazily; MediaError (one line) past the case's frame cap."""
    sampling = FrameSampling(fps=cfg.video_fps, max_frames=None)
    return load_media(video.path, case_limits(method, cfg), sampling)


def in_host_memory(media: Media) -> Media:
    """`media` with every frame decoded (where TTFT starts: the same decoded frames for every row)."""
    return dataclasses.replace(media, frames=list(media.frames)) if media.is_lazy else media


@dataclass(frozen=True)
class Case:
    """One row of the bench on one input: a reference or a method, with its prefill plan forced or not."""

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
    """The references (`generate`, `generate-static`, `full`), then every other method in `cfg.methods`; each
    block-wise one followed by its forced block-wise variant when `cfg.forced_blockwise` (a hybrid plan may give
    the first block more tokens) and by its vision-ahead variant when `cfg.vision_ahead` > 1; every VisualKV row
    by one row per `cfg.decode_attention_rows`."""
    out = [Case(GENERATE), Case(GENERATE_STATIC)]
    for method in ("full", *(m for m in cfg.methods if m != "full")):
        out.append(Case(method))
        hybrid = method_traits(method).default_prefill == "hybrid"
        if cfg.forced_blockwise and hybrid:
            out.append(Case(method, "blockwise"))
        if cfg.vision_ahead > 1 and hybrid:
            out.append(Case(method, vision_ahead=cfg.vision_ahead))
        out.extend(Case(method, decode_attention=attention) for attention in cfg.decode_attention_rows)
    return out


def run_case(adapter: ModelAdapter, media: Media, case: Case, cfg: GpuBenchConfig) -> dict[str, Any]:
    """One run of `case` on `media` (untimed or timed: the caller decides)."""
    if case.method in GENERATE_ROWS:
        return run_generate(adapter, media, cfg, static=case.method == GENERATE_STATIC)
    return run_method(
        adapter,
        media,
        case.method,
        cfg,
        prefill=case.forced_prefill,
        vision_ahead=case.vision_ahead,
        decode_attention=case.decode_attention,
    )


def measure_case(adapter: ModelAdapter, media: Media, case: Case, cfg: GpuBenchConfig) -> dict[str, Any]:
    """`case` once untimed on `media` (with `cfg.warmup`), then `cfg.repeats` times: the TIMED figures as
    {"median", "min", "max", "n"}, the others (token counts, cache bytes: the same every run) from the last run."""
    row: dict[str, Any] = {}
    if cfg.warmup:
        t0 = time.perf_counter()
        run_case(adapter, media, case, cfg)
        _sync()
        row["warmup_seconds"] = time.perf_counter() - t0
    runs = [run_case(adapter, media, case, cfg) for _ in range(max(1, cfg.repeats))]
    row.update(runs[-1])
    for key in TIMED:
        if key in row:
            row[key] = stats([run[key] for run in runs])
    return row


@contextlib.contextmanager
def pinned_attention(backends: tuple[str, ...]) -> Iterator[None]:
    """Only `backends` (SDPBackend names) for every scaled_dot_product_attention call inside (none: torch's)."""
    if not backends:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([getattr(SDPBackend, name) for name in backends]):
        yield


def attention_backend(cfg: GpuBenchConfig) -> dict[str, Any]:
    """How the rows' attention backend was fixed (the JSON's config)."""
    return {
        "sdpa_backends": list(cfg.sdpa_backends),
        "how": "torch.nn.attention.sdpa_kernel around every row, warm-ups included" if cfg.sdpa_backends else "",
        "TORCH_CUDNN_SDPA_AVOID_RECOMPILE": os.environ.get("TORCH_CUDNN_SDPA_AVOID_RECOMPILE"),
    }


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
    work = model_work(adapter)
    peak = device_peaks.device_peak(torch.cuda.get_device_name() if torch.cuda.is_available() else None)
    config = {**asdict(cfg), "ttft": TTFT_DEFINITION, "attention_backend": attention_backend(cfg)}
    result: dict[str, Any] = {
        "bench": "gpu",
        "command": " ".join(["python -m visualkv", *sys.argv[1:]]) if sys.argv else "",
        "machine": machine(),
        "torch": torch.__version__,
        "transformers": _transformers_version(),
        "config": config,
        "model_info": adapter.describe(),
        "weights_bytes": weights,
        "work": work_json(work),
        "device_peaks": device_peaks.as_json(peak),
        "load_seconds": load_seconds,
        "videos": [],
        "complete": False,
        "cases": [],
    }
    log(f"{cfg.model}: {weights / 2**30:.2f} GiB of weights, built/loaded in {load_seconds:.1f} s on {machine()}")
    sources: list[Media | VideoInput] = []  # the image in memory; a video as a file, decoded once per input
    if "image" in cfg.inputs:
        sources.append(image_media(*cfg.image_size, seed=7))
    if "video" in cfg.inputs:
        for kind in cfg.video_kinds:
            video = video_input(cfg, kind, log)
            result["videos"].append(asdict(video))
            sources.append(video)
    with pinned_attention(cfg.sdpa_backends):
        for source in sources:
            _run_input(adapter, source, cfg, result, work, peak, log, on_case)
    result["warmup_seconds"] = sum(r.get("warmup_seconds") or 0.0 for r in result["cases"])
    result["complete"] = True
    return result


def _run_input(adapter, source, cfg, result, work, peak, log, on_case) -> None:
    """Every case on one input, its rows appended to `result["cases"]` with their ratios and limits."""
    rows: list[dict[str, Any]] = []
    decoded: dict[str, Media] = {}  # the video's frames in host memory, decoded once for every case
    for case in cases(cfg):
        row = _one_case(adapter, source, case, cfg, decoded)
        rows.append(row)
        result["cases"].append(row)
        _add_ratios(rows)
        _add_limits(rows, work, peak)
        log(console_line(row))
        if on_case is not None:
            on_case(result)


def _one_case(
    adapter: ModelAdapter, source: Media | VideoInput, case: Case, cfg: GpuBenchConfig, decoded: dict[str, Media]
) -> dict[str, Any]:
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
    if isinstance(source, VideoInput):  # decoded before any clock starts, once for the input
        media = decoded.setdefault(source.path, in_host_memory(media))
    try:
        row = measure_case(adapter, media, case, cfg)
    except Exception as exc:  # noqa: BLE001 - one failed case must not lose the others
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        return {**head, "error": f"{type(exc).__name__}: {first}", "traceback": traceback.format_exc()[-2000:]}
    if isinstance(source, VideoInput):
        ttft = row["ttft_seconds"]
        row["ttft_seconds_per_hour"] = {
            **ttft,
            **{k: ttft[k] * HOUR / source.seconds for k in ("median", "min", "max")},
        }
    return {**head, **row}


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


RATIO_KEYS = ("ttft_seconds", "decode_tokens_per_second", "peak_over_weights_bytes", "cache_peak_bytes")


def _ratios(row: dict[str, Any], ref: dict[str, Any] | None, keys=RATIO_KEYS) -> dict[str, float | None] | None:
    """Medians of `row` over the reference's (None without a measured reference)."""
    if ref is None:
        return None
    out = {}
    for key in keys:
        a, b = median(row, key), median(ref, key)
        out[key] = a / b if a is not None and b else None
    return out


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each measured row's medians over the references' on the same input: `vs_generate` (the dynamic-cache row:
    memory), `vs_full` (compression) and `vs_best_generate` (time, against the better generate row per figure)."""
    generate = next((r for r in rows if r["method"] == REFERENCE and measured(r)), None)
    full = next((r for r in rows if r["method"] == "full" and "case" not in r and measured(r)), None)
    best = {
        "ttft_seconds": gpu_targets.best_generate(rows, "ttft_seconds", higher_is_better=False),
        "decode_tokens_per_second": gpu_targets.best_generate(rows, "decode_tokens_per_second", higher_is_better=True),
    }
    visual = next((r.get("visual_tokens") for r in rows if r.get("visual_tokens")), None)
    for row in rows:
        if not row.get("visual_tokens"):
            row["visual_tokens"] = visual
        if not measured(row):
            continue
        row["vs_generate"] = _ratios(row, generate)
        row["vs_full"] = _ratios(row, full)
        vs_best: dict[str, Any] = {}
        for key, ref in best.items():
            vs_best[key] = (_ratios(row, ref, (key,)) or {}).get(key)
            vs_best[key.replace("_seconds", "").replace("_tokens_per_second", "") + "_reference"] = (
                ref["method"] if ref else None
            )
        row["vs_best_generate"] = vs_best


def _add_limits(rows: list[dict[str, Any]], work: ModelWork, peak) -> None:
    """Each measured row's `limits` on the input's uncompressed work (`visualkv.bench.limits`)."""
    prompt = max((r.get("prompt_tokens") or 0 for r in rows if measured(r)), default=0)
    visual = max((r.get("visual_tokens") or 0 for r in rows if measured(r)), default=0)
    for row in rows:
        if measured(row):
            ttft, decode = median(row, "ttft_seconds"), median(row, "decode_tokens_per_second")
            row["limits"] = row_limits(work, peak, prompt, visual, ttft, decode)


def save(result: dict[str, Any], out: str, prov: dict[str, Any] | None = None, chart: bool = True) -> list[str]:
    """JSON and the Markdown table (always) and a Plotly chart (HTML, with `chart` when plotly imports) under
    `out`, named after the model (runs of one model on other inputs need another `out`)."""
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, f"gpu_{result['config']['model']}")
    paths = [stem + ".json"]
    verdicts = gpu_targets.evaluate(result)  # the GPU targets, judged on the rows so far
    result = {**result, "targets": gpu_targets.as_json(verdicts)}
    result = provenance.save_json(result, paths[0], prov)  # with the command, machine, load and code version
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
        mem = [(median(r, "peak_over_weights_bytes") or r["cache_peak_bytes"]) / 2**20 for r in rows]
        fig.add_bar(x=names, y=mem, name=f"{kind} memory", row=1, col=1)
        fig.add_bar(x=names, y=[median(r, "ttft_seconds") for r in rows], name=f"{kind} TTFT", row=1, col=2)
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
        repeats=getattr(args, "repeats", None) or GpuBenchConfig.repeats,
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
