"""Mixed precision (the `precision` config section): what computes in which dtype, and fp16's loss scaling.

Master weights and optimizer state always stay fp32; only the compute dtype changes:
- fp32: everything fp32 (on a GPU, `tf32` lets matmuls use TF32 tensor cores).
- bf16 / fp16: layouts without data parallelism compute under `torch.autocast`; with data parallelism FSDP2's
  `MixedPrecisionPolicy` casts the parameters for forward and backward and reduces gradients in fp32
  (TorchTitan's rule: one mechanism per layout, never both). Losses are computed in fp32 (the model's loss
  upcasts its logits).
- fp16 adds dynamic loss scaling (LossScaler): the loss is multiplied by the scale before backward, and the
  global gradient norm, which the layout all-reduces anyway, tells every rank at once whether any gradient
  overflowed: then the step is skipped and the scale halved; the unscale and the clip are one multiplication.
"""
from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch

from common.problem import Problem

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def auto_precision(cuda: bool, bf16_supported: bool, engine: str, mixed_engine: bool = True) -> tuple[str, str]:
    """`precision=auto` on this machine: (the mode, why). mixed_engine: the engine trains in bf16/fp16 too."""
    if not mixed_engine:
        return "fp32", f"engine={engine} trains fp32 graphs"
    if cuda and bf16_supported:
        return "bf16", "a CUDA GPU with bf16"
    if cuda:
        return "fp32", "this CUDA GPU has no bf16 (choose precision=fp16 for mixed precision)"
    return "fp32", "no CUDA GPU"


@dataclass(frozen=True)
class Precision:
    name: str                       # fp32 | bf16 | fp16 (resolved: never auto)
    device_type: str                # cuda | cpu
    fsdp: bool = False              # data parallelism casts the parameters (MixedPrecisionPolicy)

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.name]

    @property
    def mixed(self) -> bool:
        return self.name != "fp32"

    def autocast(self):
        """The context forward passes run in (a no-op where FSDP2 casts, or in fp32)."""
        if not self.mixed or self.fsdp:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def fsdp_policy(self):
        """FSDP2's policy for data-parallel layouts: parameters in the compute dtype, gradients reduced in fp32."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if not self.mixed:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)


def of(cfg, device: torch.device, mixed_engine: bool = True) -> Precision:
    """The run's precision on this device (cfg.precision.name is resolved before planning; a config built
    without the orchestrator, as in tests and benchmarks, may still say auto: resolved here the same way, given
    whether the engine trains in mixed precision)."""
    name = cfg.precision.name
    if name == "auto":
        cuda = device.type == "cuda"
        name, _ = auto_precision(cuda, cuda and torch.cuda.is_bf16_supported(), cfg.engine.name, mixed_engine)
    return Precision(name, device.type, fsdp=cfg.parallel.dp > 1)


def switch_tf32(cfg, device: torch.device) -> None:
    """fp32 matmuls on TF32 tensor cores, as configured (CUDA only; process-wide, as torch's flags are)."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = bool(cfg.precision.tf32)
        torch.backends.cudnn.allow_tf32 = bool(cfg.precision.tf32)


def autocast_forward(module, precision: Precision) -> None:
    """Run the module's forward under the precision's autocast (layouts without FSDP2, which casts itself)."""
    if not precision.mixed or precision.fsdp:
        return
    forward = module.forward

    @functools.wraps(forward)
    def cast_forward(*args, **kwargs):
        with precision.autocast():
            return forward(*args, **kwargs)

    module.forward = cast_forward


class LossScaler:
    """fp16's dynamic loss scale (what torch.amp.GradScaler does), driven by the layout's global gradient norm so
    that every rank (every pipeline stage, every shard) takes the same decision. Its state is a few numbers,
    kept in the checkpoint manifest, so a resumed run scales exactly as one that never stopped.

    Disabled (fp32, bf16): scale 1, nothing is ever skipped."""

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, growth_interval: int = 2000,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5):
        self.enabled = enabled
        self.scale = float(init_scale) if enabled else 1.0
        self.growth_interval, self.growth_factor, self.backoff_factor = growth_interval, growth_factor, backoff_factor
        self.good_steps = 0        # finite steps since the scale last changed
        self.skipped_steps = 0     # steps skipped over the whole run

    def step_ok(self, scaled_norm: torch.Tensor) -> bool:
        """After backward: did every gradient stay finite? Updates the scale (one host read, fp16 only)."""
        if not self.enabled:
            return True
        finite = bool(torch.isfinite(scaled_norm).item())
        if finite:
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self.scale *= self.growth_factor
                self.good_steps = 0
        else:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped_steps += 1
        return finite

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: Optional[dict]) -> None:
        """Continue from a checkpoint's scaler (none when it was written by an fp32/bf16 run: start afresh)."""
        if self.enabled and state:
            self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
            self.skipped_steps = int(state["skipped_steps"])

    def metrics(self) -> dict[str, float]:
        return {"amp/loss_scale": self.scale, "amp/skipped_steps": float(self.skipped_steps)} if self.enabled else {}


def build_scaler(cfg) -> LossScaler:
    p = cfg.precision
    return LossScaler(p.name == "fp16", p.init_scale, p.growth_interval)


# -- model FLOPs utilisation ------------------------------------------------------------------------------------------

# dense peak TFLOP/s by GPU and compute mode (vendor data sheets, no sparsity); matched on the device name
PEAK_TFLOPS = {
    "H200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.7, "fp32": 66.9},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2},
    "H100": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.7, "fp32": 66.9},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6},
    "L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "A10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    "V100": {"fp16": 125.0, "fp32": 15.7, "tf32": 15.7},
}


def peak_flops(device: torch.device, precision: str, tf32: bool) -> Optional[float]:
    """The device's dense peak FLOP/s for this compute mode; None on CPU or an unknown GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    mode = "tf32" if precision == "fp32" and tf32 else precision
    for gpu, peaks in PEAK_TFLOPS.items():  # most specific names first ("H100 PCIe" before "H100")
        if gpu in name and mode in peaks:
            return peaks[mode] * 1e12
    return None


def mfu(n_params: int, tokens_per_s: Optional[float], peak: Optional[float]) -> Optional[float]:
    """Model FLOPs utilisation: 6 * parameters * tokens/s (forward + backward) over the peak."""
    if not tokens_per_s or not peak or not math.isfinite(tokens_per_s):
        return None
    return 6.0 * n_params * tokens_per_s / peak


def check(cfg) -> list:
    """bf16 needs a GPU of compute capability 8.0 (Ampere) or newer where the ranks run on this machine's CUDA."""
    from runtime import machine

    if cfg.precision.name == "bf16" and cfg.cluster.name != "slurm" and machine.has_cuda() and not machine.cuda_bf16():
        return [Problem("precision.name", "bf16", "this machine's CUDA GPU has no bf16 support (it needs compute "
                        "capability 8.0, Ampere, or newer)", "precision=fp16 (loss scaling) or precision=fp32")]
    return []
