"""transform: ONNX passes on the exported graph, and the partition plan of the layout.

The passes (transform.passes, in order) run on the exported graphs; with engine=ort every unit graph is
then given the layout's shard-local parameter shapes and turned into the forward+backward graph ONNX
Runtime trains. The plan says, for the layout in `parallel`, how every parameter is split and placed. The train stage
builds its layout from this plan, and every checkpoint manifest carries it.
"""
from __future__ import annotations

import time

import onnx

from plugins.engines.ort.graphs import OrtGraphError, build_gradient_graph, param_inputs, partition_for_hp
from storage.fsio import atomic_write_json, read_json
from plugins.models import build_on_meta, get_model
from plugins.onnx.passes import apply_passes
from planning.partition import build_plan
from stages.base import Stage, StageContext


def transform(ctx: StageContext) -> None:
    t0 = time.perf_counter()
    graph = onnx.load(ctx.inputs["export"] / "model.onnx")
    results = apply_passes(graph, list(ctx.cfg.transform.passes))
    onnx.save(graph, ctx.out / "model.onnx")
    atomic_write_json(ctx.out / "passes.json", results)
    for name, result in results.items():
        ctx.log.info("pass %s: %s", name, result)

    plan = build_plan(ctx.cfg.model, ctx.cfg.parallel)
    atomic_write_json(ctx.out / "partition_plan.json", plan)
    if ctx.cfg.engine.name == "ort":
        _ort_units(ctx, plan)
    (ctx.out / "io_schema.json").write_text((ctx.inputs["export"] / "io_schema.json").read_text())
    partitioned = sum(p["is_partitioned"] for p in plan["parameters"].values())
    ctx.tracker.log_metrics({"transform_s": time.perf_counter() - t0, "partitioned_parameters": partitioned})
    ctx.tracker.log_artifact(ctx.out / "partition_plan.json")
    ctx.log.info("partition plan: %d parameters (%d partitioned across hp=%d), %d pipeline stage(s)",
                 len(plan["parameters"]), partitioned, plan["layout"]["hp"], len(plan["pipeline"]))


def _ort_units(ctx: StageContext, plan: dict) -> None:
    """For each unit of a block: the configured passes, the hp partition (shard-local parameter shapes,
    checked by running the graph), and the fw+bw graph ORT trains. A unit ORT cannot build is recorded
    as a fallback to torch (engine.fallback=torch) or fails the stage with ORT's message."""
    cfg = ctx.cfg
    spec = get_model(cfg.model.name)
    model = build_on_meta(spec, cfg.model)
    names = {id(m): n for n, m in model.named_modules()}
    prefix = names[id(spec.blocks(model)[0])] + "."
    x_shape = list(spec.block_inputs(cfg.model, 2, 8)[0].shape)
    out = ctx.out / "ort"
    out.mkdir()
    for unit in spec.units:
        graph = onnx.load(ctx.inputs["export"] / "units" / f"{unit.name}.onnx")
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
            ctx.log.warning("unit %s will run on torch (engine.fallback=torch): %s", unit.name, e)
            ctx.tracker.set_tags({f"engine.fallback.{unit.name}": str(e)[:4000]})
        else:
            onnx.save(graph, out / f"{unit.name}.onnx")
            (out / f"{unit.name}.grad.onnx").write_bytes(grad_model)
            ctx.log.info("unit %s: %d parameter input(s) partitioned for hp=%d, gradient graph built",
                         unit.name, record["partitioned_inputs"], plan["layout"]["hp"])
        atomic_write_json(out / f"{unit.name}.json", record)


def _summary(out) -> str:
    plan = read_json(out / "partition_plan.json")
    lay = plan["layout"]
    return (f"{len(read_json(out / 'passes.json'))} pass(es); plan dp{lay['dp']} hp{lay['hp']} pp{lay['pp']}, "
            f"{plan['n_parameters']:,} params")


STAGE = Stage(
    name="transform",
    run=transform,
    after=("export",),
    reads=("model", "parallel", "transform", "engine"),
    summary=_summary,
)
