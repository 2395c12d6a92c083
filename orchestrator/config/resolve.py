"""`auto` values made concrete, before planning, for the machine the stages will run on: they enter cache keys and
the run's config.yaml as what actually ran.

precision=auto: bf16 where the train stage gets a CUDA GPU with bf16, else fp32 (engine=ort: fp32). On SLURM the
login node's devices say nothing of the compute nodes': GPUs requested (cluster.gpus_per_task) mean bf16 (pick
precision=fp16 or fp32 for GPUs older than Ampere).
"""
from __future__ import annotations

from omegaconf import DictConfig


def resolve_auto(cfg: DictConfig) -> list[str]:
    """Fill in the config's `auto` values in place; one line per choice made, for the plan."""
    from plugins.engines import engine_names, get_engine
    from runtime.precision import auto_precision

    notes = []
    if cfg.precision.name == "auto":
        if cfg.cluster.name == "slurm":
            gpus = bool(cfg.cluster.get("gpus_per_task"))
            cuda, bf16 = gpus, gpus
        else:
            import torch

            cuda = torch.cuda.is_available()
            bf16 = cuda and torch.cuda.is_bf16_supported()
        # an engine not registered is refused by validation, which runs after this
        mixed = cfg.engine.name not in engine_names() or get_engine(cfg.engine.name).mixed_precision
        name, why = auto_precision(cuda, bf16, cfg.engine.name, mixed)
        cfg.precision.name = name
        notes.append(f"precision=auto: {name} ({why})")
    return notes
