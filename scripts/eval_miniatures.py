"""Write miniature copies of Video-MME, MLVU, V*Bench and HR-Bench in their release layouts.

A few questions each, on synthetic needle scenes and videos (visualkv.bench.scenes) that the bundled
`visualkv-demo` model answers, in the files and columns the real releases use (docs/EVAL.md), so that
`python -m visualkv eval` runs end to end offline::

    python scripts/eval_miniatures.py OUT [--videos 2] [--images 3]
    python -m visualkv eval --benchmark videomme --data OUT/videomme --prompt question --fps 4 --out runs/vmme

The right answers come from the scenes' own questions; the wrong options are other colours, thirds,
quadrants or counts.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import sys
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from visualkv.bench.scenes import COLORS, QUADRANTS, make_scene, make_video_scene, render_scene, render_video
from visualkv.bench.synthetic import write_frames

LETTERS = "ABCD"
WHEN = ("start", "middle", "end", "never")
DURATIONS = ("short", "medium", "long")


def options_for(kind: str, right: str, seed: int) -> list[str]:
    """Four options holding `right`, in a seed-determined order."""
    pool = {"color": list(COLORS), "when": list(WHEN), "quadrant": list(QUADRANTS), "count": ["0", "1", "2", "3"]}
    rng = np.random.default_rng(seed)
    wrong = [o for o in pool[kind] if o != right]
    chosen = [right, *(wrong[i] for i in rng.permutation(len(wrong))[:3])]
    return [chosen[i] for i in rng.permutation(4)]


def video_questions(n_videos: int, seed0: int = 0):
    """(video name, video scene, question, options, right letter) for the colour and "when" questions."""
    for v in range(n_videos):
        scene = make_video_scene(seed0 + v)
        for q in scene.questions:
            if q.kind in ("color", "when"):
                opts = options_for(q.kind, q.answer, seed0 * 100 + v * 10 + len(q.kind))
                yield f"synthetic_{seed0 + v:03d}", scene, q, opts, LETTERS[opts.index(q.answer)]


def image_questions(n_images: int, size: tuple[int, int], kinds: tuple[str, ...], seed0: int):
    """(scene, question, options, right letter) for single needles' questions of `kinds`, one per scene."""
    found, seed = 0, seed0
    while found < n_images:
        scene = make_scene(seed, size, n_shapes=1)
        seed += 1
        q = next((q for q in scene.questions if q.kind in kinds), None)
        if q is None:
            continue
        opts = options_for(q.kind, q.answer, seed)
        found += 1
        yield scene, q, opts, LETTERS[opts.index(q.answer)]


def write_video(path: Path, scene) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_frames(str(path), render_video(scene), scene.fps, (scene.width, scene.height))


def write_videomme(out: Path, n_videos: int) -> None:
    import pandas as pd

    rows = []
    for i, (name, scene, q, opts, letter) in enumerate(video_questions(n_videos, seed0=0)):
        write_video(out / "data" / f"{name}.mp4", scene)
        rows.append(
            {
                "video_id": f"{i // 2 + 1:03d}",
                "duration": DURATIONS[(i // 2) % 3],
                "domain": "Synthetic",
                "sub_category": "Needle",
                "url": "",
                "videoID": name,
                "question_id": f"{i // 2 + 1:03d}-{i % 2 + 1}",
                "task_type": "Attribute Perception" if q.kind == "color" else "Temporal Perception",
                "question": q.question,
                "options": [f"{a}. {o}" for a, o in zip(LETTERS, opts)],
                "answer": letter,
            }
        )
    (out / "videomme").mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(out / "videomme" / "test-00000-of-00001.parquet")


def write_mlvu(out: Path, n_videos: int) -> None:
    tasks = {"color": "2_needle", "when": "5_order"}
    entries: dict[str, list[dict]] = {stem: [] for stem in tasks.values()}
    for name, scene, q, opts, _ in video_questions(n_videos, seed0=20):
        stem = tasks[q.kind]
        write_video(out / "video" / stem / f"{name}.mp4", scene)
        entries[stem].append(
            {
                "video": f"{name}.mp4",
                "duration": scene.num_frames / scene.fps,
                "question": q.question,
                "candidates": opts,
                "answer": q.answer,
                "question_type": stem.split("_", 1)[1],
            }
        )
    (out / "json").mkdir(parents=True, exist_ok=True)
    for stem, items in entries.items():
        (out / "json" / f"{stem}.json").write_text(json.dumps(items, indent=1))


def write_vstar(out: Path, n_images: int) -> None:
    lines = []
    for category, kind, seed0 in (("direct_attributes", "color", 100), ("relative_position", "quadrant", 200)):
        for i, (scene, q, opts, letter) in enumerate(image_questions(n_images, (672, 378), (kind,), seed0)):
            image = f"{category}/sa_{seed0 + i}.jpg"
            (out / category).mkdir(parents=True, exist_ok=True)
            Image.fromarray(render_scene(scene)).save(out / image, quality=95)
            options = "\n".join(f"({a}) {o}" for a, o in zip(LETTERS, opts))
            text = f"{q.question}\n{options}\nAnswer with the option's letter from the given choices directly."
            lines.append(
                {"image": image, "text": text, "category": category, "question_id": len(lines), "label": letter}
            )
    (out / "test_questions.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def write_hrbench(out: Path, n_images: int) -> None:
    import pandas as pd

    sizes = {"4k": (896, 504), "8k": (1120, 630)}  # miniatures: the same task in a smaller haystack
    out.mkdir(parents=True, exist_ok=True)
    for resolution, size in sizes.items():
        rows = []
        for category, kinds, seed0 in (("single", ("color",), 300), ("cross", ("count",), 400)):
            for scene, q, opts, letter in image_questions(n_images, size, kinds, seed0 + len(rows)):
                buffer = io.BytesIO()
                Image.fromarray(render_scene(scene)).save(buffer, format="JPEG", quality=95)
                rows.append(
                    {
                        "index": len(rows),
                        "question": q.question,
                        "answer": letter,
                        "category": category,
                        "cycle_category": str(len(rows) % 2),
                        **dict(zip(LETTERS, opts)),
                        "image": base64.b64encode(buffer.getvalue()).decode(),
                    }
                )
        pd.DataFrame(rows).to_parquet(out / f"hr_bench_{resolution}.parquet")


def write_all(out: Path, n_videos: int = 2, n_images: int = 2) -> None:
    write_videomme(out / "videomme", n_videos)
    write_mlvu(out / "mlvu", n_videos)
    write_vstar(out / "vstar", n_images)
    write_hrbench(out / "hrbench", n_images)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder to write videomme/, mlvu/, vstar/ and hrbench/ into")
    parser.add_argument("--videos", type=int, default=2, help="videos per video benchmark (two questions each)")
    parser.add_argument("--images", type=int, default=2, help="images per category of the image benchmarks")
    args = parser.parse_args(argv)
    write_all(args.out, args.videos, args.images)
    print(f"wrote miniature Video-MME, MLVU, V*Bench and HR-Bench under {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
