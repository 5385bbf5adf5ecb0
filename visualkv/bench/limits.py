"""What the hardware allows a `bench gpu` row: a TTFT floor and a decode ceiling, and the row's share of each.

- TTFT floor = the FLOPs of the vision tower and the LLM prefill on the input / the device's dense bf16 peak.
- Decode ceiling = the device's memory bandwidth / the weight bytes one decode step reads.

What is counted (one multiply-add = 2 FLOPs; n = prompt tokens, v = visual tokens, p = v x the adapter's
`patches_per_token`, the vision tower's input patches):
- vision tower: 2 x p x (weights of the `nn.Linear` layers in its repeated blocks: the largest `ModuleList`
  outside the LLM) + 2 x v x (weights of every other `nn.Linear` outside the LLM and the LM head: the merger or
  projector, which runs on merged tokens). Left out: the tower's attention (its span differs by family: windows,
  per-frame or whole-image), the patch embedding and the norms;
- LLM prefill: 2 x n x (weights of the `nn.Linear` layers of the decoder layers) + causal attention,
  2 x layers x query heads x head_dim x n^2 (QK^T and AV: n^2 / 2 x head_dim multiply-adds each, per head) +
  the LM head on the last token, 2 x (its weights);
- decode bytes per token: every parameter of the decoder layers and the final norm, plus the LM head's weight,
  each read once per step (the embedding table: one row, left out; the KV cache's reads are not counted).
The count is the uncompressed work on the input (what `full` computes), the same for every row of an input: it
leaves work out, so the floor is a lower bound, and a method that skips work (frames, merged tokens) may reach a
TTFT share above 1. On CPU, or on a GPU not in `visualkv.bench.device_peaks`, floors, ceilings and shares are
null; the FLOPs and bytes are given anyway.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from visualkv.bench.device_peaks import DevicePeak


def _linear_params(module: torch.nn.Module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))


@dataclass(frozen=True)
class ModelWork:
    """The counts `prefill_flops` and `decode_bytes_per_token` need, read from a loaded model."""

    vision_block_linear_params: int  # applied per patch
    vision_other_linear_params: int  # applied per visual token (merger / projector)
    llm_linear_params: int  # applied per prompt token
    lm_head_params: int  # applied to the last prompt token only
    layers: int
    query_heads: int
    head_dim: int
    patches_per_token: int
    decode_bytes_per_token: int

    def prefill_flops(self, prompt_tokens: int, visual_tokens: int) -> float:
        """FLOPs of the vision tower on `visual_tokens` and the LLM prefill over `prompt_tokens` (module docstring)."""
        patches = visual_tokens * self.patches_per_token
        vision = 2 * patches * self.vision_block_linear_params + 2 * visual_tokens * self.vision_other_linear_params
        n = prompt_tokens
        attention = 2 * self.layers * self.query_heads * self.head_dim * n * n
        return float(vision + 2 * n * self.llm_linear_params + attention + 2 * self.lm_head_params)


def model_work(adapter) -> ModelWork:
    """The counts of `adapter`'s model (see the module docstring for what each holds)."""
    model, llm = adapter.model, adapter.language_model
    lm_head = model.lm_head
    inside_llm = {id(m) for m in llm.modules()} | {id(lm_head)}
    outside = [m for m in model.modules() if id(m) not in inside_llm]
    lists = [m for m in outside if isinstance(m, torch.nn.ModuleList)]
    blocks = max(lists, key=_linear_params, default=None)
    block_params = _linear_params(blocks) if blocks is not None else 0
    outside_linear = sum(m.weight.numel() for m in outside if isinstance(m, torch.nn.Linear))
    cfg = adapter.text_config
    decoder_bytes = sum(p.nbytes for p in adapter.layers.parameters())
    norm = getattr(llm, "norm", None)
    norm_bytes = sum(p.nbytes for p in norm.parameters()) if norm is not None else 0
    return ModelWork(
        vision_block_linear_params=block_params,
        vision_other_linear_params=outside_linear - block_params,
        llm_linear_params=_linear_params(adapter.layers),
        lm_head_params=lm_head.weight.numel(),
        layers=adapter.num_layers,
        query_heads=cfg.num_attention_heads,
        head_dim=adapter.head_dim,
        patches_per_token=adapter.patches_per_token,
        decode_bytes_per_token=decoder_bytes + norm_bytes + lm_head.weight.nbytes,
    )


def work_json(work: ModelWork) -> dict[str, Any]:
    return asdict(work)


def row_limits(
    work: ModelWork,
    peak: DevicePeak | None,
    prompt_tokens: int,
    visual_tokens: int,
    ttft_seconds: float | None,
    decode_tokens_per_second: float | None,
) -> dict[str, Any]:
    """A row's limits: the work counted, the floor / ceiling on `peak` and the row's (median) share of each."""
    flops = work.prefill_flops(prompt_tokens, visual_tokens)
    floor = flops / peak.bf16_flops_per_second if peak is not None else None
    ceiling = peak.memory_bytes_per_second / work.decode_bytes_per_token if peak is not None else None
    return {
        "prefill_flops": flops,
        "ttft_floor_seconds": floor,
        "ttft_share": floor / ttft_seconds if floor is not None and ttft_seconds else None,
        "decode_bytes_per_token": work.decode_bytes_per_token,
        "decode_ceiling_tokens_per_second": ceiling,
        "decode_share": decode_tokens_per_second / ceiling if ceiling and decode_tokens_per_second else None,
    }
