"""parallelize(): every transformation of a rank's model part, in one place, one `apply_*` per config section,
on the meta device (nothing is allocated until the layout materialises the rank's shards). The order:

1. memory (recomputation) first: it wraps each block's internals as the model defines them, before tensor
   parallelism swaps their weights for DTensors (the wrappers only re-run forwards, whatever the tensors are).
2. hp (tensor parallelism, the model's own plan) next: it decides each weight's shard, and what a unit of
   shard-local compute between two collectives is.
3. engine: ONNX Runtime takes over those units (its graphs are the shards' compute, so it comes after hp); it
   reads the parameters at every forward, so it may be attached before they exist.
4. compile (the `triton` section): each block's forward is wrapped by torch.compile (lazily: the first call
   compiles), after hp and the engine so that it compiles what will run, with the collectives between blocks
   left outside (TorchTitan's per-block compile).
5. dp last (FSDP2): it shards whatever the block has become, and its hooks gather the parameters around the
   wrapped forward. Under engine=ort the parameters stay gathered from forward to backward (ORT keeps pointers
   to them), hence no reshard after forward; so do they under a zero-bubble pipeline schedule (its weight pass
   needs them gathered when the input pass starts: plugins/parallel/schedules.py, split_backward).
6. precision: with dp, FSDP2 casts the parameters for forward and backward (the policy goes in with 5); without,
   the part's whole forward runs under autocast, outermost, so that the compiled blocks trace inside it. One
   mechanism per layout, never both (TorchTitan's rule).
"""
from __future__ import annotations

from typing import Optional

from torch import nn

from plugins.engines import get_engine
from plugins.models.lora import shard_adapters
from plugins.parallel.data import apply_dp as _fsdp
from plugins.parallel.schedules import SCHEDULES
from runtime import precision as mixed
from runtime.kernels import KernelReport, apply_kernels


def parallelize(module: nn.Module, spec, cfg, mesh, device, engine=None,
                kernels: Optional[KernelReport] = None, log=None, part: int = 0) -> nn.Module:
    """engine: what cfg.engine's spec built (None: the model's own forward); kernels: where compilation reports
    (None: the `triton` section is not applied, as for a reference layout)."""
    runs_on = get_engine(cfg.engine.name)
    precision = mixed.of(cfg, device, runs_on.mixed_precision)
    apply_memory(module, spec, cfg.memory)
    apply_hp(module, spec, mesh, cfg.parallel)
    apply_engine(module, spec, runs_on, engine)
    if kernels is not None:
        apply_kernels([module], spec, cfg.triton, log, cuda=device.type == "cuda", report=kernels, first_part=part)
    apply_dp(module, spec, mesh, cfg.parallel, runs_on, precision)
    apply_precision(module, cfg, device, precision)
    return module


def apply_memory(module: nn.Module, spec, memory_cfg) -> None:
    spec.apply_memory(module, memory_cfg.level)


def apply_hp(module: nn.Module, spec, mesh, parallel_cfg) -> None:
    if parallel_cfg.hp > 1:
        trains = {name: p.requires_grad for name, p in module.named_parameters()}
        spec.parallelize(module, mesh["hp"], parallel_cfg)
        shard_adapters(module)  # LoRA's, as their Linear is split (none without peft=lora)
        for name, p in module.named_parameters():  # torch's SequenceParallel makes its Parameters trainable anew
            p.requires_grad_(trains[name])


def apply_engine(module: nn.Module, spec, runs_on, engine) -> None:
    if engine is not None:
        runs_on.apply(module, spec, engine)


def apply_dp(module: nn.Module, spec, mesh, parallel_cfg, runs_on, precision) -> None:
    if parallel_cfg.dp > 1:
        _fsdp(module, mesh["dp"], parallel_cfg.dp_mode, spec.blocks(module),
              reshard_after_forward=runs_on.reshard_after_forward and not split_backward(parallel_cfg),
              mp_policy=precision.fsdp_policy())


def split_backward(parallel_cfg) -> bool:
    """The pipeline schedule splits each backward into an input and a weight pass (zero-bubble). torch's input
    pass (stage_backward_input) records which of the stage's registered parameters the weight pass computes
    gradients for before autograd runs: FSDP2's pre-backward hook gathers them only later, so parameters resharded
    after forward are the sharded ones, outside the graph, and the weight pass gives them no gradient (on gloo,
    torch 2.13: every microbatch's on the last stage, the first microbatch's on the others, silently). Kept gathered
    from forward to the schedule's REDUCE_GRAD (as TorchTitan does under any pipeline), they are the graph's own."""
    return parallel_cfg.pp > 1 and SCHEDULES[parallel_cfg.pp_schedule].split_backward


def apply_precision(module: nn.Module, cfg, device, precision: mixed.Precision) -> None:
    mixed.switch_tf32(cfg, device)
    mixed.autocast_forward(module, precision)
