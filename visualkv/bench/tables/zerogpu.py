"""Which shape models fit a ZeroGPU slice: weights and KV per token from the released configurations (computed
from the code, not measured)."""

from __future__ import annotations

from pathlib import Path

from visualkv.bench.tables.format import mib, render_with_source

#: GPU memory one ZeroGPU call gets (https://huggingface.co/docs/hub/spaces-zerogpu: "70GB per workload")
ZERO_GPU_SLICE_BYTES = 70 * 10**9
BF16_BYTES = 2
#: the visual budget the "compressed" column keeps per layer and KV head (the app's default budget)
BUDGET = 1024


def _kv_bytes_per_token(alias: str) -> int:
    """K and V of one token over every layer and KV head, in bfloat16 (from the released configuration)."""
    from visualkv.models.synthetic.shapes import build_shape_config, build_shape_processor

    text = build_shape_config(alias, build_shape_processor(alias)).get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return text.num_hidden_layers * 2 * text.num_key_value_heads * head_dim * BF16_BYTES


def zerogpu_fit(results: Path) -> str:
    """Per shape model: parameters, bfloat16 weights, what is left of a slice, KV per token, a budget's cache."""
    from visualkv.models.synthetic.shapes import SHAPE_SPECS, parameter_count

    body = []
    for alias, spec in SHAPE_SPECS.items():
        params = parameter_count(alias)
        weights = params * BF16_BYTES
        per_token = _kv_bytes_per_token(alias)
        left = ZERO_GPU_SLICE_BYTES - weights
        body.append(
            [
                f"`{spec.hub_id}`",
                f"{params / 1e9:.2f} B",
                f"{weights / 10**9:.1f} GB",
                f"{left / 10**9:.1f} GB" if left > 0 else "does not fit",
                f"{per_token / 1024:.0f} KiB",
                f"{left // per_token / 1e6:.2f} M" if left > 0 else "",
                mib(BUDGET * per_token),
            ]
        )
    header = [
        "model",
        "parameters",
        "bf16 weights",
        f"left of a {ZERO_GPU_SLICE_BYTES // 10**9} GB slice",
        "KV per token",
        "uncompressed tokens in what is left",
        f"cache at budget {BUDGET}",
    ]
    note = (
        "What is left also holds the prefill's activations and the vision tower's transient (the memory guard "
        "counts them for each turn, inside the call); the last column is the cache of the visual entries a "
        "budget keeps, text and answer aside."
    )
    source = (
        "Source: computed from `parameter_count` and the released configurations (`visualkv/models/synthetic`), "
        "with the slice size ZeroGPU documents (not measured)."
    )
    return render_with_source(header, body, note, source)


TABLES = {"zerogpu-fit": zerogpu_fit}
