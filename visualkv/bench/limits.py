"""What the hardware allows a `bench gpu` row: a TTFT floor and a decode ceiling, and the row's share of each.

TTFT floor = FLOPs of the vision tower and the LLM prefill on the input / the device's dense bf16 peak (two FLOPs
per multiply-add; the linear layers per patch or token plus causal attention; the tower's attention, patch
embedding and norms left out, so the floor is a lower bound). Decode ceiling = memory bandwidth / the weight bytes
one step reads (decoder layers, final norm, LM head). The count is `full`'s work, the same for every row of an
input, so a method that skips work may exceed a share of 1. Off the devices in `device_peaks`, shares are null.
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
