"""Train the bundled offline demo model ``visualkv-demo`` on synthetic needle scenes.

    python scripts/train_demo.py --out assets/visualkv-demo [--steps 1200] [--seed 0]

A Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``, so every VisualKV method applies
unchanged) with a small vision tower (windowed attention only, so block-wise encoding is
exact) and a small LLM, trained from scratch on :mod:`visualkv.scenes` images (224-672 px wide)
and a few short videos, with a curriculum: images grow from 224 px to 672 px over the
first 40 % of the steps and distractors from none to full density over the first half.
Inputs go through the real chat template and the processor's own image / video pipeline,
exactly as :class:`visualkv.session.ChatSession` feeds them; each sample is a 2-6 turn conversation about one scene and only the answer tokens (plus the
closing ``<|im_end|>``) are supervised, plus three auxiliary losses that make a from-scratch
model learn retrieval within a CPU budget (without them, four runs of 600-1000 steps stayed at
chance on every image question):

* attention supervision (``--attn-weight``): in LLM layers >= 1, query heads 0-1 at the position
  that predicts an answer put their attention mass on the asked needle's visual tokens;
* colour-word targets at needle tokens (``--llm-aux``): each visual token covered by a needle
  predicts the first token of the needle's colour word;
* per-token shape / colour classification of the vision tower's output (``--aux-weight``), through
  two linear heads that are not part of the saved model.

Training uses eager attention (to read attention weights); the checkpoint loads with SDPA.

Deterministic for a fixed ``--seed`` and step count on one thread (``torch.set_num_threads(1)``);
the data are a pure function of the sample index (scene seeds >= ``TRAIN_SEED_OFFSET``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from visualkv.models.base import video_metadata
from visualkv.models.tiny import TinySpec, build_tiny_processor, qwen_config
from visualkv.scenes import (
    COLORS,
    SHAPE_CLASSES,
    TRAIN_SEED_OFFSET,
    cell_labels,
    make_scene,
    make_video_scene,
    render_scene,
    video_media,
)

# Model sizes of visualkv-demo.
DEMO_SIZES = {
    "text_hidden_size": 128,
    "text_num_layers": 4,
    "text_num_heads": 4,
    "text_num_kv_heads": 2,
    "text_intermediate_size": 384,
    "mrope_section": [4, 6, 6],  # sums to head_dim / 2 = 16
    "vision_hidden_size": 96,
    "vision_num_layers": 3,
    "vision_num_heads": 3,
    "vision_intermediate_size": 256,
}
KIND_WEIGHTS = {"color": 0.4, "quadrant": 0.2, "presence": 0.2, "count": 0.2, "when": 0.3}
TRAIN_WIDTHS = (224, 280, 336, 392, 448, 504, 560, 616, 672)
# Curriculum (fractions of the run): distractor density ramps 0 -> 1 over the first half; the largest
# allowed image width ramps 224 -> 672 px over the first 40 % (few visual tokens first, so that the
# needle is a visible part of an almost uniform attention average before attention learns to select it).
CURRICULUM_DENSITY = 0.5
CURRICULUM_SIZE = 0.4
TRAIN_ASPECTS = (16 / 9, 4 / 3, 1.0)
VIDEO_FRACTION = 0.12


# The same dimensions as a TinySpec, so the config comes from the one Qwen builder in tiny.py;
# windowed vision attention only (local features, exact strips) and a RoPE base of 10,000.
DEMO_SPEC = TinySpec(
    family="qwen2_5_vl",
    text_hidden_size=DEMO_SIZES["text_hidden_size"],
    text_num_layers=DEMO_SIZES["text_num_layers"],
    text_num_heads=DEMO_SIZES["text_num_heads"],
    text_num_kv_heads=DEMO_SIZES["text_num_kv_heads"],
    text_intermediate_size=DEMO_SIZES["text_intermediate_size"],
    vision_hidden_size=DEMO_SIZES["vision_hidden_size"],
    vision_num_layers=DEMO_SIZES["vision_num_layers"],
    vision_num_heads=DEMO_SIZES["vision_num_heads"],
    vision_intermediate_size=DEMO_SIZES["vision_intermediate_size"],
    mrope_section=tuple(DEMO_SIZES["mrope_section"]),
    fullatt_block_indexes=(),
    rope_theta=10000.0,
    description="visualkv-demo",
)


def demo_config(processor, attn_implementation: str = "sdpa") -> Qwen2_5_VLConfig:
    """Qwen2.5-VL config of the demo model (token ids from the local tokenizer)."""
    return qwen_config(DEMO_SPEC, processor, attn_implementation)


def pick_questions(questions, rng: np.random.Generator, n: int):
    """Up to n distinct questions, kinds drawn with KIND_WEIGHTS."""
    pool = list(questions)
    out = []
    while pool and len(out) < n:
        kinds = sorted({q.kind for q in pool})
        w = np.array([KIND_WEIGHTS[k] for k in kinds])
        kind = kinds[int(rng.choice(len(kinds), p=w / w.sum()))]
        cands = [q for q in pool if q.kind == kind]
        q = cands[int(rng.integers(len(cands)))]
        out.append(q)
        pool.remove(q)
    return out


def make_sample(index: int, processor, progress: float = 1.0, llm_aux: bool = True):
    """Model inputs + labels for training sample ``index`` (deterministic)."""
    seed = TRAIN_SEED_OFFSET + index
    rng = np.random.default_rng(seed + 7_777_777)
    tok = processor.tokenizer
    if rng.random() < VIDEO_FRACTION:
        side = int(rng.choice([224, 280]))
        video = make_video_scene(seed, (side, side))
        media, questions = video_media(video), video.questions
    else:
        density = min(1.0, progress / CURRICULUM_DENSITY)
        max_width = 224 + (672 - 224) * min(1.0, progress / CURRICULUM_SIZE)
        widths = [w for w in TRAIN_WIDTHS if w <= max_width + 1e-6]
        width = int(rng.choice(widths))
        aspect = float(rng.choice(TRAIN_ASPECTS)) if width >= 448 else 1.0
        scene = make_scene(seed, (width, round(width / aspect)), density=density)
        media, questions = None, scene.questions
        frame = render_scene(scene)
    qs = pick_questions(questions, rng, int(rng.integers(2, 7)))
    kind = "image" if media is None else "video"
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": qs[0].question}]}],
        add_generation_prompt=True, tokenize=False,
    )
    if kind == "image":
        enc = processor(text=[prompt], images=[frame], return_tensors="pt")
    else:
        enc = processor(text=[prompt], videos=[np.stack(media.frames)], video_metadata=[video_metadata(media)],
                        do_sample_frames=False, return_tensors="pt")
    aux = None
    if kind == "image":  # auxiliary per-visual-token targets (shape / needle colour of each 28 px cell)
        _, gh, gw = (int(x) for x in enc["image_grid_thw"][0])
        shape, color = cell_labels(scene, gh // 2, gw // 2)
        aux = (torch.from_numpy(shape).flatten(), torch.from_numpy(color).flatten())
    pieces = [enc["input_ids"][0]]
    labels = [torch.full_like(pieces[0], -100)]
    answer_starts = []
    for k, q in enumerate(qs):
        ans = torch.tensor(tok(q.answer, add_special_tokens=False)["input_ids"])
        answer_starts.append(sum(int(x.shape[0]) for x in pieces))
        pieces.append(ans)
        labels.append(ans.clone())
        if k + 1 < len(qs):
            nxt = f"<|im_end|>\n<|im_start|>user\n{qs[k + 1].question}<|im_end|>\n<|im_start|>assistant\n"
        else:
            nxt = "<|im_end|>"
        nid = torch.tensor(tok(nxt, add_special_tokens=False)["input_ids"])
        lab = torch.full_like(nid, -100)
        lab[0] = nid[0]  # the <|im_end|> that closes the answer
        pieces.append(nid)
        labels.append(lab)
    # HF shifts labels inside the loss: labels[i] is predicted from position i-1
    input_ids = torch.cat(pieces)[None]
    label_ids = torch.cat(labels)[None]
    if aux is not None and llm_aux:
        # Auxiliary LM targets at the visual tokens covered by a needle: the first token of the needle's
        # colour word, predicted from that token's own position (labels are shifted by one inside the
        # loss). It aligns needle tokens' states with the answer vocabulary, so the answer position only
        # has to learn *which* token to attend to.
        visual_pos = (input_ids[0] == processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")).nonzero().flatten()
        names = list(COLORS)
        first = torch.tensor([tok(n, add_special_tokens=False)["input_ids"][0] for n in names])
        needle_cells = (aux[1] > 0).nonzero().flatten()
        label_ids[0, visual_pos[needle_cells] + 1] = first[aux[1][needle_cells] - 1]
    attn_targets = []  # (query position, key positions): the answer's first prediction should look at the needle
    if aux is not None:
        visual_pos = (input_ids[0] == processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")).nonzero().flatten()
        for q, start in zip(qs, answer_starts):
            cells = (aux[0] == SHAPE_CLASSES.index(q.target)).nonzero().flatten()
            if q.kind in ("color", "quadrant", "presence", "count") and cells.numel():
                attn_targets.append((start - 1, visual_pos[cells]))
    inputs = {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask")}
    n_extra = input_ids.shape[1] - enc["input_ids"].shape[1]
    if "mm_token_type_ids" in inputs:
        inputs["mm_token_type_ids"] = torch.cat(
            [inputs["mm_token_type_ids"], torch.zeros(1, n_extra, dtype=inputs["mm_token_type_ids"].dtype)], 1)
    inputs.update(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), labels=label_ids)
    return inputs, [q.kind for q in qs], (aux, attn_targets)


def save(model, processor, out: str, meta: dict) -> None:
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    with open(os.path.join(out, "training.json"), "w") as f:
        json.dump(meta, f, indent=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="assets/visualkv-demo")
    ap.add_argument("--steps", type=int, default=1200, help="optimizer steps")
    ap.add_argument("--accum", type=int, default=4, help="samples per optimizer step")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--save-every", type=int, default=100)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--aux-weight", type=float, default=1.0, help="weight of the per-visual-token auxiliary loss")
    ap.add_argument("--attn-weight", type=float, default=1.0, help="weight of the attention supervision loss")
    ap.add_argument("--llm-aux", type=int, default=1, help="1: colour-word targets at needle tokens")
    ap.add_argument("--init", default=None, help="continue from this checkpoint folder instead of random weights")
    ap.add_argument("--curriculum-start", type=float, default=0.0,
                    help="curriculum progress at step 0 (1.0 = full-size, full-density scenes from the start)")
    ap.add_argument("--sample-offset", type=int, default=0, help="index of the first training sample")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    processor = build_tiny_processor("tiny-qwen2.5-vl")
    if args.init:
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(args.init, dtype=torch.float32,
                                                                   attn_implementation="eager")
    else:
        model = Qwen2_5_VLForConditionalGeneration(demo_config(processor, attn_implementation="eager"))
    tok = processor.tokenizer
    gen = model.generation_config
    gen.bos_token_id = tok.convert_tokens_to_ids("<|endoftext|>")
    gen.eos_token_id = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    gen.pad_token_id = tok.convert_tokens_to_ids("<|endoftext|>")
    gen.do_sample = False
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params / 1e6:.2f} M", flush=True)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.98))

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        frac = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))

    # Auxiliary heads on the vision tower's merged output (one row per visual token, raster order):
    # dense supervision that makes needle tokens distinctive early; discarded at save time.
    hidden = DEMO_SIZES["text_hidden_size"]
    aux_shape = torch.nn.Linear(hidden, len(SHAPE_CLASSES))
    aux_color = torch.nn.Linear(hidden, 1 + len(COLORS))
    w_shape = torch.tensor([0.2, 0.5, 0.5] + [3.0] * (len(SHAPE_CLASSES) - 3))
    w_color = torch.tensor([0.2] + [3.0] * len(COLORS))
    opt.add_param_group({"params": [*aux_shape.parameters(), *aux_color.parameters()], "weight_decay": 0.0})
    captured: dict[str, torch.Tensor] = {}

    def grab(_module, _inputs, output):
        captured["merged"] = output.pooler_output

    model.model.visual.register_forward_hook(grab)
    model.train()
    t0 = time.time()
    sample = args.sample_offset
    run_loss, run_n = 0.0, 0
    run_aux, run_aux_n = 0.0, 0
    run_att, run_att_n = 0.0, 0
    hits: dict[str, list[int]] = {}
    history = []
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        opt.zero_grad(set_to_none=True)
        for _ in range(args.accum):
            progress = args.curriculum_start + (1 - args.curriculum_start) * step / args.steps
            inputs, kinds, (aux, attn_targets) = make_sample(sample, processor, progress, args.llm_aux)
            sample += 1
            captured.clear()
            out = model(**inputs, output_attentions=bool(attn_targets and args.attn_weight > 0))
            loss = out.loss
            if attn_targets and args.attn_weight > 0:
                # Attention supervision: in layers >= 1, query heads 0-1 at the position that predicts the
                # answer put their mass on the asked needle's tokens (the other heads stay free).
                terms = []
                for att in out.attentions[1:]:  # (1, heads, L, L)
                    for qpos, keys in attn_targets:
                        mass = att[0, :2, qpos, keys].sum(-1).mean()
                        terms.append(-torch.log(mass + 1e-6))
                attn_loss = torch.stack(terms).mean()
                loss = loss + args.attn_weight * attn_loss
                run_att += float(attn_loss.detach())
                run_att_n += 1
            if aux is not None and args.aux_weight > 0:
                merged = captured["merged"]
                aux_loss = torch.nn.functional.cross_entropy(aux_shape(merged), aux[0], weight=w_shape) + \
                    torch.nn.functional.cross_entropy(aux_color(merged), aux[1], weight=w_color)
                loss = loss + args.aux_weight * aux_loss
                run_aux += float(aux_loss.detach())
                run_aux_n += 1
            (loss / args.accum).backward()
            run_loss += float(out.loss.detach())
            run_n += 1
            with torch.no_grad():  # teacher-forced exact match of each answer
                labels = inputs["labels"][0, 1:]
                pred = out.logits[0, :-1].argmax(-1)
                # answer tokens only: skip the auxiliary colour-word labels at visual tokens
                first_text = int(inputs["mm_token_type_ids"][0].nonzero().max()) + 1 if "mm_token_type_ids" in inputs \
                    else 0
                sup = [i for i in (labels != -100).nonzero().flatten().tolist() if i >= first_text]
                groups, cur = [], [sup[0]]
                for i in sup[1:]:
                    if i == cur[-1] + 1:
                        cur.append(i)
                    else:
                        groups.append(cur)
                        cur = [i]
                groups.append(cur)
                for kind, grp in zip(kinds, groups):
                    ok = bool((pred[grp] == labels[grp]).all())
                    hits.setdefault(kind, []).append(int(ok))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % args.log_every == 0 or step == args.steps - 1:
            acc = {k: round(sum(v) / len(v), 3) for k, v in sorted(hits.items())}
            rec = {"step": step + 1, "samples": sample, "loss": round(run_loss / run_n, 4),
                   "aux_loss": round(run_aux / max(run_aux_n, 1), 4),
                   "attn_loss": round(run_att / max(run_att_n, 1), 4), "lr": lr_at(step),
                   "seconds": round(time.time() - t0, 1), "tf_acc": acc}
            history.append(rec)
            print(json.dumps(rec), flush=True)
            run_loss, run_n, hits = 0.0, 0, {}
            run_aux, run_aux_n = 0.0, 0
            run_att, run_att_n = 0.0, 0
        if (step + 1) % args.save_every == 0 or step == args.steps - 1:
            model.eval()
            save(model, processor, args.out, {"args": vars(args), "sizes": DEMO_SIZES, "history": history,
                                              "params": n_params, "samples": sample,
                                              "seconds": round(time.time() - t0, 1), "done": step == args.steps - 1})
            model.train()
    print(f"done in {time.time() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
