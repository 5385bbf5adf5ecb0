"""Benchmarks: `python -m visualkv bench memory|latency ...`.

memory: sweeps input size (megapixels, or frames for video) for several
methods. Every (method, size) runs in its own subprocess, because a process's
peak RSS never goes down. Saves JSON plus a Plotly chart (HTML and PNG).
latency: TTFT of full, forced block-wise and hybrid prefill measured in one
process on the same input, reported as ratios to full.
Figures are measurements of this machine; compare ratios, not absolutes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from visualkv.bench import provenance
from visualkv.cli.args import (
    DEVICES,
    DTYPES,
    HelpFormatter,
    check_output_folder,
    comma_list,
    fraction,
    media_path,
    method_list,
    non_negative_int,
    output_file,
    positive_float,
    positive_int,
    scene_size,
)
from visualkv.errors import ConfigError
from visualkv.models.registry import DEMO_MODEL, FALLBACK_MODEL

DEFAULT_METHODS = "full,post-snapkv,blockwise-keydiff,blockwise-snapkv"
DEFAULT_SIZES = (0.5, 1, 2, 4, 8.3)  # megapixels; 8.3 = 3840x2160


BENCH_KINDS = {
    "memory": "peak/final KV and process RSS over input sizes, each method x size in a fresh process",
    "latency": "TTFT of full, forced block-wise and hybrid prefill (and lightkv) on one input, one process",
    "fidelity": "how far block-by-block prefill with nothing evicted moves the logits, per method",
    "salicache": "Sali-Cache against full on one video: TTFT, KV bytes, tier split, greedy-token agreement",
    "needle": "answer accuracy of every method on held-out synthetic scenes (the bundled demo model)",
    "one": "one prefill, reported as JSON (what memory runs in each fresh process)",
    "report": "regenerate the tables in README.md and docs/ from docs/results/*.json (--check: only compare)",
    "gpu": "every method vs transformers' generate on a 4K image and a long video: CUDA peak, TTFT, decode tok/s",
}
# random weights cannot answer (needle); gpu measures a real-size shape model (visualkv/models/synthetic/shapes.py)
DEFAULT_MODELS = {"needle": DEMO_MODEL, "gpu": "shape-qwen2.5-vl-7b"}


def add_bench_args(p: argparse.ArgumentParser) -> None:
    from visualkv.bench.needle import DEFAULT_FRACTIONS, DEFAULT_LARGE_FRACTIONS, DEFAULT_NEEDLE_SIZES
    from visualkv.methods import method_names

    p.formatter_class = HelpFormatter
    p.description = "Benchmarks; figures go to --out as JSON, HTML and PNG.\n" + "\n".join(
        f"  {kind:10s} {what}" for kind, what in BENCH_KINDS.items()
    )
    p.add_argument("kind", choices=list(BENCH_KINDS), help="which benchmark (see above)")
    p.add_argument(
        "--model",
        default=None,
        help="offline alias, Hub id or local path (default: visualkv-demo for needle, tiny-qwen2.5-vl otherwise)",
    )
    p.add_argument(
        "--methods",
        type=method_list,
        default=None,
        help=f"comma-separated methods, or all (default: all for needle, {DEFAULT_METHODS} otherwise)",
    )
    p.add_argument(
        "--budget",
        type=positive_int,
        default=1024,
        help="(memory/latency/one) visual KV entries kept per layer and KV head (M)",
    )
    p.add_argument(
        "--kept-share",
        type=fraction,
        default=None,
        help="(memory/one) instead of --budget, every method keeps this fraction of the visual tokens: M for the "
        "budget methods, their own options for the others (visualkv.bench.needle.kept_share_options)",
    )
    p.add_argument(
        "--block-size", type=positive_int, default=None, help="visual tokens per prefill block (default: the model's)"
    )
    p.add_argument(
        "--prefill",
        choices=["hybrid", "blockwise", "bulk"],
        default=None,
        help="(one) prefill mode (default: the method's)",
    )
    p.add_argument("--method", choices=method_names(), default="full", metavar="METHOD", help="(one) method")
    p.add_argument(
        "--sizes",
        type=comma_list(positive_float),
        default=list(DEFAULT_SIZES),
        help=f"(memory) megapixels, or frame counts with --video (default: {_csv(DEFAULT_SIZES)})",
    )
    p.add_argument(
        "--size", type=positive_float, default=8.3, help="(one/latency/fidelity) megapixels, or frames with --video"
    )
    p.add_argument(
        "--video",
        action="store_true",
        help="(memory/latency/fidelity/one) a synthetic 640x360 video instead of an image",
    )
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=None,
        help="(latency/salicache, default 1) runs per configuration, the minimum time kept; (gpu, default 3) timed "
        "runs per case, each figure their median, min and max",
    )
    p.add_argument(
        "--device", choices=DEVICES, default=None, help="where the model runs (default: auto for gpu, cpu otherwise)"
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="(report) only compare the tables with the JSON; exit 1 when any is out of date",
    )
    p.add_argument("--dtype", choices=DTYPES, default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--out", default="bench_out", help="output folder")
    p.add_argument(
        "--json",
        dest="json_out",
        type=output_file,
        default=None,
        help="(one/needle) also write the result to this file (checked before the run)",
    )
    p.add_argument(
        "--media", type=media_path, default="assets/example_video.webm", help="(salicache) video or image file"
    )
    p.add_argument(
        "--fps",
        type=positive_float,
        default=1.0,
        help="(salicache/gpu/memory --minutes/one) video frames sampled per second",
    )
    # gpu: every method vs transformers' generate (visualkv/bench/gpu.py)
    p.add_argument("--image-size", type=scene_size, default=(3840, 2160), help="(gpu) WxH of the image input")
    p.add_argument(
        "--video-seconds",
        type=positive_int,
        default=512,
        help="(gpu) seconds of the generated video input (read lazily; 3600: an hour, past the frame cap of full "
        "and of transformers' generate, whose cases are then recorded as refused)",
    )
    p.add_argument(
        "--video-size", type=scene_size, default=(640, 360), help="(gpu, memory --video) WxH of the video frames"
    )
    p.add_argument("--new-tokens", type=positive_int, default=64, help="(gpu) tokens decoded per case (EOS ignored)")
    p.add_argument(
        "--decode",
        choices=["auto", "eager", "static", "graph"],
        default=None,
        help="(gpu) how the methods decode (SessionConfig.decode; default auto: a CUDA graph per answer on one GPU)",
    )
    p.add_argument(
        "--decode-attention",
        choices=["auto", "model", "grouped"],
        default=None,
        help="(gpu) a fixed-shape decode step's attention (SessionConfig.decode_attention; default auto: grouped "
        "on CUDA over windows of 4096+ entries, else the model's own masked SDPA)",
    )
    p.add_argument(
        "--decode-attention-rows",
        type=comma_list(_decode_attention),
        default=None,
        metavar="KINDS",
        help="(gpu) also run each method with the decode attention forced to each of these (model, grouped), "
        "beside its default: the two measured side by side",
    )
    p.add_argument(
        "--forced-blockwise",
        action="store_true",
        help="(gpu) also run each block-wise method with every block of b tokens (prefill blockwise), beside its "
        "default hybrid plan",
    )
    p.add_argument(
        "--vision-ahead",
        type=positive_int,
        default=1,
        metavar="N",
        help="(gpu) also run each block-wise method with N blocks' media per vision-tower call, beside its default "
        "(1: no such rows)",
    )
    p.add_argument(
        "--no-warmup",
        action="store_true",
        help="(gpu) skip running each case once, untimed, on its own input before its timed repeats, so they carry "
        "the one-off costs (kernels loaded, graphs built, transformers' compile of the static decode)",
    )
    p.add_argument(
        "--inputs",
        type=comma_list(_gpu_input),
        default=["image", "video"],
        help="(gpu) which inputs: image, video or both",
    )
    p.add_argument(
        "--max-frames",
        type=non_negative_int,
        default=None,
        help="(salicache/one) video frames sampled at most (salicache default 64; one: 0 or unset = no cap beyond "
        "the method's, see run --max-frames)",
    )
    p.add_argument(
        "--max-new-tokens", type=positive_int, default=16, help="(salicache) greedy tokens compared with full"
    )
    p.add_argument(
        "--variants",
        action="store_true",
        help="(salicache) also run the ablation: temporal filter only, spatial tiers only, "
        "quantization only (each against the same full run)",
    )
    p.add_argument(
        "--media-file", type=media_path, default=None, help="(one) load this file instead of generating the input"
    )
    p.add_argument(
        "--minutes",
        type=comma_list(positive_float),
        default=None,
        help="(memory --video) lengths in minutes of generated hour-scale videos (e.g. 10,30,60), sampled at --fps; "
        "each method x length in a fresh process (visualkv/bench/long_memory.py)",
    )
    p.add_argument(
        "--growth-from",
        type=positive_float,
        default=None,
        help="(memory --minutes) compare peak RSS and KV from this length to the longest (default: the shortest)",
    )
    p.add_argument(
        "--video-kinds",
        type=comma_list(_video_kind),
        default=None,
        help="(memory --minutes, gpu) generated videos: mix: static shots, pans, cuts and an event, like the "
        "example video; moving: every frame moves (default: mix,moving for memory, mix for gpu)",
    )
    p.add_argument(
        "--video-dir",
        default=None,
        help="(memory --minutes, gpu) folder where generated videos are cached between runs "
        "(default: <tmp>/visualkv-long-videos)",
    )
    # needle: accuracy on held-out synthetic scenes (visualkv/bench/needle.py)
    p.add_argument(
        "--needle-sizes",
        type=comma_list(scene_size),
        default=list(DEFAULT_NEEDLE_SIZES),
        help="(needle) comma-separated WxH scene sizes (default: "
        f"{','.join(f'{w}x{h}' for w, h in DEFAULT_NEEDLE_SIZES)})",
    )
    p.add_argument("--scenes", type=non_negative_int, default=30, help="(needle) held-out scenes per size")
    p.add_argument(
        "--scenes-large", type=non_negative_int, default=6, help="(needle) scenes per size above 2 megapixels"
    )
    p.add_argument("--videos", type=non_negative_int, default=10, help="(needle) held-out needle videos")
    p.add_argument(
        "--fractions",
        type=comma_list(fraction),
        default=list(DEFAULT_FRACTIONS),
        help=f"(needle) budgets as fractions of the visual tokens (default: {_csv(DEFAULT_FRACTIONS)})",
    )
    p.add_argument(
        "--large-fractions",
        type=comma_list(fraction),
        default=list(DEFAULT_LARGE_FRACTIONS),
        help=f"(needle) budgets for sizes above 2 megapixels (default: {_csv(DEFAULT_LARGE_FRACTIONS)})",
    )


def _video_kind(text: str) -> str:
    from visualkv.bench.long_video import VIDEO_KINDS

    if text not in VIDEO_KINDS:
        raise argparse.ArgumentTypeError(f"a video kind is one of {', '.join(VIDEO_KINDS)}, got {text!r}")
    return text


def _decode_attention(text: str) -> str:
    if text not in ("model", "grouped"):
        raise argparse.ArgumentTypeError(f"a decode attention is model or grouped, got {text!r}")
    return text


def _gpu_input(text: str) -> str:
    if text not in ("image", "video"):
        raise argparse.ArgumentTypeError(f"an input is image or video, got {text!r}")
    return text


def _csv(values) -> str:
    return ",".join(f"{v:g}" for v in values)


def run_bench(args: argparse.Namespace) -> int:
    if args.kind == "report":
        return bench_report(args)
    args.provenance = provenance.start(getattr(args, "command_argv", None))
    if args.model is None:
        args.model = DEFAULT_MODELS.get(args.kind, FALLBACK_MODEL)
    if args.device is None:
        args.device = "auto" if args.kind == "gpu" else "cpu"
    if args.repeats is None:
        args.repeats = 3 if args.kind == "gpu" else 1
    if args.methods is None and args.kind == "gpu":
        from visualkv.methods import METHODS

        args.methods = list(METHODS)
    if args.video_kinds is None and args.kind == "memory":
        args.video_kinds = ["mix", "moving"]
    if args.methods is None and args.kind != "needle":  # needle's default: every registered method
        args.methods = DEFAULT_METHODS.split(",")
    if args.kind == "one":
        result = measure_one(
            args.model,
            args.method,
            args.budget,
            args.block_size,
            args.prefill,
            args.size,
            args.video,
            args.device,
            args.dtype,
            args.media_file,
            args.fps,
            args.max_frames,
            args.kept_share,
        )
        text = json.dumps(result)
        if args.json_out:
            with open(args.json_out, "w") as fh:
                fh.write(text)
        print(text)
        return 0
    check_output_folder(args.out)  # before the model loads: a bad --out is one line, not a lost run
    if args.kind == "needle":
        from visualkv.bench.needle import bench_needle

        return bench_needle(args)
    if args.kind == "salicache":
        return bench_salicache(args)
    if args.kind == "fidelity":
        return bench_fidelity(args)
    if args.kind == "memory":
        return bench_memory(args)
    if args.kind == "gpu":
        from visualkv.bench.gpu import bench_gpu

        return bench_gpu(args)
    return bench_latency(args)


def bench_report(args: argparse.Namespace) -> int:
    """Regenerate (or with --check, compare) the README/docs tables from the committed JSON."""
    from visualkv.bench import figures
    from visualkv.bench.staleness import UNCHECKED, History

    if History.read(figures.ROOT) is None:
        print(UNCHECKED)
    if args.check:
        stale = figures.check_documents()
        for name in stale:
            print(f"out of date: {name} (run: python -m visualkv bench report)")
        return 1 if stale else 0
    changed = figures.write_documents()
    print("updated: " + (", ".join(changed) if changed else "nothing (already current)"))
    return 0


def _media(size: float, video: bool):
    from visualkv.bench.synthetic import image_media, megapixel_size, video_media

    if video:
        return video_media(int(size))
    return image_media(*megapixel_size(size))


def measure_one(
    model: str,
    method: str,
    budget: int | None,
    block_size: int | None,
    prefill: str | None,
    size: float,
    video: bool,
    device: str = "cpu",
    dtype: str = "auto",
    media_file: str | None = None,
    fps: float = 1.0,
    max_frames: int | None = None,
    kept_share: float | None = None,
) -> dict[str, Any]:
    """Prefill one input and report memory and time (meant for a fresh process).

    With `media_file` the input is loaded like a user's upload; otherwise it is
    generated in memory (whose temporaries then count in the peak RSS). With `kept_share` f the method keeps f of
    the visual tokens (`visualkv.bench.needle.operating_point`: M = f x the visual tokens, or its own options)
    instead of keeping `budget`.
    """
    import torch

    from visualkv.models.registry import load_model
    from visualkv.report.telemetry import peak_rss_bytes, rss_bytes
    from visualkv.runtime.session import ChatSession, SessionConfig

    adapter = load_model(model, device=device, dtype=dtype)
    if media_file:
        from visualkv.media import FrameSampling, load_media
        from visualkv.runtime.frame_cap import media_limits

        # a video is decoded lazily, frame cap of the method (as the CLI's run does)
        media = load_media(media_file, media_limits(method), FrameSampling(fps=fps, max_frames=max_frames or None))
    else:
        media = _media(size, video)
    from visualkv.methods import method_traits

    options: dict[str, Any] = {}
    if kept_share is not None:
        from visualkv.bench.needle import operating_point

        n_visual = int(adapter.prepare(media, "Describe the image.").layout.n_visual)
        options = operating_point(method, kept_share)[1]
        budget = max(1, round(kept_share * n_visual)) if method_traits(method).needs_budget else None
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    base_rss, base_peak = rss_bytes(), peak_rss_bytes()
    base_cuda = torch.cuda.memory_allocated() if torch.cuda.is_available() else None

    session = ChatSession(
        adapter,
        SessionConfig(
            method=method,
            budget=budget if method_traits(method).needs_budget else None,
            block_size=block_size,
            prefill=prefill,
            max_new_tokens=1,
            method_options=options,
        ),
    )
    t0 = time.perf_counter()
    record = session.ask("Describe the image.", media)
    wall = time.perf_counter() - t0
    report = session.report()
    a = adapter
    entry_bytes = a.num_layers * 2 * a.num_kv_heads * a.head_dim * torch.empty((), dtype=a.dtype).element_size()
    protected = report["prompt_tokens"] - report["visual_tokens"] + 1  # + the first decoded token
    bound = None
    if method_traits(method).needs_budget and budget:
        bound = (budget + report["block_size"] + protected) * entry_bytes  # (M + b + protected) in every layer
    kept = {}
    if kept_share is not None:
        kept = {
            "kept_share": kept_share,
            "method_options": options,
            "kept_fraction": round(float(session.retained().mean()), 4),
        }
    return {
        "model": model,
        "method": method,
        **kept,
        "budget": budget,
        "size": size,
        "video": video,
        "prefill": report["prefill"],
        "block_size": report["block_size"],
        "visual_tokens": report["visual_tokens"],
        "blocks": len(report["blocks"]),
        "peak_kv_bytes": report["peak_kv_bytes"],
        "final_kv_bytes": report["final_kv_bytes"],
        "full_kv_bytes": report["full_kv_bytes"],
        "bound_kv_bytes": bound,
        "rss_before_bytes": base_rss,
        "peak_rss_before_bytes": base_peak,
        # the process peak through the prefill and the first token, read when the report starts (its
        # per-token lists grow with the input: ~100 MB of Python objects for an hour of video)
        "peak_rss_bytes": report["peak_rss_bytes"],
        "peak_rss_with_report_bytes": peak_rss_bytes(),
        "cuda_before_bytes": base_cuda,
        "cuda_peak_bytes": report["cuda_peak_bytes"],
        "ttft_seconds": record.ttft_seconds,
        "wall_seconds": wall,
    }


def _input_file(args: argparse.Namespace, size: float) -> str | None:
    """Write the synthetic image (or `size`-second video at 1 fps, `--video-size`) for `size` once, so each
    run loads it like an upload (a video then decodes lazily, as the CLI's run does)."""
    if args.video:
        from visualkv.bench.synthetic import write_video_file

        width, height = args.video_size
        path = os.path.join(args.out, "inputs", f"video_{int(size)}s_{width}x{height}.mp4")
        if not os.path.exists(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            write_video_file(path, int(size), width, height, fps=1.0)
        return path
    from PIL import Image

    from visualkv.bench.synthetic import megapixel_size, synthetic_image

    path = os.path.join(args.out, "inputs", f"image_{size:g}mp.png")
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        Image.fromarray(synthetic_image(*megapixel_size(size))).save(path, compress_level=1)
    return path


def _subprocess_one(args: argparse.Namespace, method: str, size: float) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "visualkv",
        "bench",
        "one",
        "--model",
        args.model,
        "--method",
        method,
        "--budget",
        str(args.budget),
        "--size",
        str(size),
        "--device",
        args.device,
        "--dtype",
        args.dtype,
    ]
    media_file = _input_file(args, size)
    if media_file:
        cmd += ["--media-file", media_file]
    if args.block_size:
        cmd += ["--block-size", str(args.block_size)]
    if args.kept_share is not None:
        cmd += ["--kept-share", str(args.kept_share)]
    if media_file and args.video:
        cmd += ["--fps", str(args.fps), "--max-frames", str(args.max_frames or 0)]
    if args.video:
        cmd.append("--video")
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise ConfigError(f"benchmark run {method} @ {size} failed: {tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench_memory(args: argparse.Namespace) -> int:
    if args.minutes:
        from visualkv.bench.long_memory import bench_long_video

        return bench_long_video(args)
    from visualkv.bench.needle import VIDEO_ONLY
    from visualkv.report.viz import memory_sweep_figure, save_figure

    methods, sizes = args.methods, args.sizes
    rows = []
    for size in sizes:
        for method in methods:
            if method in VIDEO_ONLY and not args.video:
                continue  # a still image has no previous frame: the method would keep every token
            row = _subprocess_one(args, method, size)
            rows.append(row)
            print(
                f"{method:18s} size {size:6g}  visual {row['visual_tokens']:6d}  "
                f"peak KV {row['peak_kv_bytes'] / 2**20:8.2f} MiB  final KV {row['final_kv_bytes'] / 2**20:8.2f} MiB  "
                f"peak RSS {row['peak_rss_bytes'] / 2**20:8.1f} MiB  TTFT {row['ttft_seconds']:.2f}s",
                flush=True,
            )
    summary = summarize_memory(rows, methods, args.budget if args.kept_share is None else None)
    out = {
        "kind": "memory",
        "model": args.model,
        "budget": args.budget,
        "video": args.video,
        "rows": rows,
        "summary": summary,
    }
    kept = ""
    if args.kept_share is not None:
        out["kept_share"] = args.kept_share
        out["budget"] = None  # M follows each input's visual tokens: `budget` in each row
        kept = f"_kept{args.kept_share:g}"
    path = os.path.join(args.out, f"memory_{'video' if args.video else 'image'}_{args.model}{kept}.json")
    out = provenance.save_json(out, path, args.provenance)
    fig = memory_sweep_figure(rows, "frames" if args.video else "megapixels")
    saved = save_figure(fig, path[:-5])
    print(json.dumps(summary, indent=1))
    print("saved", path, *saved)
    return 0


def summarize_memory(rows: list[dict], methods: list[str], budget: int | None) -> dict[str, Any]:
    """Ratios at the largest size and growth of peak RSS, per method (`budget` None: M followed each input)."""
    by = {m: sorted((r for r in rows if r["method"] == m), key=lambda r: r["size"]) for m in methods}
    summary: dict[str, Any] = {}
    full = by.get("full")
    for m, rs in by.items():
        if not rs:
            continue
        s = {
            "peak_rss_growth_bytes": rs[-1]["peak_rss_bytes"] - rs[0]["peak_rss_bytes"],
            "peak_kv_bytes_largest": rs[-1]["peak_kv_bytes"],
        }
        if full and m != "full":
            s["full_over_final_kv_largest"] = full[-1]["final_kv_bytes"] / max(rs[-1]["final_kv_bytes"], 1)
            s["full_over_peak_kv_largest"] = full[-1]["peak_kv_bytes"] / max(rs[-1]["peak_kv_bytes"], 1)
            fg = full[-1]["peak_rss_bytes"] - full[0]["peak_rss_bytes"]
            s["rss_growth_over_full_growth"] = s["peak_rss_growth_bytes"] / fg if fg > 0 else None
        bounds = [r["peak_kv_bytes"] / r["bound_kv_bytes"] for r in rs if r.get("bound_kv_bytes")]
        if bounds:
            s["peak_over_bound_max"] = max(bounds)
        over = [r for r in rs if budget is not None and r["visual_tokens"] > budget + (r["block_size"] or 0)]
        if len(over) >= 2:
            peaks = [r["peak_kv_bytes"] for r in over]
            s["peak_kv_spread_over_bound_sizes"] = (max(peaks) - min(peaks)) / max(peaks)
        summary[m] = s
    return summary


def bench_latency(args: argparse.Namespace) -> int:
    """TTFT for full (bulk), block-wise (forced) and hybrid, same process, same input.

    `--methods lightkv` adds LightKV (bulk prefill, merging inside) and its final KV bytes over full's."""
    from visualkv.models.registry import load_model
    from visualkv.runtime.session import ChatSession, SessionConfig

    adapter = load_model(args.model, device=args.device, dtype=args.dtype)
    media = _media(args.size, args.video)
    names = args.methods
    others = [m for m in names if m != "lightkv"]  # lightkv merges inside a bulk prefill: its own row
    method = "blockwise-snapkv" if "blockwise-snapkv" in others else (others[-1] if others else None)
    configs = {"full": SessionConfig(method="full", max_new_tokens=1)}
    if method is not None:
        configs["blockwise"] = SessionConfig(
            method=method, budget=args.budget, block_size=args.block_size, prefill="blockwise", max_new_tokens=1
        )
        configs["hybrid"] = SessionConfig(
            method=method, budget=args.budget, block_size=args.block_size, prefill="hybrid", max_new_tokens=1
        )
    if "lightkv" in names:  # default schedule (the paper's, scaled to the model's depth)
        configs["lightkv"] = SessionConfig(method="lightkv", max_new_tokens=1)
    ttft: dict[str, float] = {}
    runs: dict[str, list[float]] = {}  # every TTFT, in run order (repeats alternate the configurations)
    cpu: dict[str, float] = {}  # process CPU seconds of the turn: robust to other processes sharing the cores
    final_kv: dict[str, int] = {}
    lightkv_report = None
    for _ in range(max(1, args.repeats)):
        for name, cfg in configs.items():
            session = ChatSession(adapter, cfg)
            c0 = time.process_time()
            record = session.ask("Describe the image.", media)
            used = time.process_time() - c0
            cpu[name] = min(cpu.get(name, float("inf")), used)
            ttft[name] = min(ttft.get(name, float("inf")), record.ttft_seconds)
            runs.setdefault(name, []).append(record.ttft_seconds)
            final_kv[name] = session.cache.kv_bytes()
            if name == "lightkv":
                lightkv_report = session.method.report(session.prefill_result.context)["lightkv"]
            print(
                f"{name:10s} TTFT {record.ttft_seconds:.2f}s  CPU {used:.2f}s  "
                f"final KV {final_kv[name] / 2**20:.2f} MiB",
                flush=True,
            )
    out = {
        "kind": "latency",
        "model": args.model,
        "method": method,
        "budget": args.budget,
        "size": args.size,
        "video": args.video,
        "ttft_seconds": ttft,
        "cpu_seconds": cpu,
        "final_kv_bytes": final_kv,
        "ratios": {f"{name}/full": ttft[name] / ttft["full"] for name in configs if name != "full"},
        "cpu_ratios": {f"{name}/full": cpu[name] / cpu["full"] for name in configs if name != "full"},
        # ratio of each repeat's pair (same load, back to back), median over repeats: robust to load spikes
        "paired_median_ratios": {
            f"{name}/full": statistics.median(a / b for a, b in zip(runs[name], runs["full"]))
            for name in configs
            if name != "full"
        },
        "ttft_runs": runs,
    }
    if lightkv_report is not None:
        out["kv_ratios"] = {"lightkv/full": final_kv["lightkv"] / final_kv["full"]}
        out["lightkv"] = lightkv_report
        print(
            json.dumps(
                {
                    "final_kv lightkv/full": out["kv_ratios"]["lightkv/full"],
                    "flops_reduction": lightkv_report["flops"]["reduction"],
                    "overhead_seconds": lightkv_report["overhead_seconds"],
                }
            )
        )
    path = os.path.join(args.out, f"latency_{'video' if args.video else 'image'}_{args.model}.json")
    out = provenance.save_json(out, path, args.provenance)
    print(
        "TTFT (min):",
        json.dumps(out["ratios"]),
        "paired median:",
        json.dumps(out["paired_median_ratios"]),
        "CPU:",
        json.dumps(out["cpu_ratios"]),
        "saved",
        path,
    )
    return 0


def bench_salicache(args: argparse.Namespace) -> int:
    """Sali-Cache vs full on one media file, same process: TTFT ratio, final KV bytes ratio, tier
    split beside the paper's, greedy-token agreement. Runs alternate (salicache, full) `--repeats`
    times; the minimum TTFT of each is kept."""
    import torch

    from visualkv.media import FrameSampling, load_media
    from visualkv.methods.salicache import PAPER_TIER_FRACTIONS
    from visualkv.models.registry import load_model
    from visualkv.runtime.session import ChatSession, SessionConfig

    max_frames = 64 if args.max_frames is None else args.max_frames or None
    media = load_media(args.media, sampling=FrameSampling(fps=args.fps, max_frames=max_frames))
    adapter = load_model(args.model, device=args.device, dtype=args.dtype)
    prompt = "What happens in the video?" if media.kind == "video" else "Describe the image."
    ttft: dict[str, float] = {}
    runs: dict[str, tuple] = {}
    for _ in range(max(1, args.repeats)):
        for name in ("salicache", "full"):
            session = ChatSession(adapter, SessionConfig(method=name, max_new_tokens=args.max_new_tokens))
            record = session.ask(prompt, media)
            ttft[name] = min(ttft.get(name, float("inf")), record.ttft_seconds)
            runs[name] = (record, session.report(), session.prefill_result.logits)
            print(
                f"{name:10s} TTFT {record.ttft_seconds:.2f}s  final KV {runs[name][1]['final_kv_bytes']} B", flush=True
            )
    (sali, sali_report, sali_logits), (full, full_report, full_logits) = runs["salicache"], runs["full"]
    n = min(len(sali.token_ids), len(full.token_ids))
    same_prefix = next((i for i in range(n) if sali.token_ids[i] != full.token_ids[i]), n)
    out = {
        "kind": "salicache",
        "model": args.model,
        "media": args.media,
        "fps": args.fps,
        "max_frames": max_frames,
        "frames": len(media.frames),
        "visual_tokens": sali_report["visual_tokens"],
        "ttft_seconds": ttft,
        "ttft_ratio_salicache_over_full": ttft["salicache"] / ttft["full"],
        "final_kv_bytes": {"full": full_report["final_kv_bytes"], "salicache": sali_report["final_kv_bytes"]},
        "kv_ratio_full_over_salicache": full_report["final_kv_bytes"] / max(sali_report["final_kv_bytes"], 1),
        "tiers": sali_report["tiers"],
        "tier_fractions": sali_report["tier_fractions"],
        "paper_tier_fractions": PAPER_TIER_FRACTIONS,
        "vision_encoder_frames": {
            "full": full_report.get("vision_encoder_frames"),
            "salicache": sali_report.get("vision_encoder_frames"),
        },
        "llm_tokens_salicache": sali_report["llm_tokens"],
        "prompt_tokens": sali_report["prompt_tokens"],
        "greedy_tokens": {"full": full.token_ids, "salicache": sali.token_ids},
        "greedy_agreement": {
            "same_prefix_tokens": same_prefix,
            "compared": n,
            "positionwise": sum(a == b for a, b in zip(sali.token_ids, full.token_ids)) / max(n, 1),
            "identical": sali.token_ids == full.token_ids,
        },
        "first_token_logits": {
            "cosine": float(torch.nn.functional.cosine_similarity(sali_logits, full_logits, dim=0)),
            "top1_agree": int(sali_logits.argmax()) == int(full_logits.argmax()),
            "rank_in_full_of_salicache_top1": int((full_logits > full_logits[sali_logits.argmax()]).sum()),
        },
        "salicache_seconds": sali_report["salicache_seconds"],
    }
    if args.variants:
        out["variants"] = _salicache_variants(
            adapter, media, prompt, args.max_new_tokens, full, full_report, full_logits
        )
    path = os.path.join(args.out, f"salicache_{args.model}.json")
    out = provenance.save_json(out, path, args.provenance)
    keys = (
        "ttft_ratio_salicache_over_full",
        "kv_ratio_full_over_salicache",
        "tier_fractions",
        "greedy_agreement",
        "first_token_logits",
    )
    print(json.dumps({k: out[k] for k in keys}), "saved", path)
    return 0


SALICACHE_VARIANTS = {  # name -> method options: which part of Sali-Cache costs what
    "defaults": {},
    "temporal only": {"tiers": (1.0, 0.0, 0.0)},
    "spatial only": {"flow_threshold": 0.0},
    "quantization only": {"flow_threshold": 0.0, "tiers": (0.43, 0.10, 0.47)},
}


def _salicache_variants(
    adapter, media, prompt: str, max_new_tokens: int, full, full_report: dict, full_logits
) -> list[dict[str, Any]]:
    """Each variant once, against the same `full` run: KV ratio, first-token cosine, greedy agreement."""
    import torch

    from visualkv.runtime.session import ChatSession, SessionConfig

    rows = []
    for name, options in SALICACHE_VARIANTS.items():
        session = ChatSession(
            adapter, SessionConfig(method="salicache", max_new_tokens=max_new_tokens, method_options=dict(options))
        )
        record = session.ask(prompt, media)
        report = session.report()
        logits = session.prefill_result.logits
        rows.append(
            {
                "variant": name,
                "options": {k: list(v) if isinstance(v, tuple) else v for k, v in options.items()},
                "kv_ratio_full_over_salicache": full_report["final_kv_bytes"] / max(report["final_kv_bytes"], 1),
                "first_token_cosine": float(torch.nn.functional.cosine_similarity(logits, full_logits, dim=0)),
                "greedy_equal": sum(a == b for a, b in zip(record.token_ids, full.token_ids)),
                "compared": min(len(record.token_ids), len(full.token_ids)),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def bench_fidelity(args: argparse.Namespace) -> int:
    """How far block-by-block prefill (nothing evicted) moves the logits, per method, same input.

    Budget is set above the input, blocks are forced from the start, so any
    difference comes from encoding the media block by block (Qwen2.5-VL
    images: full-attention vision layers see one strip at a time).
    """
    import torch

    from visualkv.methods import method_traits
    from visualkv.models.registry import load_model
    from visualkv.runtime.session import ChatSession, SessionConfig

    adapter = load_model(args.model, device=args.device, dtype=args.dtype)
    media = _media(args.size, args.video)
    new_tokens = 16
    ref = ChatSession(adapter, SessionConfig(method="full", max_new_tokens=new_tokens))
    ref_tokens = ref.ask("Describe the image.", media).token_ids
    ref_logits = ref.prefill_result.logits
    rows = []
    methods = args.methods
    for method in methods:
        budget = 10**7 if method_traits(method).needs_budget else None
        s = ChatSession(
            adapter,
            SessionConfig(
                method=method, budget=budget, block_size=args.block_size, prefill="blockwise", max_new_tokens=new_tokens
            ),
        )
        tokens = s.ask("Describe the image.", media).token_ids
        diff = (s.prefill_result.logits - ref_logits).abs()
        agree = sum(a == b for a, b in zip(tokens, ref_tokens)) / max(len(ref_tokens), 1)
        row = {
            "method": method,
            "blocks": len(s.blocks),
            "max_abs_logit_diff": float(diff.max()),
            "ref_logit_range": float(ref_logits.max() - ref_logits.min()),
            "cosine": float(torch.nn.functional.cosine_similarity(s.prefill_result.logits, ref_logits, dim=0)),
            "same_top1": bool(int(s.prefill_result.logits.argmax()) == int(ref_logits.argmax())),
            "greedy_token_agreement": agree,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = {"kind": "fidelity", "model": args.model, "size": args.size, "video": args.video, "rows": rows}
    path = os.path.join(args.out, f"fidelity_{'video' if args.video else 'image'}_{args.model}.json")
    out = provenance.save_json(out, path, args.provenance)
    print("saved", path)
    return 0
