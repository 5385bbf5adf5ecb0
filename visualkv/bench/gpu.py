"""`python -m visualkv bench gpu`: every method against transformers' own `generate`, on the GPU.

One process, the model built (or loaded) once. Two inputs: a 4K image (3840 x 2160) and a long synthetic
video (default 512 s at 1 fps, 640 x 360). For each input, every method runs one turn through
`ChatSession`, and transformers' `model.generate` runs on the same input as the reference a user would
otherwise run. Per case the CUDA peak is reset and the case reports:

- `peak_over_weights_bytes`: CUDA peak allocated during the case minus what was allocated before it
  (the weights and nothing else: inputs are built on the host),
- `cache_peak_bytes`: the KV cache's own high-water mark (ours: `peak_kv_bytes`; generate: the bytes of
  the returned cache, which only grows),
- `ttft_seconds`: from the raw media (processor included, for both) to the first new token,
- `decode_tokens_per_second` over `new_tokens` tokens (EOS is ignored so every case decodes as many),
- ratios of each to `generate` on the same input.

Memory needs CUDA; on CPU (the test, or a dry run) the same code runs with small sizes and the memory
fields are null. GPU code paths import neither plotly, gradio, decord nor kaleido: the chart is written
only when plotly imports.
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from visualkv.bench import provenance
from visualkv.bench.synthetic import image_media, video_media
from visualkv.media import Media
from visualkv.methods import METHODS, method_traits
from visualkv.models.base import ModelAdapter, video_metadata
from visualkv.models.registry import load_model
from visualkv.session import ChatSession, SessionConfig

REFERENCE = "transformers-generate"
PROMPT = "Describe what you see in detail."


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
    new_tokens: int = 64
    inputs: tuple[str, ...] = ("image", "video")
    out: str = "bench_out"


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


def run_method(adapter: ModelAdapter, media: Media, method: str, cfg: GpuBenchConfig) -> dict[str, Any]:
    base = _start_case()
    budget = cfg.budget if method_traits(method).needs_budget else None
    session = ChatSession(
        adapter, SessionConfig(method=method, budget=budget, block_size=cfg.block_size, max_new_tokens=cfg.new_tokens)
    )
    with _ignoring_eos(adapter):
        record = session.ask(PROMPT, media)
    _sync()
    report = session.report()
    return {
        "ttft_seconds": record.ttft_seconds,
        "decode_tokens_per_second": record.decode_tokens_per_second,
        "new_tokens": len(record.token_ids),
        "peak_over_weights_bytes": _peak_over(base),
        "cache_peak_bytes": report["peak_kv_bytes"],
        "cache_final_bytes": report["final_kv_bytes"],
        "full_kv_bytes": report["full_kv_bytes"],
        "visual_tokens": report["visual_tokens"],
        "prompt_tokens": report["prompt_tokens"],
        "prefill": report["prefill"],
        "block_size": report["block_size"],
    }


class _Clock:
    """A `generate` streamer that only records when each step's tokens arrive (the first call is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_generate(adapter: ModelAdapter, media: Media, cfg: GpuBenchConfig) -> dict[str, Any]:
    """transformers' own processor + `generate` on the same media, device and dtype."""
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
            videos=[np.stack(media.frames)],
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
def bench_inputs(cfg: GpuBenchConfig) -> dict[str, Media]:
    media = {}
    if "image" in cfg.inputs:
        media["image"] = image_media(*cfg.image_size, seed=7)
    if "video" in cfg.inputs:
        n_frames = max(2, round(cfg.video_seconds * cfg.video_fps))
        media["video"] = video_media(n_frames, *cfg.video_size, fps=cfg.video_fps, seed=8)
    return media


