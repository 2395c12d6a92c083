"""Installing the ONNX Runtime engine on a model's blocks.

Each block gets `block.engine = OrtBlockEngine(...)`: for a unit, it feeds the block's live parameters
(local shards of DTensors; FSDP has unsharded them for the block's forward) and the unit input to the unit's
ORT graph, between Megatron's f and g when tensor parallelism is on, and adds the row-parallel bias after the
reduction. Parameters every hp rank holds whole (the unit's LayerNorm) also pass through f: inside the
unit each rank sees only its heads' share of their gradient, and f sums the shares. Units ORT could not build run on torch (engine.fallback=torch) and are reported.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from plugins.engines.ort.graphs import OrtGraphError
from plugins.engines.ort.megatron import CopyToHP, ReduceFromHP
from plugins.engines.ort.runtime import SEVERITY, OrtUnit
from storage.fsio import read_json


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


class OrtBlockEngine:
    def __init__(self, units: dict[str, OrtUnit], records: dict[str, dict], hp_group):
        self.units, self.records, self.hp_group = units, records, hp_group

    def __call__(self, name: str, block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        unit = self.units.get(name)
        if unit is None:  # this unit falls back to torch
            return block.torch_unit(name, x)
        record = self.records[name]
        params = [_local(block.get_parameter(n)) for n in record["params"]]
        if self.hp_group is not None:
            x = CopyToHP.apply(x, self.hp_group)
            replicated = set(record["replicated"])
            params = [CopyToHP.apply(p, self.hp_group) if n in replicated else p
                      for n, p in zip(record["params"], params)]
        y = unit.apply(x, *params)
        if self.hp_group is not None:
            y = ReduceFromHP.apply(y, self.hp_group)
        if record["bias"] is not None and _has_parameter(block, record["bias"]):
            y = y + _local(block.get_parameter(record["bias"]))
        return y


def _has_parameter(module: torch.nn.Module, name: str) -> bool:
    try:
        return module.get_parameter(name) is not None
    except AttributeError:
        return False


def build(spec, ort_dir: Path, engine_cfg, hp_group, device: torch.device, rank: int):
    """The engine for a model's blocks, from the transform stage's graphs: (engine, {unit: why it runs on torch})."""
    import onnxruntime as ort

    level = SEVERITY[engine_cfg.log_level]
    severity = level if rank == 0 or engine_cfg.log_level in ("DEVINFO", "VERBOSE") else 3  # INFO: rank 0 only
    threads = engine_cfg.intra_op_threads or torch.get_num_threads()
    ort.set_seed(engine_cfg.seed)
    units, records, fallbacks = {}, {}, {}
    for unit in spec.units:
        record = read_json(ort_dir / f"{unit.name}.json")
        records[unit.name] = record
        if "fallback" in record:
            fallbacks[unit.name] = record["fallback"]
            continue
        try:
            units[unit.name] = OrtUnit((ort_dir / f"{unit.name}.grad.onnx").read_bytes(), record["agent"], threads,
                                       severity, device)
        except OrtGraphError as e:
            if engine_cfg.fallback != "torch":
                raise
            fallbacks[unit.name] = str(e)
    return OrtBlockEngine(units, records, hp_group), fallbacks


def apply(module: torch.nn.Module, spec, engine: OrtBlockEngine) -> None:
    """Every block of the module runs its units through the engine (parameters are read at each forward: the
    module may still be on the meta device)."""
    for block in spec.blocks(module):
        block.engine = engine


def install(parts: list[torch.nn.Module], spec, ort_dir: Path, engine_cfg, hp_group, device: torch.device,
            rank: int) -> dict[str, str]:
    """Put the engine on every block of these modules; returns {unit: why it runs on torch}."""
    engine, fallbacks = build(spec, ort_dir, engine_cfg, hp_group, device, rank)
    for part in parts:
        apply(part, spec, engine)
    return fallbacks


def report(ctx, spec, fallbacks: dict[str, str], ort_dir: Path) -> None:
    """The units that run on torch into the log and the tracker (with engine.save_onnx, the graphs too)."""
    for unit, why in fallbacks.items():
        ctx.log.warning("engine=ort: unit %s runs on torch (engine.fallback=torch): %s", unit, why)
    ctx.tracker.set_tags({"engine": "ort", **{f"engine.fallback.{u}": why[:4000] for u, why in fallbacks.items()}})
    ctx.tracker.log_metrics({"engine/ort_units": len(spec.units) - len(fallbacks), "engine/fallback_units": len(fallbacks)})
    if ctx.cfg.engine.save_onnx:
        for graph in graph_files(ort_dir):
            ctx.tracker.log_artifact(graph, "onnx")
            ctx.log.info("engine.save_onnx: %s", graph)


def graph_files(ort_dir: Path) -> list[Path]:
    """The graphs the engine runs (for engine.save_onnx)."""
    return sorted(p for p in Path(ort_dir).glob("*.onnx") if p.is_file()) if os.path.isdir(ort_dir) else []
