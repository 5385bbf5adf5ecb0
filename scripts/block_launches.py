"""Kernel launches and host reads per prefill block, for 2, 4 and 8 blocks: they must not grow with the blocks.

Usage: python scripts/block_launches.py OUT.json [--shape shape-qwen2.5-vl-7b] [--methods blockwise-keydiff,...]
  [--blocks 2,4,8] [--frame-size 224x168] [--text-width 512] [--vision-width 128] [--heads 4] [--kv-heads 2]

A synthetic video of one temporal patch per block (2 frames each), block size and budget M both one temporal
patch's tokens, so every block after the first evicts as much as it adds: the blocks are alike and a cost that
grows with the cache or the number of blocks before shows as a count that differs between later blocks or
between videos. The model has the released depths and layer structure at narrow widths (as in
scripts/prefill_launches.py): the counts depend on the structure and the input, not on the widths.
`visualkv.bench.launches.counting_blocks` counts per block, on CPU: ATen operations that launch a GPU kernel in
the vision tower, in the rest of the block's embeddings and in the layer loop (decoder layers with the method's
scoring and eviction), the tower's attention calls, and host reads of tensor values inside the tower and the
layer loop (a GPU sync each; the block's host-side plan is counted apart). tests/test_launch_counts.py checks
the same on the tiny models.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

from scripts.prefill_launches import _narrow_adapter, model_structure
from visualkv.bench.launches import counting_blocks

PROMPT = "Describe what you see in detail."


def _per_block(adapter, method: str, frames: int, size: tuple[int, int]) -> tuple[list[dict], int]:
    """Counts of the blocks holding media (dicts of `BlockCount`) and the tokens per block."""
    from visualkv.bench.synthetic import video_media
    from visualkv.runtime.session import ChatSession, SessionConfig

    media = video_media(frames, *size, fps=1.0, seed=2)
    unit = adapter.prepare(media, PROMPT).layout.units[0]
    tokens = unit.seq_end - unit.seq_start  # one temporal patch per block
    session = ChatSession(adapter, SessionConfig(method=method, budget=tokens, block_size=tokens, max_new_tokens=1))
    with counting_blocks(session.engine) as counts:
        session.ask(PROMPT, media)
    return [dataclasses.asdict(c) for c in counts if c.visual_tokens], tokens


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--shape", default="shape-qwen2.5-vl-7b")
    p.add_argument("--methods", default="blockwise-keydiff,blockwise-snapkv")
    p.add_argument("--blocks", default="2,4,8")
    p.add_argument("--frame-size", default="224x168")
    p.add_argument("--text-width", type=int, default=512)
    p.add_argument("--vision-width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    args = p.parse_args()

    from visualkv.bench.provenance import save_json, start

    prov = start()
    prov["command"] = "python scripts/block_launches.py " + " ".join(sys.argv[1:])
    torch.set_num_threads(1)
    adapter = _narrow_adapter(args.shape, args.text_width, args.vision_width, args.heads, args.kv_heads)
    size = tuple(int(x) for x in args.frame_size.split("x"))
    rows, tokens = [], 0
    for method in args.methods.split(","):
        _per_block(adapter, method, 2, size)  # a first call sets up lazily what later calls reuse
        for n in (int(x) for x in args.blocks.split(",")):
            blocks, tokens = _per_block(adapter, method, 2 * n, size)
            rows.append({"method": method, "blocks": n, "per_block": blocks})
            print(method, n, [(b["vision_kernels"], b["layer_kernels"], b["vision_reads"]) for b in blocks])
    out = {
        "shape": args.shape,
        "video": {"frame_size": args.frame_size, "frames_per_block": 2, "tokens_per_block": tokens},
        "budget": tokens,
        "structure": model_structure(adapter, args.heads, args.kv_heads),
        "torch_threads": 1,
        "rows": rows,
    }
    save_json(out, args.out, prov)


if __name__ == "__main__":
    main()
