"""The partition plan: where every parameter lives in a dp x hp x pp layout.

For each parameter (by name, identical in every layout): its full shape, the axis split across hp ranks
(or none), the partition style, whether the weight itself is partitioned, its shard shape, the pipeline
stages that hold it, and the parameter it is tied to. This is the record ONNX Runtime's Megatron
checkpointing keeps (original_dim, partition axis, is_partitioned), extended with pipeline placement.
"""
from __future__ import annotations

import copy

from plugins.models.lora import apply_lora
from plugins.models import build_on_meta, get_model
from plugins.parallel.schedules import SCHEDULES


def pipeline_stages(n_layers: int, pp: int, chunks: int, schedule: str) -> list[dict]:
    """Stage s holds a contiguous run of layers; ranks take stages round-robin (loop) or in a V (zbv)."""
    n_stages = pp * chunks
    per = n_layers // n_stages
    stages = []
    for s in range(n_stages):
        rank = (s if s < pp else 2 * pp - 1 - s) if SCHEDULES[schedule].v_shape else s % pp
        stages.append({"stage": s, "rank": rank, "chunk": s // pp, "layers": list(range(s * per, (s + 1) * per)),
                       "embedding": s == 0, "head": s == n_stages - 1})
    return stages


def build_plan(model_cfg, parallel_cfg, peft_cfg=None) -> dict:
    """peft_cfg (peft=lora): the adapters are parameters of the plan, and each parameter says whether it trains."""
    stages = pipeline_stages(model_cfg.n_layers, parallel_cfg.pp, parallel_cfg.pp_chunks, parallel_cfg.pp_schedule)
    spec = get_model(model_cfg.name)
    full = build_on_meta(spec, model_cfg)
    if peft_cfg is not None and peft_cfg.name == "lora":
        apply_lora(full, peft_cfg)
    holders: dict[str, list[int]] = {}
    for st in stages:
        module = spec.split(copy.deepcopy(full), st["layers"], st["embedding"], st["head"])
        for name, _ in module.named_parameters(remove_duplicate=False):
            holders.setdefault(name, []).append(st["stage"])

    first_name: dict[int, str] = {}
    hp = parallel_cfg.hp
    params = {}
    for name, p in full.named_parameters(remove_duplicate=False):
        part = spec.partition(name)
        partitioned = hp > 1 and part.axis is not None
        shard = list(p.shape)
        if partitioned:
            shard[part.axis] //= hp
        tied_to = first_name.setdefault(id(p), name)
        params[name] = {
            "shape": list(p.shape), "partition_axis": part.axis, "partition_name": part.style,
            "is_partitioned": partitioned, "shard_shape": shard, "pp_stages": holders.get(name, []),
            "tied_to": tied_to if tied_to != name else None, "trainable": p.requires_grad,
        }
    return {
        "layout": {"dp": parallel_cfg.dp, "hp": hp, "pp": parallel_cfg.pp, "dp_mode": parallel_cfg.dp_mode,
                   "pp_chunks": parallel_cfg.pp_chunks, "pp_schedule": parallel_cfg.pp_schedule,
                   "microbatches": parallel_cfg.microbatches,
                   "sequence_parallel": parallel_cfg.sequence_parallel, "loss_parallel": parallel_cfg.loss_parallel,
                   "world_size": parallel_cfg.dp * hp * parallel_cfg.pp},
        "pipeline": stages,
        "parameters": params,
        "n_parameters": sum(p.numel() for p in full.parameters()),
    }


def without_adapters(cfg) -> tuple:
    """(a copy of the config with peft=none, its partition plan in the run's layout): the model a preference
    objective's reference is built as (stages/reference.py, and the train stage's online reference), LoRA's base
    without its adapters."""
    import copy

    plain = copy.deepcopy(cfg)
    plain.peft.name = "none"
    return plain, build_plan(plain.model, plain.parallel, plain.peft)
