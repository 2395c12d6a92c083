"""FLOPs of a rank's step, from torch's own formulas (torch.utils.flop_counter's registry), counted by a small
dispatch mode rather than torch's FlopCounterMode, for three reasons:
- FlopCounterMode attributes FLOPs to modules with a ModuleTracker, whose hooks on the outputs of every module
  call keep the tensors of a recomputed layer (memory levels 1-3) alive until the step ends: under it, a
  Llama-2-70B FSDP-64 rank traced 99 GB of recomputed activations that the run frees layer by layer (a real CPU
  step showed the same: the tracker, not the trace);
- it counts an op on DTensors at the global shape (tp x the rank's matmuls): here DTensor goes first (the mode
  returns NotImplemented) and its local tensors' ops are counted, and DTensor's sharding propagation (a fake mode of
  its own, on global shapes) is skipped;
- torch 2.13 has no formula for the CPU attention kernels (0 FLOPs): they get the CUDA flash kernels' formulas.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
from torch._guards import active_fake_mode
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
_CPU_SDPA = (_aten._scaled_dot_product_flash_attention_for_cpu,
             _aten._scaled_dot_product_flash_attention_for_cpu_backward)
ATTENTION = {"_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward",
             "_scaled_dot_product_flash_attention_backward", "_scaled_dot_product_efficient_attention_backward",
             "_scaled_dot_product_cudnn_attention_backward", "_flash_attention_backward",
             "_efficient_attention_backward", *(op.__name__ for op in _CPU_SDPA)}

if _CPU_SDPA[0] not in flop_counter.flop_registry:
    @flop_counter.register_flop_formula(_CPU_SDPA[0])
    def _sdpa_cpu(query, key, value, *args, out_shape=None, **kwargs) -> int:
        return flop_counter.sdpa_flop_count(query, key, value)

    @flop_counter.register_flop_formula(_CPU_SDPA[1])
    def _sdpa_cpu_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
        return flop_counter.sdpa_backward_flop_count(grad_out, query, key, value)


class FlopCount(TorchDispatchMode):
    """FLOPs by op (its overload packet) of the ops run under it."""

    def __init__(self):
        super().__init__()
        self.by_op: dict = defaultdict(int)
        self._fake_on_entry = None

    def __enter__(self):
        self._fake_on_entry = active_fake_mode()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if packet in flop_counter.flop_registry and active_fake_mode() is self._fake_on_entry:
            self.by_op[packet] += flop_counter.flop_registry[packet](*args, **kwargs, out_val=out)
        return out


@contextlib.contextmanager
def counting_flops():
    """Yields the FlopCount; enter it inside the fake mode (if any), as the other trackers."""
    with FlopCount() as counter:
        yield counter


def split(counter: FlopCount) -> dict:
    """{"flops": total, "flops_attention": the attention kernels' share}."""
    attention = sum(v for op, v in counter.by_op.items() if op.__name__ in ATTENTION)
    return {"flops": sum(counter.by_op.values()), "flops_attention": attention}
