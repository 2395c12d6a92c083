"""engine=ort's share of the transform stage: for each unit of a block (the compute between tensor-parallel
collectives, exported by the export stage), the configured passes, the hp partition and the graph ORT trains."""
from __future__ import annotations

from pathlib import Path

import onnx

from plugins.engines.ort.graphs import OrtGraphError, build_gradient_graph, param_inputs, partition_for_hp
from plugins.models import build_on_meta, get_model
from plugins.onnx.passes import apply_passes
from storage.fsio import atomic_write_json


def prepare(cfg, plan: dict, export: Path, out: Path, log, tracker) -> None:
    """For each unit of a block: the configured passes, the hp partition (shard-local parameter shapes,
    checked by running the graph), and the fw+bw graph ORT trains. A unit ORT cannot build is recorded
    as a fallback to torch (engine.fallback=torch) or fails the stage with ORT's message."""
    spec = get_model(cfg.model.name)
    model = build_on_meta(spec, cfg.model)
    names = {id(m): n for n, m in model.named_modules()}
    prefix = names[id(spec.blocks(model)[0])] + "."
    x_shape = list(spec.block_inputs(cfg.model, 2, 8)[0].shape)
    out.mkdir()
    for unit in spec.units:
        graph = onnx.load(export / "units" / f"{unit.name}.onnx")
        passes = apply_passes(graph, list(cfg.transform.passes))
        params = param_inputs(graph, ["x"])
        shards = {n: plan["parameters"][prefix + n]["shard_shape"] for n in params}
        replicated = [n for n in params if not plan["parameters"][prefix + n]["is_partitioned"]]
        record = {"params": params, "replicated": replicated, "bias": unit.bias, "passes": passes}
        try:
            record["partitioned_inputs"] = partition_for_hp(graph, shards, ["x"], {"x": x_shape}, unit.name)
            grad_model, record["agent"] = build_gradient_graph(graph, ["x"], ["x"], unit.name)
        except OrtGraphError as e:
            if cfg.engine.fallback != "torch":
                raise
            record["fallback"] = str(e)
            log.warning("unit %s will run on torch (engine.fallback=torch): %s", unit.name, e)
            tracker.set_tags({f"engine.fallback.{unit.name}": str(e)[:4000]})
        else:
            onnx.save(graph, out / f"{unit.name}.onnx")
            (out / f"{unit.name}.grad.onnx").write_bytes(grad_model)
            log.info("unit %s: %d parameter input(s) partitioned for hp=%d, gradient graph built",
                     unit.name, record["partitioned_inputs"], plan["layout"]["hp"])
        atomic_write_json(out / f"{unit.name}.json", record)
