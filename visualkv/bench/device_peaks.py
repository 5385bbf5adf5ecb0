"""The hardware limits `bench gpu` sets beside its figures: a GPU's dense bf16 tensor peak and its memory bandwidth.

Figures are the vendor's data-sheet numbers for the board named (dense: NVIDIA lists the bf16 tensor figure
"with sparsity", twice the dense one; the dense one is used here). A device is matched by a substring of its CUDA
name (`torch.cuda.get_device_name()`) as a whole word ("L4" is not "L40S"), most specific first; a GPU not listed
has no limits (its shares are null).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

TERA = 1e12


@dataclass(frozen=True)
class DevicePeak:
    """One board's limits: dense bf16 tensor FLOP/s, memory bytes/s, and where the numbers come from."""

    name: str  # as matched in the CUDA device name
    bf16_flops_per_second: float
    memory_bytes_per_second: float
    source: str


#: most specific first: "H100 NVL" and "H100 PCIe" before "H100" (the SXM board's CUDA name is "NVIDIA H100 80GB HBM3")
DEVICE_PEAKS: tuple[DevicePeak, ...] = (
    # NVIDIA H200 Tensor Core GPU datasheet: H200 NVL, BF16 1,671 TFLOPS with sparsity, 4.8 TB/s
    DevicePeak("H200 NVL", 835.5 * TERA, 4.8 * TERA, "NVIDIA H200 Tensor Core GPU datasheet (H200 NVL)"),
    # same datasheet: H200 SXM, BF16 1,979 TFLOPS with sparsity, 4.8 TB/s
    DevicePeak("H200", 989.5 * TERA, 4.8 * TERA, "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM)"),
    # NVIDIA H100 Tensor Core GPU datasheet: H100 NVL, BF16 1,671 TFLOPS with sparsity, 3.9 TB/s
    DevicePeak("H100 NVL", 835.5 * TERA, 3.9 * TERA, "NVIDIA H100 Tensor Core GPU datasheet (H100 NVL)"),
    # same datasheet: H100 PCIe, BF16 1,513 TFLOPS with sparsity, 2 TB/s
    DevicePeak("H100 PCIe", 756.5 * TERA, 2.0 * TERA, "NVIDIA H100 Tensor Core GPU datasheet (H100 PCIe)"),
    # same datasheet: H100 SXM, BF16 1,979 TFLOPS with sparsity, 3.35 TB/s
    DevicePeak("H100", 989.5 * TERA, 3.35 * TERA, "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM)"),
    # NVIDIA A100 Tensor Core GPU datasheet: BF16 312 TFLOPS dense; 80GB PCIe 1,935 GB/s, 80GB SXM 2,039 GB/s
    DevicePeak("A100 80GB PCIe", 312 * TERA, 1.935 * TERA, "NVIDIA A100 Tensor Core GPU datasheet (A100 80GB PCIe)"),
    DevicePeak("A100-SXM4-80GB", 312 * TERA, 2.039 * TERA, "NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM)"),
    # NVIDIA L4 Tensor Core GPU datasheet: BF16 242 TFLOPS with sparsity, 300 GB/s
    DevicePeak("L4", 121 * TERA, 0.3 * TERA, "NVIDIA L4 Tensor Core GPU datasheet"),
    # The A10G is AWS's board of the A10 (NVIDIA publishes no A10G datasheet); the NVIDIA A10 Tensor Core GPU
    # datasheet's figures: BF16 125 TFLOPS dense (250 with sparsity), 600 GB/s, the bandwidth AWS lists for G5
    DevicePeak("A10G", 125 * TERA, 0.6 * TERA, "NVIDIA A10 Tensor Core GPU datasheet (A10G: AWS's A10 board)"),
)


def device_peak(device_name: str | None) -> DevicePeak | None:
    """The limits of the CUDA device named `device_name` (None on CPU or for a GPU not in `DEVICE_PEAKS`)."""
    if not device_name:
        return None
    return next(
        (peak for peak in DEVICE_PEAKS if re.search(rf"(?<!\w){re.escape(peak.name)}(?!\w)", device_name)), None
    )


def as_json(peak: DevicePeak | None) -> dict[str, Any] | None:
    return None if peak is None else asdict(peak)
