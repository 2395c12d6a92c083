"""transform: ONNX passes on the exported graph, and the partition plan of the layout.

The passes (transform.passes, in order) run on the exported graphs; with engine=ort every unit graph is
then given the layout's shard-local parameter shapes and turned into the forward+backward graph ONNX
Runtime trains. The plan says, for the layout in `parallel`, how every parameter is split and placed. The train stage
builds its layout from this plan, and every checkpoint manifest carries it.
"""
from __future__ import annotations

import time

import onnx

from plugins.engines import get_engine
from storage.fsio import atomic_write_json, read_json
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

    plan = build_plan(ctx.cfg.model, ctx.cfg.parallel, ctx.cfg.peft)
    atomic_write_json(ctx.out / "partition_plan.json", plan)
    engine = get_engine(ctx.cfg.engine.name)
    if engine.prepare is not None:
        engine.prepare(ctx.cfg, plan, ctx.inputs["export"], ctx.out / ctx.cfg.engine.name, ctx.log, ctx.tracker)
    (ctx.out / "io_schema.json").write_text((ctx.inputs["export"] / "io_schema.json").read_text())
    partitioned = sum(p["is_partitioned"] for p in plan["parameters"].values())
    ctx.tracker.log_metrics({"transform_s": time.perf_counter() - t0, "partitioned_parameters": partitioned})
    ctx.tracker.log_artifact(ctx.out / "partition_plan.json")
    ctx.log.info("partition plan: %d parameters (%d partitioned across hp=%d), %d pipeline stage(s)",
                 len(plan["parameters"]), partitioned, plan["layout"]["hp"], len(plan["pipeline"]))


def _summary(out) -> str:
    plan = read_json(out / "partition_plan.json")
    lay = plan["layout"]
    return (f"{len(read_json(out / 'passes.json'))} pass(es); plan dp{lay['dp']} hp{lay['hp']} pp{lay['pp']}, "
            f"{plan['n_parameters']:,} params")


STAGE = Stage(
    name="transform",
    run=transform,
    after=("export",),
    reads=("model", "parallel", "transform", "engine", "peft"),
    summary=_summary,
)
