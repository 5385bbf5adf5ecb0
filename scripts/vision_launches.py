"""Operations the Qwen vision tower dispatches for one input: transformers' per-chunk loop vs batched chunks.

Usage: python scripts/vision_launches.py OUT.json [--shape shape-qwen2.5-vl-7b] [--image 3840x2160]
  [--video-frames 64 --video-size 640x360] [--width 128] [--repeats 3]

On a GPU each dispatched ATen operation is (about) one kernel launch, and a profile found the Qwen2.5-VL vision
tower's per-window loop to be most of a 4K prefill's 51,000 launches. This counts, on CPU,
what the tower of a released configuration (depth, heads, patch, window and full-attention layers exactly as
released: `visualkv.models.synthetic.shapes`) dispatches for a 4K image and a video, with its widths scaled down
(`--width`: hidden size; MLP scaled alike) so it runs on a CPU: the number of operations and attention calls
depends on the structure and the input only, not on the width. Host reads (`tolist`, `item`) are counted too.
CPU seconds at that width are recorded as well (per-operation overhead dominates them, as launches do on a
GPU), the two paths run alternately in one process. Outputs are compared (max abs difference).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

from visualkv.bench.launches import HostReads, OpCounter


def _tower(shape: str, width: int):
    from visualkv.models.synthetic.shapes import build_shape_config, build_shape_processor

    processor = build_shape_processor(shape)
    cfg = build_shape_config(shape, processor).vision_config
    scale = width / cfg.hidden_size
    cfg.hidden_size = width
    cfg.intermediate_size = max(8, round(cfg.intermediate_size * scale))
    if hasattr(cfg, "out_hidden_size"):
        cfg.out_hidden_size = width
    cfg._attn_implementation = "sdpa"
    from transformers import AutoModel

    torch.manual_seed(0)
    tower = AutoModel.from_config(cfg).eval()
    return tower, processor


def _inputs(processor, image: tuple[int, int], frames: int, video_size: tuple[int, int]) -> dict[str, tuple]:
    from visualkv.bench.synthetic import image_media, video_media

    out = {}
    img = image_media(*image, seed=1).frames[0]
    enc = processor.image_processor(images=[img], return_tensors="pt")
    out[f"image {image[0]}x{image[1]}"] = (enc["pixel_values"], enc["image_grid_thw"])
    if frames:
        vid = video_media(frames, *video_size, fps=1.0, seed=2)
        stacked = torch.from_numpy(np.stack(list(vid.frames)))
        enc = processor.video_processor(videos=[stacked], do_sample_frames=False, return_tensors="pt")
        out[f"video {frames} frames {video_size[0]}x{video_size[1]}"] = (
            enc["pixel_values_videos"],
            enc["video_grid_thw"],
        )
    return out


def _attention(tower, stock: bool):
    """transformers' own per-chunk loop (the tower as it is), or VisualKV's batched chunks (`patched`)."""
    from visualkv.attention import patched

    return contextlib.nullcontext() if stock else patched(tower)


def _run(tower, pixels, grid, stock: bool) -> tuple[torch.Tensor, dict]:
    counter, reads = OpCounter(), HostReads()
    with torch.no_grad(), _attention(tower, stock), reads, counter:
        out = tower(pixels, grid_thw=grid).pooler_output
    return out, {"ops": counter.ops, "attention_calls": counter.attention, "host_reads": reads.reads}


def _timed(tower, pixels, grid, stock: bool) -> float:
    t0 = time.process_time()
    with torch.no_grad(), _attention(tower, stock):
        tower(pixels, grid_thw=grid)
    return time.process_time() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--shape", default="shape-qwen2.5-vl-7b")
    p.add_argument("--image", default="3840x2160")
    p.add_argument("--video-frames", type=int, default=64)
    p.add_argument("--video-size", default="640x360")
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    from visualkv.bench.provenance import save_json, start

    prov = start()
    prov["command"] = "python scripts/vision_launches.py " + " ".join(sys.argv[1:])
    torch.set_num_threads(1)

    def size(text: str) -> tuple[int, int]:
        w, h = (int(x) for x in text.split("x"))
        return w, h

    tower, processor = _tower(args.shape, args.width)
    rows = []
    for name, (pixels, grid) in _inputs(processor, size(args.image), args.video_frames, size(args.video_size)).items():
        stock_out, stock = _run(tower, pixels, grid, stock=True)
        batched_out, batched = _run(tower, pixels, grid, stock=False)
        times = {"stock": [], "batched": []}
        for _ in range(args.repeats):  # alternately, so load changes hit both alike
            times["stock"].append(_timed(tower, pixels, grid, stock=True))
            times["batched"].append(_timed(tower, pixels, grid, stock=False))
        row = {
            "input": name,
            "patches": int(pixels.shape[0]),
            "stock": stock,
            "batched": batched,
            "cpu_seconds_median": {k: sorted(v)[len(v) // 2] for k, v in times.items()},
            "max_abs_difference": float((stock_out - batched_out).abs().max()),
        }
        rows.append(row)
        print(
            f"{name}: ops {stock['ops']:,} -> {batched['ops']:,}, attention calls {stock['attention_calls']:,} -> "
            f"{batched['attention_calls']:,}, host reads {stock['host_reads']} -> {batched['host_reads']}, CPU s "
            f"{row['cpu_seconds_median']['stock']:.2f} -> {row['cpu_seconds_median']['batched']:.2f}, "
            f"max |diff| {row['max_abs_difference']:.1e}"
        )
    cfg = tower.config
    out = {
        "shape": args.shape,
        "vision": {
            "depth": getattr(cfg, "depth", None) or getattr(cfg, "num_hidden_layers", None),
            "heads": cfg.num_heads if hasattr(cfg, "num_heads") else cfg.num_attention_heads,
            "hidden_size_scaled_to": args.width,
            "window_size": getattr(cfg, "window_size", None),
            "fullatt_block_indexes": getattr(cfg, "fullatt_block_indexes", None),
        },
        "torch_threads": 1,
        "rows": rows,
    }
    save_json(out, args.out, prov)


if __name__ == "__main__":
    main()
