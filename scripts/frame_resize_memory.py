"""Peak RSS of a block-wise prefill of a 1080p video: frames at their decoded size vs resized at decode.

Usage: python scripts/frame_resize_memory.py OUT.json [--models tiny-qwen2.5-vl,tiny-llava-onevision]
  [--seconds 60] [--baseline COMMIT] [--method blockwise-keydiff] [--budget 1024]

A 1920x1080 video (`visualkv.bench.long_video`, kind ``moving``: every frame pans; generated into the
temporary folder, never committed) is prefilled at 1 fps with `--method`, in a fresh process per run, loaded
like an upload (frames decoded lazily). Each process first runs a 4-frame 1080p warm-up (libraries,
allocator), then resets its peak (Linux VmHWM) and measures load + prefill + first token: `peak_growth_bytes`
is that peak over the RSS before it. Runs per model:

* ``decoded size``: this tree with `ModelAdapter.resize_video_at_decode` off (frames reach the processor
  at 1920x1080; the per-token tables are int32);
* ``resized at decode``: this tree as shipped;
* ``baseline`` (with `--baseline COMMIT`, extracted with `git archive` into a temporary folder): another
  commit, measured the same way.

glibc's malloc is told to return freed large blocks (fixed mmap threshold, one arena), as in
tests/test_lazy_video.py, so RSS follows live memory rather than the allocator's free lists.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "What happens in the video?"

_CHILD = r"""
import gc, json, re, sys, time
import numpy as np
from visualkv.media import FrameSampling, load_media
from visualkv.runtime.frame_cap import media_limits
from visualkv.models.registry import load_model
from visualkv.runtime.session import ChatSession, SessionConfig

model, video, warm, resize, method, budget, prompt = sys.argv[1:8]

def status(key):
    return int(re.search(key + r":\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024

adapter = load_model(model)
adapter.resize_video_at_decode = resize == "on"  # an attribute the baseline tree does not read
config = SessionConfig(method=method, budget=int(budget), max_new_tokens=1)
sampling = FrameSampling(fps=1.0, max_frames=None)
ChatSession(adapter, config).ask(prompt, load_media(warm, media_limits(method), sampling))  # warm-up
gc.collect()
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS: the peak of what follows alone
before = status("VmRSS")
t0 = time.perf_counter()
media = load_media(video, media_limits(method), sampling)
session = ChatSession(adapter, config)
session.ask(prompt, media)
seconds = time.perf_counter() - t0
peak = status("VmHWM")
report = session.report()
prepared = adapter.prepare(media, prompt)  # the same tables the prefill built, to count their bytes
layout = prepared.layout
tables = [prepared.input_ids, prepared.position_ids, prepared.visual_mask, prepared.keep]
table_bytes = sum(t.numel() * t.element_size() for t in tables)
table_bytes += sum(getattr(layout, k).nbytes for k in ("seq_index", "frame", "row", "col", "box"))
read = prepared.vision_inputs.get("video", media)
print(json.dumps({
    "frames": media.num_frames,
    "decoded_frame": list(media.frame_shape),
    "frame_read_by_vision": list(read.frame_shape),
    "visual_tokens": report["visual_tokens"],
    "prompt_tokens": report["prompt_tokens"],
    "rss_before_bytes": before,
    "peak_rss_bytes": peak,
    "peak_growth_bytes": peak - before,
    "report_peak_rss_bytes": report["peak_rss_bytes"],
    "peak_kv_bytes": report["peak_kv_bytes"],
    "per_token_table_bytes": table_bytes,
    "per_token_table_bytes_per_visual_token": table_bytes / max(1, layout.n_visual),
    "seconds": seconds,
}))
"""


def _child(tree: Path, args: argparse.Namespace, model: str, video: str, warm: str, resize: str) -> dict:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MALLOC_MMAP_THRESHOLD_": "65536",
        "MALLOC_ARENA_MAX": "1",
        "PYTHONPATH": str(tree),
    }
    cmd = [sys.executable, "-c", _CHILD, model, video, warm, resize, args.method, str(args.budget), PROMPT]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tree, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{model} ({resize}, {tree}): {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _commit(rev: str) -> str:
    out = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def _extract(commit: str, folder: str) -> Path:
    """The tree of `commit` (git archive) in `folder`."""
    archive = subprocess.run(["git", "archive", commit], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
    return Path(folder)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--models", default="tiny-qwen2.5-vl,tiny-llava-onevision")
    p.add_argument("--seconds", type=int, default=60)
    p.add_argument("--method", default="blockwise-keydiff")
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--baseline", default=None, help="a commit to measure as well")
    args = p.parse_args()

    sys.path.insert(0, str(ROOT))  # this tree's package, whatever the working directory
    from visualkv.bench.long_video import LongVideoSpec, write_long_video
    from visualkv.bench.provenance import save_json, start

    prov = start()
    prov["command"] = "python scripts/frame_resize_memory.py " + " ".join(sys.argv[1:])
    folder = os.path.join(tempfile.gettempdir(), "visualkv-long-videos")
    spec = LongVideoSpec(args.seconds / 60, "moving", width=1920, height=1080)
    video = write_long_video(spec, folder)
    warm = write_long_video(LongVideoSpec(4 / 60, "moving", width=1920, height=1080, seed=1), folder)
    head = _commit("HEAD")
    runs = [("decoded size", ROOT, "off", head), ("resized at decode", ROOT, "on", head)]
    baseline_dir = tempfile.TemporaryDirectory(prefix="visualkv-baseline-")
    if args.baseline:
        runs.insert(0, ("baseline", _extract(args.baseline, baseline_dir.name), "off", _commit(args.baseline)))
    rows = []
    for model in args.models.split(","):
        for label, tree, resize, commit in runs:
            row = {"model": model, "run": label, "commit": commit, **_child(tree, args, model, video, warm, resize)}
            rows.append(row)
            print(
                f"{model:22s} {label:18s} frame read {row['frame_read_by_vision']}  visual {row['visual_tokens']:6d}  "
                f"peak growth {row['peak_growth_bytes'] / 2**20:7.1f} MiB  tables {row['per_token_table_bytes_per_visual_token']:.1f} B/token  "
                f"{row['seconds']:.0f} s",
                flush=True,
            )
    out = {
        "kind": "frame_resize_memory",
        "video": {
            "width": spec.width,
            "height": spec.height,
            "seconds": args.seconds,
            "kind": spec.kind,
            "fps": spec.fps,
        },
        "method": args.method,
        "budget": args.budget,
        "rows": rows,
    }
    save_json(out, args.out, prov)
    baseline_dir.cleanup()
    print("saved", args.out)


if __name__ == "__main__":
    main()
