"""Filling a module's parameters from full weights: whole, or the shard a rank holds in any layout (tensor-parallel,
FSDP's, a pipeline stage), one tensor at a time; tied parameters found under any of their names. Used to initialise
(a weight drawn in full, then sharded), to import Hugging Face weights and to load aggregated checkpoints."""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn


def tied_aliases(plan: dict) -> dict[str, str]:
    """A partition plan's tied copies: parameter name -> the name of the weight it shares (e.g. lm_head.weight ->
    wte.weight); what load_full and the checkpoints need of the plan."""
    return {name: p["tied_to"] for name, p in plan["parameters"].items() if p["tied_to"]}


def tie_groups(module: nn.Module) -> list[tuple[list[str], nn.Parameter]]:
    """Every parameter once, with all the names it is reachable under (the first is named_parameters' name)."""
    groups: dict[int, tuple[list[str], nn.Parameter]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), ([], p))[0].append(name)
    return list(groups.values())


@torch.no_grad()
def set_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Give a parameter its part of the full value: all of it, or a DTensor's local shard under any placement
    (tensor-parallel, FSDP's, both), copied from a view of the full value at the shard's global offset (the
    offsets DCP records for every chunk it saves). Only this one parameter's full value exists beside the shards."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(full.shape, param.device_mesh, param.placements)
        for dim, (size, start) in enumerate(zip(shape, offset)):
            full = full.narrow(dim, start, size)
        param = param.to_local()
    param.copy_(full)


def load_full(module: nn.Module, weights, aliases: Optional[dict[str, str]] = None,
              leave: Optional[Callable[[str], bool]] = None) -> None:
    """Each parameter of module (whole or a shard of any layout) from full weights keyed by parameter name, read one
    at a time (weights may read each tensor when asked); a tied parameter from whichever of its names the weights
    hold, or from the weight it copies (aliases: a pipeline stage's head is `lm_head.weight`, stored as the
    `wte.weight` it is tied to). Every parameter must be found (none is left uninitialised) but those `leave` names
    (LoRA's adapters, which a base model's weights do not have)."""
    aliases = aliases or {}
    found, missing = [], []
    for names, param in tie_groups(module):
        if leave is not None and leave(names[0]):
            continue
        candidates = [*names, *(aliases[n] for n in names if n in aliases)]
        stored = next((n for n in candidates if n in weights), None)
        (missing if stored is None else found).append((names, stored, param))
    if missing:
        names = missing[0][0]
        raise KeyError(f"the weights lack {len(missing)} parameter(s) of this model, e.g. {names[0]}" +
                       (f" (tied: {', '.join(names[1:])})" if names[1:] else ""))
    for _, stored, param in found:
        set_full(param, weights[stored])


@torch.no_grad()
def set_constant(param: torch.Tensor, value: float) -> None:
    """A constant fill (norm scales, biases): every shard of it is the same, no full value needed."""
    from torch.distributed.tensor import DTensor

    (param.to_local() if isinstance(param, DTensor) else param).fill_(value)
