"""export: the model from its registry entry -> ONNX (TorchScript exporter), checked in an ONNX runtime.

Writes the training graph of the whole model (parameters as graph inputs), and one graph per unit of a
block (attention, MLP: what the ONNX Runtime engine trains; every layer has the same structure, so one
export serves all), each with its input/output schema and a record of its check. The key holds only what
shapes the graphs: the model config, the export options, the opset and this code; batch and sequence
length are dynamic axes.
"""
from __future__ import annotations

import onnx
import torch

from plugins.fsio import atomic_write_json, read_json
from plugins.models import build_on_meta, get_model
from plugins.models.registry import materialise
from plugins.onnx.exporter import export_model, export_unit
from stages.base import Stage, StageContext


def export(ctx: StageContext) -> None:
    mcfg, ecfg, opset = ctx.cfg.model, ctx.cfg.export, ctx.cfg.engine.opset
    verbose = ctx.cfg.engine.get("log_level") == "VERBOSE"
    spec = get_model(mcfg.name)
    model = materialise(build_on_meta(spec, mcfg), torch.device("cpu"))  # torch's default init would be overwritten
    spec.init_weights(model, mcfg, seed=0)  # weights are graph inputs: their values do not enter the graph
    graph, schema, record = export_model(model, spec, mcfg, ecfg, opset, params_as_inputs=True, verbose=verbose)
    onnx.save(graph, ctx.out / "model.onnx")
    atomic_write_json(ctx.out / "io_schema.json", schema.to_json())
    records = {"model": record}
    block = spec.blocks(model)[0]
    (ctx.out / "units").mkdir()
    for unit in spec.units:
        graph, schema, records[unit.name] = export_unit(unit.core(block), spec, mcfg, ecfg, opset, verbose)
        onnx.save(graph, ctx.out / "units" / f"{unit.name}.onnx")
        atomic_write_json(ctx.out / "units" / f"{unit.name}.io_schema.json", schema.to_json())
    atomic_write_json(ctx.out / "export.json", records)
    for name, r in records.items():
        ctx.tracker.log_metrics({f"{name}/export_s": r["export_s"], f"{name}/check_max_abs_diff": r["check"]["max_abs_diff"]})
        ctx.log.info("exported %s: %d nodes (opset %d) in %.2fs; %s vs torch max|diff| %.2e",
                     name, r["nodes"], opset, r["export_s"], r["check"]["runtime"], r["check"]["max_abs_diff"])
    ctx.tracker.log_artifact(ctx.out / "model.onnx")
    ctx.tracker.log_artifact(ctx.out / "io_schema.json")


def _summary(out) -> str:
    records = read_json(out / "export.json")
    worst = max(r["check"]["max_abs_diff"] for r in records.values())
    runtime = records["model"]["check"].get("runtime", "onnxruntime").split()[0]
    return f"{records['model']['nodes']} nodes + {len(records) - 1} unit graphs, {runtime} check {worst:.1e}"


STAGE = Stage(
    name="export",
    run=export,
    reads=("model", "export", "engine.opset"),
    code=("plugins.models", "plugins.onnx"),
    summary=_summary,
)
