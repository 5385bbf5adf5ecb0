"""Train the bundled offline demo model ``visualkv-demo`` on synthetic needle scenes.

    python scripts/train_demo.py --out assets/visualkv-demo [--steps 1200] [--seed 0]

A small Qwen2.5-VL (every VisualKV method applies unchanged; windowed vision attention only, so block-wise
encoding is exact) trained from scratch on :mod:`visualkv.bench.scenes` images and a few short videos, with a
curriculum on image size and distractor density. Inputs go through the real chat template and processor, as
`ChatSession` feeds them; only answer tokens are supervised, plus auxiliary losses that let a from-scratch
model learn retrieval within a CPU budget (without them answers stay at chance): attention supervision onto
the asked needle's tokens (``--attn-weight``), quadrant / time and count probes at the answer
(``--answer-aux``, ``--count-aux``), colour-word targets at needle tokens (``--llm-aux``) and per-token
classification of the tower's output (``--aux-weight``). The auxiliary heads are not saved. Training uses
eager attention (to read attention weights); the checkpoint loads with SDPA. Deterministic for a fixed
``--seed`` and step count on one thread.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from visualkv.bench.scenes import (
    COLORS,
    QUADRANTS,
    SHAPE_CLASSES,
    TRAIN_SEED_OFFSET,
    cell_labels,
    make_scene,
    make_video_scene,
    render_scene,
    video_media,
    video_third,
)
from visualkv.models.base import video_metadata
from visualkv.models.synthetic import qwen2_5_vl as qwen_builds
from visualkv.models.synthetic.specs import TinySpec
from visualkv.models.synthetic.tiny import build_tiny_processor

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
KIND_WEIGHTS = {"color": 0.4, "quadrant": 0.3, "presence": 0.2, "count": 0.2, "when": 0.3}
TRAIN_WIDTHS = (224, 280, 336, 392, 448, 504, 560, 616, 672)
# Curriculum (fractions of the run): distractor density ramps 0 -> 1 over the first half; the largest
# allowed image width ramps 224 -> 672 px over the first 40 % (few visual tokens first, so that the
# needle is a visible part of an almost uniform attention average before attention learns to select it).
CURRICULUM_DENSITY = 0.5
CURRICULUM_SIZE = 0.4
TRAIN_ASPECTS = (16 / 9, 4 / 3, 1.0)
VIDEO_FRACTION = 0.12
MULTI_PROB = 0.6  # chance that a training scene has one needle shape 2-3 times (make_scene's default: 0.3)
COUNT_MULTI_WEIGHT = 4.0


# The same dimensions as a TinySpec, so the config comes from the one Qwen2.5-VL builder;
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
    return qwen_builds.build_config(DEMO_SPEC, processor, attn_implementation)


def pick_questions(questions, rng: np.random.Generator, n: int, count_multi_weight: float = COUNT_MULTI_WEIGHT):
    """Up to n distinct questions, kinds drawn with KIND_WEIGHTS; counts of 2-3 weighted up."""
    pool = list(questions)
    out = []
    while pool and len(out) < n:
        kinds = sorted({q.kind for q in pool})
        w = np.array([KIND_WEIGHTS[k] for k in kinds])
        kind = kinds[int(rng.choice(len(kinds), p=w / w.sum()))]
        cands = [q for q in pool if q.kind == kind]
        if count_multi_weight == 1.0:  # uniform (the draw of runs before the weight existed)
            q = cands[int(rng.integers(len(cands)))]
        else:  # counts of 2-3 are rare among the (mostly 0 / 1) count questions: ask them more often
            w = np.array([count_multi_weight if q.kind == "count" and q.answer in ("2", "3") else 1.0 for q in cands])
            q = cands[int(rng.choice(len(cands), p=w / w.sum()))]
        out.append(q)
        pool.remove(q)
    return out


@dataclass(frozen=True)
class SampleOptions:
    """What a training sample holds and which auxiliary targets it carries (defaults: the latest phase)."""

    llm_aux: bool = True  # colour-word targets at needle tokens
    attn_all_positions: bool = True  # attention targets at every answer position, not only the first
    multi_prob: float = MULTI_PROB
    count_multi_weight: float = COUNT_MULTI_WEIGHT
    video_fraction: float = VIDEO_FRACTION
    video_time_cue: bool = True  # videos whose stripes mark the third (make_video_scene(time_cue=True))


def make_sample(index: int, processor, progress: float = 1.0, opts: SampleOptions = SampleOptions()):
    """Model inputs + labels for training sample ``index`` (deterministic)."""
    seed = TRAIN_SEED_OFFSET + index
    rng = np.random.default_rng(seed + 7_777_777)
    tok = processor.tokenizer
    llm_aux, attn_all_positions = opts.llm_aux, opts.attn_all_positions
    video = None
    if rng.random() < opts.video_fraction:
        side = int(rng.choice([224, 280]))
        video = make_video_scene(seed, (side, side), time_cue=opts.video_time_cue)
        media, questions = video_media(video), video.questions
    else:
        density = min(1.0, progress / CURRICULUM_DENSITY)
        max_width = 224 + (672 - 224) * min(1.0, progress / CURRICULUM_SIZE)
        widths = [w for w in TRAIN_WIDTHS if w <= max_width + 1e-6]
        width = int(rng.choice(widths))
        aspect = float(rng.choice(TRAIN_ASPECTS)) if width >= 448 else 1.0
        scene = make_scene(seed, (width, round(width / aspect)), density=density, multi_prob=opts.multi_prob)
        media, questions = None, scene.questions
        frame = render_scene(scene)
    qs = pick_questions(questions, rng, int(rng.integers(2, 7)), opts.count_multi_weight)
    kind = "image" if media is None else "video"
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": qs[0].question}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    if kind == "image":
        enc = processor(text=[prompt], images=[frame], return_tensors="pt")
    else:
        enc = processor(
            text=[prompt],
            videos=[np.stack(media.frames)],
            video_metadata=[video_metadata(media)],
            do_sample_frames=False,
            return_tensors="pt",
        )
    aux = None
    if kind == "image":  # auxiliary per-visual-token targets (shape / needle colour of each 28 px cell)
        _, gh, gw = (int(x) for x in enc["image_grid_thw"][0])
        shape, color = cell_labels(scene, gh // 2, gw // 2)
        aux = (
            torch.from_numpy(shape).flatten(),
            torch.from_numpy(color).flatten(),
            cell_quadrants(gh // 2, gw // 2).flatten(),
        )
    pieces = [enc["input_ids"][0]]
    labels = [torch.full_like(pieces[0], -100)]
    answer_starts, answer_lengths = [], []
    for k, q in enumerate(qs):
        ans = torch.tensor(tok(q.answer, add_special_tokens=False)["input_ids"])
        answer_starts.append(sum(int(x.shape[0]) for x in pieces))
        answer_lengths.append(int(ans.shape[0]))
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

    def positions(token: str) -> torch.Tensor:
        return (input_ids[0] == tok.convert_tokens_to_ids(token)).nonzero().flatten()

    visual_pos = positions("<|image_pad|>")
    sink = int(positions("<|vision_start|>")[0])
    if aux is not None and llm_aux:
        # Auxiliary LM targets at the visual tokens covered by a needle: the first token of the needle's
        # colour word, predicted from that token's own position (labels are shifted by one inside the
        # loss). It aligns needle tokens' states with the answer vocabulary, so the answer position only
        # has to learn *which* token to attend to.
        names = list(COLORS)
        first = torch.tensor([tok(n, add_special_tokens=False)["input_ids"][0] for n in names])
        needle_cells = (aux[1] > 0).nonzero().flatten()
        label_ids[0, visual_pos[needle_cells] + 1] = first[aux[1][needle_cells] - 1]
    # Attention targets at the positions that predict each answer's tokens:
    # (query position, needle key positions, sink position, number of needles asked about).
    # Heads 0-1 look at the asked needle, or at the sink (<|vision_start|>) when it is absent; head 2
    # (count questions) splits its mass 1 : n between the sink and the n needles, so the sink's share
    # says how many there are.
    attn_targets = []
    quadrant_targets, count_targets = [], []  # (position, QUADRANTS index / count) at quadrant / count answers
    if aux is not None:
        for q, start, length in zip(qs, answer_starts, answer_lengths):
            if q.kind not in ("color", "quadrant", "presence", "count"):
                continue
            cells = (aux[0] == SHAPE_CLASSES.index(q.target)).nonzero().flatten()
            n = scene.count(q.target) if cells.numel() else 0
            attn_targets.append((start - 1, visual_pos[cells], sink, n if q.kind == "count" else -1))
            # every later position that predicts an answer token looks again ("top" -> "left" / "right")
            for qpos in range(start, start + length - 1 if attn_all_positions else start):
                attn_targets.append((qpos, visual_pos[cells], sink, -1))
            if q.kind == "quadrant":
                quadrant_targets += [(qpos, QUADRANTS.index(q.answer)) for qpos in range(start - 1, start + length - 1)]
            elif q.kind == "count":
                count_targets.append((start - 1, int(q.answer)))
    video_aux, when_targets = None, []  # per-token third of the video; (position, third) at "when" answers
    if video is not None and opts.video_time_cue:
        t, gh, gw = (int(x) for x in enc["video_grid_thw"][0])
        rows, cols = gh // 2, gw // 2
        video_aux = torch.tensor([video_third(2 * p, video.num_frames) for p in range(t)]).repeat_interleave(
            rows * cols
        )
        x0, y0, x1, y1 = video.needle.box
        sx, sy = cols / video.width, rows / video.height  # pixels -> cells
        r = torch.arange(max(0, int(y0 * sy)), min(rows, int((y1 - 1) * sy) + 1))
        c = torch.arange(max(0, int(x0 * sx)), min(cols, int((x1 - 1) * sx) + 1))
        cells = (r[:, None] * cols + c[None, :]).flatten()
        patches = torch.arange(video.visible[0] // 2, (video.visible[1] - 1) // 2 + 1)
        needle_tokens = (patches[:, None] * rows * cols + cells[None, :]).flatten()
        video_pos = positions("<|video_pad|>")
        for q, start, length in zip(qs, answer_starts, answer_lengths):
            present = q.target == video.needle.shape
            keys = video_pos[needle_tokens] if present else video_pos[:0]
            for qpos in range(start - 1, start + length - 1 if attn_all_positions else start):
                attn_targets.append((qpos, keys, sink, -1))
            if q.kind == "when":
                when_targets += [
                    (qpos, ("start", "middle", "end").index(q.answer)) for qpos in range(start - 1, start + length - 1)
                ]
    inputs = {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask")}
    n_extra = input_ids.shape[1] - enc["input_ids"].shape[1]
    if "mm_token_type_ids" in inputs:
        inputs["mm_token_type_ids"] = torch.cat(
            [inputs["mm_token_type_ids"], torch.zeros(1, n_extra, dtype=inputs["mm_token_type_ids"].dtype)], 1
        )
    inputs.update(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), labels=label_ids)
    targets = {
        "aux": aux,
        "video_aux": video_aux,
        "attn": attn_targets,
        "quadrant": quadrant_targets,
        "count": count_targets,
        "when": when_targets,
    }
    return inputs, [q.kind for q in qs], targets


def cell_quadrants(rows: int, cols: int) -> torch.Tensor:
    """Quadrant index (QUADRANTS order) of each cell centre of a rows x cols grid."""
    bottom = (torch.arange(rows) + 0.5 >= rows / 2).long()[:, None]
    right = (torch.arange(cols) + 0.5 >= cols / 2).long()[None, :]
    return 2 * bottom + right


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
    ap.add_argument(
        "--attn-all-positions",
        type=int,
        default=1,
        help="1: attention supervision at every position that predicts an answer token, 0: the first only",
    )
    ap.add_argument(
        "--quadrant-needle-weight",
        type=float,
        default=3.0,
        help="weight of needle cells in the per-token quadrant loss (their own pixels hide the cue)",
    )
    ap.add_argument(
        "--answer-aux",
        type=float,
        default=1.0,
        help="weight of the quadrant and video-'when' probes on the attention output at those answers (0: off)",
    )
    ap.add_argument(
        "--count-aux",
        type=float,
        default=1.0,
        help="weight of the count probe on the attention output at count answers (0: off)",
    )
    ap.add_argument(
        "--multi-prob",
        type=float,
        default=MULTI_PROB,
        help="chance that a training scene has one needle shape 2-3 times",
    )
    ap.add_argument(
        "--count-multi-weight",
        type=float,
        default=COUNT_MULTI_WEIGHT,
        help="how much more often a count question with answer 2-3 is asked (1: uniform)",
    )
    ap.add_argument("--video-fraction", type=float, default=VIDEO_FRACTION, help="share of video samples")
    ap.add_argument(
        "--video-time-cue",
        type=int,
        default=1,
        help="1: training videos mark each third with the stripes' period (0: the videos of phases 1-4)",
    )
    ap.add_argument(
        "--stop-at",
        type=int,
        default=None,
        help="stop (and save) after this many steps, keeping the learning-rate schedule of --steps",
    )
    ap.add_argument(
        "--count-heads",
        type=int,
        default=1,
        help="1: head 2 at a count answer splits its attention 1 : n between the sink and the needles",
    )
    ap.add_argument("--init", default=None, help="continue from this checkpoint folder instead of random weights")
    ap.add_argument(
        "--curriculum-start",
        type=float,
        default=0.0,
        help="curriculum progress at step 0 (1.0 = full-size, full-density scenes from the start)",
    )
    ap.add_argument("--sample-offset", type=int, default=0, help="index of the first training sample")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    sample_opts = SampleOptions(
        llm_aux=bool(args.llm_aux),
        attn_all_positions=bool(args.attn_all_positions),
        multi_prob=args.multi_prob,
        count_multi_weight=args.count_multi_weight,
        video_fraction=args.video_fraction,
        video_time_cue=bool(args.video_time_cue),
    )
    torch.manual_seed(args.seed)
    processor = build_tiny_processor("tiny-qwen2.5-vl")
    if args.init:
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            args.init, dtype=torch.float32, attn_implementation="eager"
        )
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
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.98),
    )

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
    aux_quadrant = torch.nn.Linear(hidden, len(QUADRANTS))
    aux_time = torch.nn.Linear(hidden, 3)  # video tokens: start / middle / end third
    w_shape = torch.tensor([0.2, 0.5, 0.5] + [3.0] * (len(SHAPE_CLASSES) - 3))
    w_color = torch.tensor([0.2] + [3.0] * len(COLORS))
    aux_heads = [*aux_shape.parameters(), *aux_color.parameters(), *aux_quadrant.parameters(), *aux_time.parameters()]
    opt.add_param_group({"params": aux_heads, "weight_decay": 0.0})
    captured: dict[str, torch.Tensor] = {}

    def grab(_module, _inputs, output):
        captured["merged"] = output.pooler_output

    model.model.visual.register_forward_hook(grab)

    # Answer-side quadrant probe: the attention output (after o_proj) of layers >= 1 at a quadrant answer's
    # positions must predict the quadrant. Without it the needle tokens carried the quadrant (linearly
    # decodable from their states) but the answer position, attending to them, did not pick it up.
    llm_layers = model.model.language_model.layers
    quadrant_probe = torch.nn.ModuleList(torch.nn.Linear(hidden, len(QUADRANTS)) for _ in llm_layers[1:])
    count_probe = torch.nn.ModuleList(torch.nn.Linear(hidden, 4) for _ in llm_layers[1:])  # the same for counts 0-3
    when_probe = torch.nn.ModuleList(torch.nn.Linear(hidden, 3) for _ in llm_layers[1:])  # and video thirds
    opt.add_param_group(
        {
            "params": [*quadrant_probe.parameters(), *count_probe.parameters(), *when_probe.parameters()],
            "weight_decay": 0.0,
        }
    )

    def grab_attn(index):
        def hook(_module, _inputs, output):
            captured[f"attn{index}"] = output[0]

        return hook

    for i, layer in enumerate(llm_layers[1:]):
        layer.self_attn.register_forward_hook(grab_attn(i))
    model.train()
    t0 = time.time()
    sample = args.sample_offset
    run_loss, run_n = 0.0, 0
    run_aux, run_aux_n = 0.0, 0
    run_att, run_att_n = 0.0, 0
    run_ans, run_ans_n = 0.0, 0
    hits: dict[str, list[int]] = {}
    history = []
    for step in range(args.steps if args.stop_at is None else min(args.steps, args.stop_at)):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        opt.zero_grad(set_to_none=True)
        for _ in range(args.accum):
            progress = args.curriculum_start + (1 - args.curriculum_start) * step / args.steps
            inputs, kinds, targets = make_sample(sample, processor, progress, sample_opts)
            aux, attn_targets = targets["aux"], targets["attn"]
            sample += 1
            captured.clear()
            out = model(**inputs, output_attentions=bool(attn_targets and args.attn_weight > 0))
            loss = out.loss
            if attn_targets and args.attn_weight > 0:
                # Attention supervision: in layers >= 1, query heads 0-1 at the position that predicts the
                # answer put their mass on the asked needle's tokens (the other heads stay free).
                terms = []
                for att in out.attentions[1:]:  # (1, heads, L, L)
                    for qpos, keys, sink, n in attn_targets:
                        if keys.numel():
                            mass = att[0, :2, qpos, keys].sum(-1).mean()
                        else:
                            mass = att[0, :2, qpos, sink].mean()
                        terms.append(-torch.log(mass + 1e-6))
                        if n >= 0 and args.count_heads:  # head 2: sink share 1 / (1 + n)
                            p_sink = att[0, 2, qpos, sink]
                            terms.append(
                                -(
                                    torch.log(p_sink + 1e-6)
                                    + (n * torch.log(att[0, 2, qpos, keys].sum() + 1e-6) if n else 0.0)
                                )
                                / (1 + n)
                            )
                attn_loss = torch.stack(terms).mean()
                loss = loss + args.attn_weight * attn_loss
                run_att += float(attn_loss.detach())
                run_att_n += 1
            if aux is not None and args.aux_weight > 0:
                merged = captured["merged"]
                aux_loss = (
                    torch.nn.functional.cross_entropy(aux_shape(merged), aux[0], weight=w_shape)
                    + torch.nn.functional.cross_entropy(aux_color(merged), aux[1], weight=w_color)
                    + (
                        torch.nn.functional.cross_entropy(aux_quadrant(merged), aux[2], reduction="none")
                        * (1 + (args.quadrant_needle_weight - 1) * (aux[0] >= 3))
                    ).mean()
                )
                loss = loss + args.aux_weight * aux_loss
                run_aux += float(aux_loss.detach())
                run_aux_n += 1
            if targets["video_aux"] is not None and args.aux_weight > 0:
                loss = loss + args.aux_weight * torch.nn.functional.cross_entropy(
                    aux_time(captured["merged"]), targets["video_aux"]
                )
            probe_terms = []
            for probe_targets, heads, weight in (
                (targets["quadrant"], quadrant_probe, args.answer_aux),
                (targets["count"], count_probe, args.count_aux),
                (targets["when"], when_probe, args.answer_aux),
            ):
                if probe_targets and weight > 0:
                    pos = torch.tensor([p for p, _ in probe_targets])
                    target = torch.tensor([t for _, t in probe_targets])
                    probe_terms += [
                        weight * torch.nn.functional.cross_entropy(head(captured[f"attn{i}"][0, pos]), target)
                        for i, head in enumerate(heads)
                    ]
            if probe_terms:
                answer_loss = torch.stack(probe_terms).mean()
                loss = loss + answer_loss
                run_ans += float(answer_loss.detach())
                run_ans_n += 1
            (loss / args.accum).backward()
            run_loss += float(out.loss.detach())
            run_n += 1
            with torch.no_grad():  # teacher-forced exact match of each answer
                labels = inputs["labels"][0, 1:]
                pred = out.logits[0, :-1].argmax(-1)
                # answer tokens only: skip the auxiliary colour-word labels at visual tokens
                first_text = (
                    int(inputs["mm_token_type_ids"][0].nonzero().max()) + 1 if "mm_token_type_ids" in inputs else 0
                )
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
        last = step == args.steps - 1 or step + 1 == args.stop_at
        if (step + 1) % args.log_every == 0 or last:
            acc = {k: round(sum(v) / len(v), 3) for k, v in sorted(hits.items())}
            rec = {
                "step": step + 1,
                "samples": sample,
                "loss": round(run_loss / run_n, 4),
                "aux_loss": round(run_aux / max(run_aux_n, 1), 4),
                "attn_loss": round(run_att / max(run_att_n, 1), 4),
                "answer_aux_loss": round(run_ans / max(run_ans_n, 1), 4),
                "lr": lr_at(step),
                "seconds": round(time.time() - t0, 1),
                "tf_acc": acc,
            }
            history.append(rec)
            print(json.dumps(rec), flush=True)
            run_loss, run_n, hits = 0.0, 0, {}
            run_aux, run_aux_n = 0.0, 0
            run_att, run_att_n = 0.0, 0
            run_ans, run_ans_n = 0.0, 0
        if (step + 1) % args.save_every == 0 or last:
            model.eval()
            save(
                model,
                processor,
                args.out,
                {
                    "args": vars(args),
                    "sizes": DEMO_SIZES,
                    "history": history,
                    "params": n_params,
                    "samples": sample,
                    "seconds": round(time.time() - t0, 1),
                    "done": last,
                },
            )
            model.train()
    print(f"done in {time.time() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
