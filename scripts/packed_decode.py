"""Sali-Cache's decode step over its packed tiers: dequantized in the model dtype vs through float32, beside
`full`.

Usage: python scripts/packed_decode.py OUT.json [--shape shape-qwen2.5-vl-7b] [--visual-tokens 10549]
  [--text-tokens 30] [--repeats 15] [--dtypes float32,bfloat16]

One decoder layer's attention for one new token (the packed segments dequantized, then
`packed_attention.one_query`: what a decode step runs per layer), at the shape's attention dimensions (Qwen2.5-VL-7B: 4 KV heads, 7 query heads each, head_dim 128), over the
entries Sali-Cache keeps of an image of `--visual-tokens` visual tokens (10,549: a 4K image on Qwen2.5-VL) under
its default tiers (43 % full precision, 10 % INT8, 29 % INT4, the rest pruned; group size 32), plus the prompt's
text at full precision. Three cases, in one process on the same random entries:
- `full`: every token at full precision (what the uncompressed cache reads);
- `salicache, float32 dequantize`: each packed segment dequantized through float32 codes, product and sum,
  then cast, and attended as a part of its own (the alternative; `dequantize_through_float32`);
- `salicache`: what a decode step runs: every segment dequantized by one `addcmul` per tensor (codes read
  as they are, rounded once, no float32 copy) into one buffer, attended as one part (`packed_attention.dequantized`).
Per case: the bytes its kernels read and write (`OpCounter.bytes_moved`: the traffic of a memory-bound GPU
step), kernel launches, CPU ms per layer (median over interleaved repeats, one torch thread) and the largest
difference from float32 attention over the exact quantized values. A GPU step of this size pays a few
microseconds per kernel as well as its bytes: both are recorded. Per token: x the shape's layers, beside the
bytes of the decoder weights every decode step reads (`decoder_weight_bytes_bf16`). Counts depend on the shapes
only; the CPU time is this machine's, not a GPU's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

from visualkv.attention import packed as packed_attention
from visualkv.bench.launches import OpCounter
from visualkv.kv.cache import QuantSegment
from visualkv.kv.quant import PackedTensor, QuantSpec, _unpack, quantize
from visualkv.media.saliency import TierSpec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _attention_shape(alias: str) -> dict[str, int]:
    from visualkv.models.synthetic.shapes import build_shape_config, build_shape_processor

    text = build_shape_config(alias, build_shape_processor(alias)).text_config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return {
        "layers": text.num_hidden_layers,
        "kv_heads": text.num_key_value_heads,
        "query_group": text.num_attention_heads // text.num_key_value_heads,
        "head_dim": head_dim,
    }


def _decoder_weight_bytes(alias: str) -> int:
    """bfloat16 bytes of what a decode step reads in full: the decoder layers, the final norm and the LM head."""
    from visualkv.models.synthetic.shapes import _model_class, build_shape_config, build_shape_processor, shape_spec

    with torch.device("meta"):
        model = _model_class(shape_spec(alias))._from_config(build_shape_config(alias, build_shape_processor(alias)))
    text = model.model.language_model
    params = sum(p.numel() for m in (text.layers, text.norm, model.lm_head) for p in m.parameters())
    return 2 * params


def _tier_counts(visual: int) -> dict[str, int]:
    full, int8, int4 = (round(visual * f) for f in TierSpec().fractions)
    return {"full": full, "int8": int8, "int4": int4, "pruned": visual - full - int8 - int4}


def _exact(p: PackedTensor) -> torch.Tensor:
    """The quantized values in float32 (codes x scale + zero, not rounded to the model dtype)."""
    size = p.spec.group_size
    codes = _unpack(p).float().reshape(*p.shape[:-1], p.shape[-1] // size, size)
    return (codes * p.scale.float().unsqueeze(-1) + p.zero.float().unsqueeze(-1)).reshape(p.shape)


def dequantize_through_float32(p: PackedTensor) -> torch.Tensor:
    """`quant.dequantize` through float32: float32 codes, product and sum, then a cast (six kernels for INT8,
    nine for INT4)."""
    return _exact(p).to(p.dtype)


def _cases(shape: dict[str, int], tiers: dict[str, int], text: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    h, g, d = shape["kv_heads"], shape["query_group"], shape["head_dim"]

    def entries(n: int) -> torch.Tensor:
        return torch.randn(1, h, n, d, generator=gen).to(dtype)

    query = torch.randn(1, h * g, 1, d, generator=gen).to(dtype)
    window_k, window_v = entries(tiers["full"] + text), entries(tiers["full"] + text)
    segments = []
    for name, bits in (("int8", 8), ("int4", 4)):
        keys, values = quantize(entries(tiers[name]), QuantSpec(bits)), quantize(entries(tiers[name]), QuantSpec(bits))
        segments.append(QuantSegment(keys, values, torch.zeros(1, h, tiers[name], dtype=torch.int32)))
    # full: the same number of visual tokens, all at full precision
    full_k = torch.cat([window_k, *(_exact(s.keys).to(dtype) for s in segments), entries(tiers["pruned"])], dim=2)
    full_v = torch.cat([window_v, *(_exact(s.values).to(dtype) for s in segments), entries(tiers["pruned"])], dim=2)
    reference_k = torch.cat([*(_exact(s.keys) for s in segments), window_k.float()], dim=2).repeat_interleave(g, 1)
    reference_v = torch.cat([*(_exact(s.values) for s in segments), window_v.float()], dim=2).repeat_interleave(g, 1)
    reference = torch.nn.functional.scaled_dot_product_attention(query.float(), reference_k, reference_v)
    reference = reference.transpose(1, 2)

    def before() -> torch.Tensor:  # each segment its own part, dequantized through float32
        parts = [(dequantize_through_float32(s.keys), dequantize_through_float32(s.values)) for s in segments]
        return packed_attention.one_query(query, window_k, window_v, None, parts, None)[0]

    def now() -> torch.Tensor:  # what the wrapped attention runs for a decode step
        parts = [packed_attention.dequantized(segments)]
        return packed_attention.one_query(query, window_k, window_v, None, parts, None)[0]

    cases = {
        "full": lambda: packed_attention.one_query(query, full_k, full_v, None, [], None)[0],
        "salicache, float32 dequantize": before,
        "salicache": now,
    }
    held = sum(s.keys.nbytes + s.values.nbytes for s in segments) + window_k.nbytes + window_v.nbytes
    return cases, reference, held, full_k.nbytes + full_v.nbytes


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--shape", default="shape-qwen2.5-vl-7b")
    p.add_argument("--visual-tokens", type=int, default=10_549, help="visual tokens of the image (4K on Qwen2.5-VL)")
    p.add_argument("--text-tokens", type=int, default=30)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--dtypes", default="float32,bfloat16")
    args = p.parse_args()
    from visualkv.bench.provenance import save_json, start

    prov = start()
    prov["command"] = "python scripts/packed_decode.py " + " ".join(sys.argv[1:])
    torch.set_num_threads(1)
    shape = _attention_shape(args.shape)
    tiers = _tier_counts(args.visual_tokens)
    weights = _decoder_weight_bytes(args.shape)
    rows = []
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        cases, reference, held, full_held = _cases(shape, tiers, args.text_tokens, dtype, seed=0)
        for case in cases.values():  # warm up
            case()
        times: dict[str, list[float]] = {label: [] for label in cases}
        for _ in range(args.repeats):  # interleaved: a slow spell of the machine hits every case alike
            for label, case in cases.items():
                t0 = time.process_time()
                case()
                times[label].append(time.process_time() - t0)
        for label, case in cases.items():
            counter = OpCounter()
            with counter:
                out = case()
            row = {
                "dtype": name,
                "case": label,
                "kv_bytes_held_per_layer": full_held if label == "full" else held,
                "bytes_moved_per_layer": counter.bytes_moved,
                "kernels_per_layer": counter.kernels,
                "cpu_ms_per_layer_median": 1000 * statistics.median(times[label]),
                "bytes_moved_per_token": counter.bytes_moved * shape["layers"],
            }
            if label != "full":
                row["max_abs_difference"] = float((out.float() - reference).abs().max())
            rows.append(row)
            print(row, flush=True)
    result = {
        "shape": args.shape,
        "attention": shape,
        "visual_tokens": args.visual_tokens,
        "text_tokens": args.text_tokens,
        "tiers": tiers,
        "group_size": QuantSpec(8).group_size,
        "decoder_weight_bytes_bf16": weights,
        "repeats": args.repeats,
        "rows": rows,
    }
    save_json(result, args.out, prov)


if __name__ == "__main__":
    main()
