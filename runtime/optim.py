"""Optimizers and learning-rate schedules, built from the `optimizer` config section."""
from __future__ import annotations

import math

import torch
from torch import nn

from common.problem import Problem


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay weight matrices and embeddings; never biases or norm scales (nanoGPT's rule: dim >= 2).

    Each group is split by tensor kind: foreach kernels cannot mix DTensors (sharded by tensor parallelism)
    with plain tensors (replicated modules). Checkpoints do not see groups: optimizer state is saved per
    parameter, so layouts with other groupings read it alike."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = []
    for decay, wd in ((True, weight_decay), (False, 0.0)):
        chosen = [p for p in params if (p.dim() >= 2) == decay]
        for kind in sorted({type(p).__name__ for p in chosen}):
            groups.append({"params": [p for p in chosen if type(p).__name__ == kind], "weight_decay": wd})
    return groups


def _impl_kwargs(impl: str, params: list[torch.Tensor], device: torch.device) -> dict:
    """fused/foreach where torch offers it. On CUDA, torch's fused Adam/SGD kernels take DTensors too (DTensor
    shards them like any pointwise op); on CPU fused kernels are used for plain dense tensors only, and DTensors
    (sharded parameters on CPU: gloo) step one tensor at a time. DTensor works out the sharding of a foreach op for
    the whole list of tensors, on first use, by expanding every placement of every tensor over the mesh: a
    dp2_hp2_pp2 rank's first step took 8.7 s with foreach, 4.0 s one tensor at a time (2-core VM, gpt_tiny), and
    on a CPU the foreach kernels save no kernel launches; later steps take as long either way."""
    if impl == "for_loop":
        return {"foreach": False}
    if impl == "foreach":
        return {"foreach": True}
    from torch.distributed.tensor import DTensor

    kinds = (nn.Parameter, torch.Tensor, DTensor) if device.type == "cuda" else (nn.Parameter, torch.Tensor)
    fusable = all(type(p) in kinds for p in params) and all(
        p.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64) for p in params)
    if impl == "fused" and not fusable:
        raise ValueError("optimizer.impl=fused: these parameters (e.g. sharded DTensors) have no fused kernel; "
                         "use optimizer.impl=foreach or auto")
    if fusable:
        return {"fused": True}
    return {"foreach": device.type == "cuda" or not any(isinstance(p, DTensor) for p in params)}


def _adamw(cfg, groups: list[dict], kwargs: dict) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **kwargs)


def _sgd(cfg, groups: list[dict], kwargs: dict) -> torch.optim.Optimizer:
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov, **kwargs)


# The optimizers there are: optimizer.name -> (cfg, parameter groups, kernel kwargs) -> optimizer. Another one is an
# entry here and a conf/optimizer/<name>.yaml with its schema in orchestrator/config/schema/training.py.
OPTIMIZERS = {"adamw": _adamw, "sgd": _sgd}


def build_optimizer(cfg, model: nn.Module, device: torch.device = torch.device("cpu")) -> torch.optim.Optimizer:
    groups = _param_groups(model, cfg.weight_decay)
    kwargs = _impl_kwargs(cfg.impl, [p for g in groups for p in g["params"]], device)
    return OPTIMIZERS[cfg.name](cfg, groups, kwargs)


def describe_impl(optimizer: torch.optim.Optimizer) -> str:
    """Which kernel the optimizer runs: fused, foreach or for_loop."""
    d = optimizer.defaults
    return "fused" if d.get("fused") else "foreach" if d.get("foreach") else "for_loop"


def lr_factor(cfg, step: int, total_steps: int) -> float:
    """Multiplier of cfg.lr at a 0-based step: linear warm-up, then constant or cosine down to min_lr_ratio."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    span = max(total_steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def check(cfg) -> list:

    if cfg.optimizer.name not in OPTIMIZERS:
        return [Problem("optimizer.name", cfg.optimizer.name, f"the optimizers there are: {', '.join(OPTIMIZERS)} "
                        "(runtime/optim.py)", f"optimizer.name={next(iter(OPTIMIZERS))}, or add one to OPTIMIZERS")]
    betas = cfg.optimizer.get("betas")
    if betas is not None and (len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas)):
        return [Problem("optimizer.betas", list(betas), "Adam's betas are two decay rates, each in [0, 1)",
                        "optimizer.betas=[0.9,0.95]")]
    return []
