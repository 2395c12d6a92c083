"""export: the model from its registry entry -> ONNX (TorchScript exporter), checked in an ONNX runtime.

Writes the training graph of the whole model (parameters as graph inputs), and one graph per unit of a
block (attention, MLP: what the ONNX Runtime engine trains; every layer has the same structure, so one
export serves all), each with its input/output schema and a record of its check. A model whose weights exceed
CHECK_WEIGHTS_BYTES is traced on the meta device (the same graph, byte for byte, with no weights in memory) and
checked on a two-layer twin: the stage's memory does not grow with the model. The key holds only what
shapes the graphs: the model config, the export options, the opset and this code; batch and sequence
length are dynamic axes.
"""
from __future__ import annotations

import onnx
import torch
from omegaconf import OmegaConf

from storage.fsio import atomic_write_json, read_json
from plugins.models import build_on_meta, get_model
from plugins.models.registry import materialise
from plugins.onnx.exporter import CHECK_WEIGHTS_BYTES, export_model, export_module, export_unit
from stages.base import Stage, StageContext


def export(ctx: StageContext) -> None:
    mcfg, ecfg, opset = ctx.cfg.model, ctx.cfg.export, ctx.cfg.engine.opset
    verbose = ctx.cfg.engine.get("log_level") == "VERBOSE"
    spec = get_model(mcfg.name)
    weights = sum(p.numel() * 4 for p in build_on_meta(spec, mcfg).parameters())
    # the check needs weights: the model's own up to CHECK_WEIGHTS_BYTES, else a twin with two of its layers (the
    # graph differs only in how often the block repeats, and the unit graphs below check the block itself; the
    # whole graph is checked again with the trained weights when the aggregate stage makes the inference model)
    checked_cfg = mcfg if weights <= CHECK_WEIGHTS_BYTES else OmegaConf.merge(mcfg, {"n_layers": min(2, mcfg.n_layers)})
    model = materialise(build_on_meta(spec, checked_cfg), torch.device("cpu"))  # torch's default init is not needed
    spec.init_weights(model, checked_cfg, seed=0)  # weights are graph inputs: their values do not enter the graph
    graph, schema, record = export_model(model, spec, checked_cfg, ecfg, opset, params_as_inputs=True, verbose=verbose)
    record["checked_on"] = "the model" if checked_cfg is mcfg else \
        f"a {checked_cfg.n_layers}-layer twin (the model's {weights / 2**30:,.1f} GB of weights are checked at aggregate)"
    if checked_cfg is not mcfg:  # the model's own graph, traced on the meta device: no weights at all
        inputs = tuple(t.to("meta") for t in spec.example_inputs(mcfg, ecfg.sample_batch, ecfg.sample_seq))
        graph, schema = export_module(build_on_meta(spec, mcfg), inputs, spec.input_names, spec.output_names,
                                      spec.dynamic_axes, opset, params_as_inputs=True, verbose=verbose)
        record.update(nodes=len(graph.graph.node), graph_inputs=len(graph.graph.input))
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
    summary=_summary,
)
