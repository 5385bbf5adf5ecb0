"""Final KV bytes of a composed pipeline vs its block-wise method alone, at the same budgets M.

Usage: python scripts/compose_ratio.py OUT.json [--model tiny-qwen2.5-vl] [--fractions 0.25,0.5,1]
  [--tiers 0.43,0.10,0.29] [--method blockwise-keydiff]

On the example video (assets/example_video.webm, 64 s sampled at 1 fps), one process, one input: for each
M (a fraction of the visual tokens) it runs `--method` alone and `--method` with Sali-Cache stacked
(frame skipping at the default flow threshold and the given tiers), and records final and peak KV
bytes, the visual entries held per tier, and the ratio composed / alone. Memory figures are exact
(bytes of the tensors held), so the machine's load does not matter.
"""

from __future__ import annotations

import argparse
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "assets" / "example_video.webm"
PROMPT = "What happens in the video?"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--model", default="tiny-qwen2.5-vl")
    p.add_argument("--method", default="blockwise-keydiff")
    p.add_argument("--fractions", default="0.25,0.5,1")
    p.add_argument("--tiers", default="0.43,0.10,0.29")
    args = p.parse_args()

    import sys

    from visualkv.bench.provenance import save_json, start
    from visualkv.cli.stacking import stacked_method
    from visualkv.media import FrameSampling, load_media
    from visualkv.models.registry import load_model
    from visualkv.runtime.session import ChatSession, SessionConfig

    prov = start()
    prov["command"] = "python scripts/compose_ratio.py " + " ".join(sys.argv[1:])
    adapter = load_model(args.model)
    media = load_media(EXAMPLE, sampling=FrameSampling(fps=1.0, max_frames=64))
    n_visual = adapter.prepare(media, PROMPT).layout.n_visual
    composed, options = stacked_method(args.method, skip_frames=True, tiers=args.tiers)
    rows = []
    for fraction in (float(f) for f in args.fractions.split(",")):
        budget = max(1, round(fraction * n_visual))
        row = {"fraction": fraction, "budget": budget}
        for key, method, opts in (("alone", args.method, {}), ("composed", composed, options)):
            session = ChatSession(
                adapter, SessionConfig(method=method, budget=budget, max_new_tokens=1, method_options=opts)
            )
            session.ask(PROMPT, media)
            report = session.report()
            held = [layer.visual_by_tier() for layer in session.cache.layers]
            row[key] = {
                "method": method,
                "final_kv_bytes": report["final_kv_bytes"],
                "peak_kv_bytes": report["peak_kv_bytes"],
                "full_kv_bytes": report["full_kv_bytes"],
                "visual_entries_by_tier_layer0": {str(t): n for t, n in held[0].items()},
                "tiers": report.get("tiers"),
                "kv_bytes_by_tier": report.get("kv_bytes_by_tier"),
            }
        row["final_ratio"] = row["composed"]["final_kv_bytes"] / row["alone"]["final_kv_bytes"]
        row["peak_ratio"] = row["composed"]["peak_kv_bytes"] / row["alone"]["peak_kv_bytes"]
        print(
            f"M={budget:6d} ({fraction:.0%} of {n_visual}): final {row['alone']['final_kv_bytes']:>10d} alone, "
            f"{row['composed']['final_kv_bytes']:>10d} composed, ratio {row['final_ratio']:.3f} "
            f"(peak ratio {row['peak_ratio']:.3f})"
        )
        rows.append(row)
    out = {
        "model": args.model,
        "media": "assets/example_video.webm (1 fps, 64 frames)",
        "visual_tokens": n_visual,
        "method": args.method,
        "composed": composed,
        "composed_options": options,
        "rows": rows,
    }
    save_json(out, args.out, prov)


if __name__ == "__main__":
    main()
