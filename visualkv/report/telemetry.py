"""Telemetry events and the JSON report (the contract the CLI, app and benches share).

Everything the UI plots comes from these records, which are filled from the
cache itself (bytes of tensors really held), so the plots cannot disagree with
the memory actually used.
"""

from __future__ import annotations

import json
import os
import resource
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil
import torch


def rss_bytes() -> int:
    """Current resident set size of this process."""
    return int(psutil.Process(os.getpid()).memory_info().rss)


def peak_rss_bytes() -> int:
    """High-water mark of this process's RSS (never goes down)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def reset_peak_rss() -> bool:
    """Start a new RSS high-water mark (Linux: /proc/self/clear_refs resets VmHWM to the current RSS), for
    `rss_peak_since_reset`; False where the system has no such file (the peak then never goes down)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def rss_peak_since_reset() -> int | None:
    """VmHWM: this process's RSS high-water mark since `reset_peak_rss` (or its start; unlike getrusage's
    ru_maxrss, not carried over from a parent across exec); None off Linux."""
    try:
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return None


def cuda_allocated() -> int | None:
    return int(torch.cuda.memory_allocated()) if torch.cuda.is_available() else None


#: what `cuda_peak_bytes` counts: CUDA's allocator keeps one peak per device for the whole process, so a turn's peak
#: includes what other threads (another session's turn) allocated meanwhile, and their turns reset it too
CUDA_PEAK_SCOPE = "process"


def cuda_peak() -> int | None:
    """Peak CUDA bytes allocated since the last `reset_cuda_peak` (summed over visible GPUs)."""
    if not torch.cuda.is_available():
        return None
    return sum(int(torch.cuda.max_memory_allocated(d)) for d in range(torch.cuda.device_count()))


def reset_cuda_peak() -> None:
    """Start a new CUDA peak (each turn's report then means "this turn's peak", as in the app's Compare)."""
    if torch.cuda.is_available():
        for d in range(torch.cuda.device_count()):
            torch.cuda.reset_peak_memory_stats(d)


@dataclass
class BlockEvent:
    """State right after one prefill block (eviction of that block included)."""

    index: int
    kind: str  # text / bulk / rows / tile / frame
    tokens_in: int  # tokens of this block that entered the LLM
    visual_tokens_in: int
    kv_tokens: int  # entries per KV head, largest layer
    kv_tokens_per_layer: list[int]
    kv_bytes: int
    peak_kv_bytes: int  # high-water mark so far (taken right after each append)
    rss_bytes: int
    seconds: float
    cuda_allocated_bytes: int | None = None
    n_blocks: int = 0  # total blocks of this prefill (for progress bars)
    # video: time (s) of the latest frame this prefill has reached (encoded or skipped); None for images / text
    media_seconds: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


#: `TurnRecord.stopped` of an answer that a time limit (`streaming.stream_turn`), not the user's Stop, ended
TIME_LIMIT_STOP = "time_limit"
#: the `stopped` values of an answer cut short (by the user, or by a time limit)
CUT_SHORT = ("stopped", TIME_LIMIT_STOP)


@dataclass
class TurnRecord:
    prompt: str
    answer: str = ""
    token_ids: list[int] = field(default_factory=list)
    ttft_seconds: float = 0.0
    prefill_seconds: float = 0.0
    decode_tokens_per_second: float = 0.0
    kv_bytes_after: int = 0
    stopped: str = ""  # "eos", "max_new_tokens", "stopped" (the user's Stop) or TIME_LIMIT_STOP
    cuda_peak_bytes: int | None = None  # CUDA peak of this turn (reset when the turn starts); None without CUDA
    decode_mode: str = ""  # "graph", "static" or "eager" (visualkv.runtime.static_decode); "" when one token was made
    decode_attention: str = ""  # a fixed-shape decode's attention: "model" or "grouped"; "" for eager steps
    # the kernels the prefill's blocks after cached entries ran (visualkv.attention.block: "flash", "gqa", "stock",
    # comma-separated); "" when none had a cache before it
    prefill_attention: str = ""
    # seconds spent building the fixed-shape decoder (a CUDA graph's warm-up and capture) after the first token:
    # inside decode_tokens_per_second, which is what a user waits for; apart here to show the steady rate
    decode_setup_seconds: float = 0.0
    #: share of the uncompressed model's attention on the visual tokens this turn's cache kept (None: not asked)
    evidence_recall: float | None = None
    evidence_note: str = ""  # why a turn asked for evidence has none (the pass was refused or stopped)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def write_json(report: dict[str, Any], path: str) -> None:
    with open(path, "w") as fh:
        json.dump(report, fh, indent=1, default=_default)


def _default(obj: Any) -> Any:
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")
