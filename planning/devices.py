"""The devices a plan can be made for (`cluster.device`): what a rank holds, so that a plan made on a CPU can answer
"does this layout fit an H100" before a GPU is booked.

Memory is what torch reports as the device's total (`torch.cuda.mem_get_info()[1]`), in GiB: a little under the
marketed figure. The dense peaks (no sparsity) are NVIDIA's data sheets', kept for a step's time at the device's
rate (issue 78's trace); the plan reads the memory today."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Device:
    memory_gib: float
    bf16_tflops: float  # dense
    fp32_tflops: float  # dense, without tensor cores' TF32
    what: str


DEVICES = {
    "h100_80gb": Device(79.2, 989.4, 66.9, "NVIDIA H100 SXM 80GB"),
    "h100_94gb": Device(93.0, 835.0, 60.0, "NVIDIA H100 NVL 94GB"),
    "h200": Device(139.8, 989.4, 66.9, "NVIDIA H200 141GB"),
    "a100_80gb": Device(79.2, 312.0, 19.5, "NVIDIA A100 80GB"),
    "a100_40gb": Device(39.4, 312.0, 19.5, "NVIDIA A100 40GB"),
}


def device_of(value) -> Optional[Device]:
    """The declared device: a name of DEVICES, or its memory in GiB (a number); None: not one of those."""
    if value is None:
        return None
    if str(value) in DEVICES:
        return DEVICES[str(value)]
    try:
        gib = float(value)
    except (TypeError, ValueError):
        return None
    return Device(gib, 0.0, 0.0, f"a device of {gib:g} GiB") if gib > 0 and gib == gib and gib != float("inf") \
        else None
