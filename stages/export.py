"""export: the model from its registry entry -> ONNX (TorchScript exporter), checked in ONNX Runtime.

Writes the training graph (parameters as graph inputs, as ONNX Runtime's training engine takes them),
its input/output schema, and a record of the check. The key holds only what shapes the graph: the model
config, the export options and this code; batch and sequence length are dynamic axes.
"""
from __future__ import annotations

import onnx

from plugins.fsio import atomic_write_json, read_json
from plugins.models import get_model
from plugins.onnx.exporter import export_checked
from stages.base import Stage, StageContext


def export(ctx: StageContext) -> None:
    mcfg = ctx.cfg.model
    spec = get_model(mcfg.name)
    model = spec.build(mcfg)
    spec.init_weights(model, mcfg, seed=0)  # weights are graph inputs: their values do not enter the graph
    graph, schema, record = export_checked(model, spec, mcfg, ctx.cfg.export, params_as_inputs=True)
    onnx.save(graph, ctx.out / "model.onnx")
    atomic_write_json(ctx.out / "io_schema.json", schema.to_json())
    atomic_write_json(ctx.out / "export.json", record)
    ctx.tracker.log_metrics({"export_s": record["export_s"], "check_s": record["check_s"],
                             "check_max_abs_diff": record["check"]["max_abs_diff"]})
    ctx.tracker.log_artifact(ctx.out / "model.onnx")
    ctx.tracker.log_artifact(ctx.out / "io_schema.json")
    ctx.log.info("exported %d nodes (opset %d) in %.2fs; onnxruntime vs torch max|diff| %.2e",
                 record["nodes"], record["opset"], record["export_s"], record["check"]["max_abs_diff"])


def _summary(out) -> str:
    r = read_json(out / "export.json")
    return f"{r['nodes']} nodes, opset {r['opset']}, ORT check {r['check']['max_abs_diff']:.1e}"


STAGE = Stage(
    name="export",
    run=export,
    reads=("model", "export"),
    code=("plugins.models", "plugins.onnx"),
    summary=_summary,
)
