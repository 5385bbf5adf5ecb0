"""ZeroGPU: which shape models fit a slice (weights and KV per token from the released configurations, computed
from the code, not measured), and the seconds each example card's call asks for (scripts/zerogpu_durations.py)."""

from __future__ import annotations

from pathlib import Path

from visualkv.bench.tables.format import load, mib, render, render_with_source
from visualkv.bench.tables.measured import MEDIA, METHODS, PREFILL, paths

#: GPU memory one ZeroGPU call gets (https://huggingface.co/docs/hub/spaces-zerogpu: "70GB per workload")
ZERO_GPU_SLICE_BYTES = 70 * 10**9
BF16_BYTES = 2
#: the visual budget the "compressed" column keeps per layer and KV head (about 10 % of a 4K image's visual tokens)
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


DURATIONS = "zerogpu_durations.json"


def zerogpu_durations(results: Path) -> str:
    """Per example card: the first turn's plan, the seconds its call asks ZeroGPU for, and the call's wall seconds
    in the CPU emulation."""
    d = load(DURATIONS, results)
    body = [
        [
            row["example"],
            f"{row['plan']['prompt_tokens']:,}",
            str(row["plan"]["blocks"]),
            str(row["plan"]["answer_tokens"]),
            f"{row['seconds_asked']} s",
            f"{row['seconds_asked_7b']} s",
            f"{row['cpu_wall_seconds']:.2f} s",
            str(row["answer_tokens"]),
        ]
        for row in d["rows"]
    ]
    header = [
        "example card (first turn)",
        "prompt tokens",
        "prefill blocks",
        "answer tokens at most",
        "seconds asked (plan)",
        "same plan, 7 B model",
        "CPU emulation: call wall",
        "answer tokens",
    ]
    speed = d["speed"]
    note = (
        f"The app's default settings (`{d['settings']['method']}`, budget {d['settings']['budget']}, "
        f"{d['settings']['max_new']} answer tokens at most), model `{d['model']}`. *Seconds asked* is the plan's, "
        f"not a measurement: a first call's, at the constant speeds ({speed['prefill_tokens_per_second']:,.0f} prompt "
        f"and {speed['decode_tokens_per_second']:,.0f} answer tokens per second per billion parameters, "
        f"{speed['seconds_per_block']} s a block) times {d['margin']}, plus {speed['setup_seconds']:.0f} s of setup; "
        "the demo model is so small that its calls ask the setup and little more, so the next column gives the same "
        "plan for a model of 7 billion parameters. *CPU emulation* is the wall time of the call forked and pickled "
        "as ZeroGPU runs it, on this machine's CPU: not a ZeroGPU measurement."
    )
    return render(header, body, [(DURATIONS, d)], note)


TABLES = {"zerogpu-fit": zerogpu_fit, "zerogpu-durations": zerogpu_durations}
#: block name -> the source paths its figures measure (`visualkv.bench.staleness`); a table computed from the code
#: measures nothing
MEASURES = {
    "zerogpu-fit": (),
    "zerogpu-durations": paths(("visualkv/runtime",), PREFILL, METHODS, MEDIA),
}
