"""`bench memory --video --minutes 10,30,60`: bounded memory over hour-long videos.

For each video kind (``--video-kinds mix,moving``, see visualkv/bench/long_video.py) and length, the
video is written once to the system's temporary folder (``visualkv-long-videos``, or ``--video-dir``;
generated, never committed, reused by later runs) and every method prefills it in a
fresh process (`bench one --media-file`, loaded like an upload, frames decoded lazily), because a
process's peak RSS never goes down. A method that refuses the input (``full`` past its frame cap)
is recorded with its one-line message instead of a measurement.

Summary per (kind, method), between the shortest and the longest video: peak RSS growth as a share
of the shortest run's peak, the spread of peak KV bytes, final KV bytes, and TTFT per hour of video.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

from visualkv.bench import provenance
from visualkv.bench.long_video import LongVideoSpec, default_video_dir, write_long_video

MIB = 2**20


def _run_one(args: argparse.Namespace, method: str, path: str, frames: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "visualkv", "bench", "one", "--model", args.model, "--method", method]
    cmd += ["--budget", str(args.budget), "--device", args.device, "--dtype", args.dtype, "--media-file", path]
    cmd += ["--fps", str(args.fps), "--max-frames", str(frames)]
    if args.block_size:
        cmd += ["--block-size", str(args.block_size)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines() or ["no output"])[-1]
        return {"method": method, "refused": tail, "exit_code": proc.returncode}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarize(rows: list[dict[str, Any]], growth_from: float | None = None) -> dict[str, Any]:
    """Per kind and method: how memory and time change from the shortest (or the `growth_from` minutes)
    to the longest video."""
    out: dict[str, Any] = {}
    for kind in dict.fromkeys(r["video_kind"] for r in rows):
        for method in dict.fromkeys(r["method"] for r in rows):
            rs = sorted(
                (r for r in rows if r["video_kind"] == kind and r["method"] == method and "refused" not in r),
                key=lambda r: r["minutes"],
            )
            refused = [
                r["minutes"] for r in rows if r["video_kind"] == kind and r["method"] == method and "refused" in r
            ]
            entry: dict[str, Any] = {"measured_minutes": [r["minutes"] for r in rs], "refused_minutes": refused}
            growth = [r for r in rs if growth_from is None or r["minutes"] >= growth_from]
            if rs:
                longest = rs[-1]
                entry["final_kv_bytes_longest"] = longest["final_kv_bytes"]
                entry["ttft_seconds_per_hour"] = longest["ttft_seconds"] * 60 / longest["minutes"]
            if len(growth) >= 2:
                first, last = growth[0], growth[-1]
                peaks = [r["peak_kv_bytes"] for r in growth]
                entry["growth_minutes"] = [first["minutes"], last["minutes"]]
                entry["peak_rss_growth"] = (last["peak_rss_bytes"] - first["peak_rss_bytes"]) / first["peak_rss_bytes"]
                entry["peak_kv_spread"] = (max(peaks) - min(peaks)) / max(peaks)
            out[f"{kind}/{method}"] = entry
    return out


def bench_long_video(args: argparse.Namespace) -> int:
    inputs = getattr(args, "video_dir", None) or default_video_dir()
    rows: list[dict[str, Any]] = []
    for kind in args.video_kinds:
        for minutes in args.minutes:
            spec = LongVideoSpec(minutes, kind, fps=args.fps)
            path = write_long_video(spec, inputs)
            for method in args.methods:
                row = _run_one(args, method, path, spec.frame_count)
                row.update({"video_kind": kind, "minutes": minutes, "frames": spec.frame_count})
                rows.append(row)
                if "refused" in row:
                    print(f"{kind:6s} {minutes:4g} min {method:28s} refused: {row['refused']}", flush=True)
                    continue
                print(
                    f"{kind:6s} {minutes:4g} min {method:28s} visual {row['visual_tokens']:7d}  "
                    f"peak KV {row['peak_kv_bytes'] / MIB:8.2f} MiB  final KV {row['final_kv_bytes'] / MIB:8.2f} MiB  "
                    f"peak RSS {row['peak_rss_bytes'] / MIB:8.1f} MiB  TTFT {row['ttft_seconds']:.1f}s",
                    flush=True,
                )
    out = {
        "kind": "memory_long_video",
        "model": args.model,
        "budget": args.budget,
        "fps": args.fps,
        "minutes": list(args.minutes),
        "video_kinds": list(args.video_kinds),
        "rows": rows,
        "growth_from_minutes": args.growth_from,
        "summary": summarize(rows, args.growth_from),
    }
    path = os.path.join(args.out, f"memory_long_video_{args.model}.json")
    provenance.save_json(out, path, args.provenance)
    print(json.dumps(out["summary"], indent=1))
    print("saved", path)
    return 0