def run_gpu_bench(cfg: GpuBenchConfig, log=print) -> dict[str, Any]:
    """Run every case; a case that fails is recorded with its one-line error and the rest go on."""
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
        "cases": [],
    }
    log(f"{cfg.model}: {weights / 2**30:.2f} GiB of weights, built/loaded in {load_seconds:.1f} s on {machine()}")
    for kind, media in bench_inputs(cfg).items():
        rows = []
        for method in (REFERENCE, *cfg.methods):
            try:
                row = (
                    run_generate(adapter, media, cfg)
                    if method == REFERENCE
                    else run_method(adapter, media, method, cfg)
                )
            except Exception as exc:  # noqa: BLE001 - one failed case must not lose the others
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
                row = {"error": f"{type(exc).__name__}: {first}", "traceback": traceback.format_exc()[-2000:]}
            row = {"input": kind, "method": method, **row}
            rows.append(row)
            log(_line(row))
        _add_ratios(rows)
        result["cases"].extend(rows)
    return result


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each case's figures over the reference's on the same input."""
    ref = next((r for r in rows if r["method"] == REFERENCE and "error" not in r), None)
    visual = next((r.get("visual_tokens") for r in rows if r.get("visual_tokens")), None)
    for row in rows:
        row.setdefault("visual_tokens", visual)
        if ref is None or "error" in row:
            continue
        ratios = {}
        for key in ("ttft_seconds", "decode_tokens_per_second", "peak_over_weights_bytes", "cache_peak_bytes"):
            a, b = row.get(key), ref.get(key)
            ratios[key] = a / b if a is not None and b else None
        row["vs_generate"] = ratios


def _line(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"  {row['input']:5s} {row['method']:22s} FAILED {row['error']}"
    peak = row["peak_over_weights_bytes"]
    peak_txt = f"{peak / 2**20:9.0f} MiB over weights" if peak is not None else "  (no CUDA peak)"
    return (
        f"  {row['input']:5s} {row['method']:22s} TTFT {row['ttft_seconds']:7.2f} s  "
        f"decode {row['decode_tokens_per_second']:7.1f} tok/s  {peak_txt}  "
        f"cache peak {row['cache_peak_bytes'] / 2**20:9.1f} MiB"
    )


def markdown_table(result: dict[str, Any]) -> str:
    """The README table: one row per (input, method)."""
    lines = [
        "| input | method | TTFT s | decode tok/s | peak over weights MiB | cache peak MiB | peak / generate |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["cases"]:
        if "error" in r:
            lines.append(f"| {r['input']} | {r['method']} | failed: {r['error']} | | | | |")
            continue
        peak = r["peak_over_weights_bytes"]
        ratio = (r.get("vs_generate") or {}).get("peak_over_weights_bytes")
        lines.append(
            f"| {r['input']} ({r.get('visual_tokens') or '?'} visual tokens) | {r['method']} | {r['ttft_seconds']:.2f} | "
            f"{r['decode_tokens_per_second']:.1f} | {'' if peak is None else f'{peak / 2**20:,.0f}'} | "
            f"{r['cache_peak_bytes'] / 2**20:,.1f} | {'' if ratio is None else f'{ratio:.3f}'} |"
        )
    return "\n".join(lines)


def save(result: dict[str, Any], out: str, prov: dict[str, Any] | None = None) -> list[str]:
    """JSON (always) and a Plotly chart (HTML, when plotly imports) under `out`."""
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, f"gpu_{result['config']['model']}")
    paths = [stem + ".json"]
    result = provenance.save_json(result, paths[0], prov)  # with the command, machine and load
    with open(stem + ".md", "w") as fh:
        fh.write(markdown_table(result) + "\n")
    paths.append(stem + ".md")
    try:
        from plotly.subplots import make_subplots
    except ImportError:
        return paths  # the GPU box has no plotly: JSON + table only
    ok = [r for r in result["cases"] if "error" not in r]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("CUDA peak over weights (MiB; cache peak on CPU)", "TTFT (s)"))
    for kind in dict.fromkeys(r["input"] for r in ok):
        rows = [r for r in ok if r["input"] == kind]
        names = [r["method"] for r in rows]
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
        new_tokens=args.new_tokens,
        inputs=tuple(args.inputs),
        out=args.out,
    )
    result = run_gpu_bench(cfg)
    for path in save(result, cfg.out, getattr(args, "provenance", None)):
        print(f"wrote {path}")
    print(markdown_table(result))
    return 0 if all("error" not in r for r in result["cases"]) else 1
