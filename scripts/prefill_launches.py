"""Operations a whole prefill dispatches: transformers' `generate` against VisualKV's methods, same input.

Usage: python scripts/prefill_launches.py OUT.json [--shape shape-qwen2.5-vl-7b|shape-smolvlm2-2.2b]
  [--image 1920x1080] [--methods full,blockwise-keydiff,...] [--budget 1024] [--vision-ahead N] [--video FRAMES]
  [--text-width 512] [--vision-width 128] [--heads 4] [--kv-heads 2]
  (SmolVLM2 has no GQA: the committed SmolVLM runs pass --kv-heads 4, as many KV heads as heads)

--vision-ahead N adds, for each block-wise method, its hybrid plan with N blocks' media per vision-tower call
(`SessionConfig.vision_ahead`), beside the one call per block.

A GPU that is launch-bound spends its time on the number of kernels launched and on host synchronisations,
not on arithmetic (a profile: a block-wise 4K prefill made 51,179 launches and 3,105 syncs, and the GPU idled
two thirds of the time). Both numbers depend on the model's structure and the input, not on its widths, so
they can be counted on a CPU: the model here has the released depths and layer structure (LLM layers, vision
blocks, windows, full-attention blocks, GQA) with narrow widths (`--text-width`, `--vision-width`; head_dim kept
at the released value where rotary sections need it). Qwen2.5-VL and SmolVLM2 shapes; the vision tower counted
is Qwen's `visual` (its patch merger inside), SmolVLM's SigLIP `vision_model` and its connector. Each case runs
until the first answer token (the TTFT path: processor, vision tower, prefill, logits), counting dispatched ATen
operations (`OpCounter`: host time), those that launch a kernel on a GPU (all but views; split into the vision
tower, the decoder layers and the rest: the method's scoring and eviction, embeddings, processor) and attention
calls, in one process, the model built once.
Host reads are not counted here: on a CPU the engine's deliberate host-side planning (token indices, masks,
block plans) cannot be told from reads of device values; tests/test_sync_free.py checks the latter per method.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

from visualkv.bench.launches import OpCounter
from visualkv.models.base import ModelAdapter

PROMPT = "Describe what you see in detail."


def model_structure(adapter: ModelAdapter, heads: int, kv_heads: int) -> dict[str, int]:
    """What the counts depend on: the depths, the narrow widths and the heads the model was built with."""
    cfg = adapter.model.config
    return {
        "text_layers": cfg.text_config.num_hidden_layers,
        "vision_blocks": getattr(cfg.vision_config, "depth", None) or cfg.vision_config.num_hidden_layers,
        "text_width": cfg.text_config.hidden_size,
        "vision_width": cfg.vision_config.hidden_size,
        "heads": heads,
        "kv_heads": kv_heads,
    }


def _narrow_adapter(shape: str, text_width: int, vision_width: int, heads: int, kv_heads: int):
    from visualkv.models.registry import _adapter
    from visualkv.models.synthetic.shapes import _model_class, build_shape_config, build_shape_processor, shape_spec

    processor = build_shape_processor(shape)
    cfg = build_shape_config(shape, processor)
    text, vision = cfg.text_config, cfg.vision_config
    head_dim = text.hidden_size // text.num_attention_heads  # rotary sections need the released head_dim
    text.num_attention_heads, text.num_key_value_heads = heads, kv_heads
    text.intermediate_size = text.intermediate_size * text_width // text.hidden_size
    text.hidden_size = text_width if text_width % heads == 0 else heads * head_dim
    if text.hidden_size // heads != head_dim:
        text.head_dim = head_dim
    vision.intermediate_size = max(8, vision.intermediate_size * vision_width // vision.hidden_size)
    vision.hidden_size = vision_width
    if hasattr(vision, "out_hidden_size"):
        vision.out_hidden_size = text.hidden_size
    torch.manual_seed(0)
    model = _model_class(shape_spec(shape))._from_config(cfg, dtype=torch.float32).eval()
    gen = model.generation_config
    tok = processor.tokenizer
    if shape_spec(shape).family == "smolvlm":  # the tokenizer's own ids, as build_shape sets them
        gen.bos_token_id, gen.eos_token_id, gen.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    else:  # the Qwen chat tokens
        end = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
        gen.bos_token_id, gen.eos_token_id, gen.pad_token_id = end[1], end, end[1]
    gen.do_sample = False
    return _adapter(model, processor, f"{shape} (narrow)")


def _tower(adapter) -> torch.nn.Module:
    """The vision tower: Qwen's `visual` (its patch merger inside), SmolVLM's SigLIP `vision_model`."""
    return adapter.visual if hasattr(adapter, "visual") else adapter.model.model.vision_model


def _tower_modules(adapter) -> list[torch.nn.Module]:
    """What counts as the vision tower: Qwen's `visual`; SmolVLM's SigLIP and its connector (pixel shuffle and
    projection, the counterpart of the merger inside Qwen's `visual`)."""
    if hasattr(adapter, "visual"):
        return [adapter.visual]
    return [_tower(adapter), adapter.model.model.connector]


def _generate(adapter, media) -> None:
    import numpy as np
    from PIL import Image

    from visualkv.models.base import video_metadata

    with torch.no_grad():  # the model as users get it: VisualKV changes it only inside its sessions' turns
        text = adapter.chat_text(media, PROMPT)
        if media.kind == "image" and adapter.family == "smolvlm":  # one list of images per prompt
            enc = adapter.processor(text=[text], images=[[Image.fromarray(media.frames[0])]], return_tensors="pt")
        elif media.kind == "image":
            enc = adapter.processor(text=[text], images=[Image.fromarray(media.frames[0])], return_tensors="pt")
        else:  # as bench gpu's reference: every frame stacked, one processor call
            enc = adapter.processor(
                text=[text],
                videos=[np.stack(list(media.frames))],
                video_metadata=[video_metadata(media)],
                do_sample_frames=False,
                return_tensors="pt",
            )
        adapter.model.generate(**enc, max_new_tokens=1, do_sample=False)


def _ours(adapter, media, method: str, budget: int, prefill: str | None, vision_ahead: int = 1) -> dict:
    from visualkv.methods import method_traits
    from visualkv.runtime.session import ChatSession, SessionConfig

    config = SessionConfig(
        method=method,
        budget=budget if method_traits(method).needs_budget else None,
        prefill=prefill,
        max_new_tokens=1,
        vision_ahead=vision_ahead,
    )
    session = ChatSession(adapter, config)
    counts = _counted(adapter, lambda: session.ask(PROMPT, media))
    report = session.report()  # after the count: the app's turn report is not on the way to the first token
    return {
        "blocks": len(report["blocks"]),
        "prefill": report["prefill"],
        "visual_tokens": report["visual_tokens"],
        "vision_ahead": vision_ahead,
    } | counts


def _counted(adapter, fn) -> dict:
    ops = OpCounter()
    with (
        ops.count_inside(_tower_modules(adapter), "vision tower"),
        ops.count_inside(adapter.layers, "decoder layers"),
        ops,
    ):
        fn()
    parts = {part: ops.kernels_by_part[part] for part in ("vision tower", "decoder layers", "rest")}
    return {"ops": ops.ops, "kernels": ops.kernels, "kernels_by_part": parts, "attention_calls": ops.attention}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--shape", default="shape-qwen2.5-vl-7b")
    p.add_argument("--image", default="1920x1080")
    p.add_argument("--methods", default="full,blockwise-keydiff,blockwise-snapkv,salicache,lightkv")
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--text-width", type=int, default=512)
    p.add_argument("--vision-width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vision-ahead", type=int, default=1)
    p.add_argument("--video", type=int, default=0, help="a synthetic 640x360 video of this many frames instead")
    args = p.parse_args()

    from visualkv.bench.provenance import save_json, start
    from visualkv.bench.synthetic import image_media, video_media

    prov = start()
    prov["command"] = "python scripts/prefill_launches.py " + " ".join(sys.argv[1:])
    torch.set_num_threads(1)
    adapter = _narrow_adapter(args.shape, args.text_width, args.vision_width, args.heads, args.kv_heads)
    w, h = (int(x) for x in args.image.split("x"))
    media = video_media(args.video, 640, 360, seed=1) if args.video else image_media(w, h, seed=1)
    rows = []
    counts = _counted(adapter, lambda: _generate(adapter, media))
    rows.append({"case": "transformers generate", **counts})
    print(f"{'transformers generate':34s} {counts}")
    for method in args.methods.split(","):
        variants = [("hybrid", 1), ("blockwise", 1)] if method.startswith("blockwise") else [(None, 1)]
        if method.startswith("blockwise") and args.vision_ahead > 1:
            variants.append(("hybrid", args.vision_ahead))
        for prefill, ahead in variants:
            row = _ours(adapter, media, method, args.budget, prefill, ahead)
            rows.append({"case": method, **row})
            print(f"{method + ' ' + str(row['prefill']):34s} {row}")
    out = {
        "shape": args.shape,
        "image": args.image if not args.video else None,
        "video_frames": args.video or None,
        "budget": args.budget,
        "structure": model_structure(adapter, args.heads, args.kv_heads),
        "torch_threads": 1,
        "rows": rows,
    }
    save_json(out, args.out, prov)


if __name__ == "__main__":
    main()
