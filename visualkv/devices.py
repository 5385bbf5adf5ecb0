"""Moving host tables to the device that uses them without stalling it."""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device` without a stream synchronisation: a host tensor bound for CUDA is pinned first and copied
    non-blocking (a copy from pageable memory would wait for the stream). Already there: `t` itself."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device, non_blocking=True)
