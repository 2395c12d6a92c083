"""PyTorch -> ONNX with the TorchScript exporter, and a numerical check of the result in an ONNX runtime:
ONNX Runtime when it is installed (either build), else onnx's own reference evaluator (numpy; slower, same
numbers), so that the core install needs no ONNX Runtime at all.

Two kinds of graph:
- training graphs (`params_as_inputs=True`): parameters are graph inputs named by their module names,
  dropout in training mode, no constant folding: what ONNX Runtime's training engine consumes;
- inference graphs (`params_as_inputs=False`): weights embedded, eval mode: a self-contained model. At any size,
  `save_inference` makes one from a training graph instead: dropout off, the weights written in afterwards one at a
  time (plugins/onnx/weights.py; external data above a threshold), so no model is held to make it.

The module is wrapped so the exporter sees flat tensors; the IOSchema restores the module's nesting.
"""
from __future__ import annotations

import copy
import io
import warnings
from pathlib import Path
from typing import Callable, Sequence, Union

import numpy as np
import onnx
import torch
from torch import nn

from plugins.onnx.io_schema import IOSchema, flatten, unflatten
from plugins.onnx.passes import dropout_inference
from plugins.onnx.weights import embed

_WRAPPED = "module."
CHECK_WEIGHTS_BYTES = 2**30  # the export stage checks the whole graph with the model's own weights up to this size


class _FlatModule(nn.Module):
    """Flat tensors in, flat tensors out, around a module that takes and returns nests."""

    def __init__(self, module: nn.Module, schema: IOSchema):
        super().__init__()
        self.module = module
        self.schema = schema

    def forward(self, *flat):
        out = self.module(*unflatten(self.schema.inputs, list(flat)))
        return tuple(flatten(out, "out")[0])


def describe(module: nn.Module, args: tuple, input_names: Sequence[str], output_names: Sequence[str],
             dynamic_axes: dict[str, dict[int, str]]) -> IOSchema:
    """Run the module once on example args and record the schema of its inputs and outputs."""
    _, inputs = flatten(tuple(args), "input", dynamic_axes, item_names=list(input_names))
    with torch.no_grad():
        out = module(*args)
    # one name per top-level output when they match; otherwise a single name prefixes the whole nest
    per_item = isinstance(out, (tuple, list)) and len(output_names) == len(out) and len(output_names) > 1
    _, outputs = flatten(out, "output" if per_item else output_names[0], dynamic_axes,
                         item_names=list(output_names) if per_item else None)
    return IOSchema(inputs, outputs)


def _strip_wrapper_prefix(model: onnx.ModelProto) -> None:
    """Graph inputs of the wrapped module are called `module.<name>`: give them back their module names."""
    renames = {i.name: i.name[len(_WRAPPED):] for i in model.graph.input if i.name.startswith(_WRAPPED)}
    renames.update({i.name: i.name[len(_WRAPPED):] for i in model.graph.initializer if i.name.startswith(_WRAPPED)})
    for value in list(model.graph.input) + list(model.graph.initializer):
        value.name = renames.get(value.name, value.name)
    for node in model.graph.node:
        for k, name in enumerate(node.input):
            if name in renames:
                node.input[k] = renames[name]


def export_module(module: nn.Module, args: tuple, input_names: Sequence[str], output_names: Sequence[str],
                  dynamic_axes: dict[str, dict[int, str]], opset: int, params_as_inputs: bool, verbose: bool = False
                  ) -> tuple[onnx.ModelProto, IOSchema]:
    schema = describe(module, args, input_names, output_names, dynamic_axes)
    flat_args, _ = flatten(tuple(args), "input", item_names=list(input_names))
    f = io.BytesIO()
    was_training = module.training
    module.train(params_as_inputs)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notices
            torch.onnx.export(
                _FlatModule(module, schema), tuple(flat_args), f, dynamo=False,
                input_names=schema.input_names, output_names=schema.output_names,
                dynamic_axes=schema.dynamic_axes, opset_version=opset, do_constant_folding=not params_as_inputs,
                training=torch.onnx.TrainingMode.TRAINING if params_as_inputs else torch.onnx.TrainingMode.EVAL,
                export_params=not params_as_inputs, keep_initializers_as_inputs=params_as_inputs, verbose=verbose)
    finally:
        module.train(was_training)
    model = onnx.load_model_from_string(f.getvalue())
    _strip_wrapper_prefix(model)
    return model, schema


def parameter_feeds(module: nn.Module, model: onnx.ModelProto) -> dict[str, torch.Tensor]:
    """The module's parameters and buffers that the graph takes as inputs, by graph input name."""
    named = {**dict(module.named_buffers()), **dict(module.named_parameters())}
    return {i.name: named[i.name] for i in model.graph.input if i.name in named}


def check_runtime() -> str:
    """What runs graphs for the export check: 'onnxruntime <version>' or 'onnx.reference'."""
    try:
        import onnxruntime
    except ImportError:
        return "onnx.reference"
    return f"onnxruntime {onnxruntime.__version__}"


def run_graph(model: Union[onnx.ModelProto, Path], feeds: dict[str, torch.Tensor], threads: int = 1) -> list[np.ndarray]:
    """The graph's outputs for these inputs, in ONNX Runtime if installed, else in onnx's reference evaluator. A
    path is opened where it lies, so that its external data is found beside it."""
    try:
        import onnxruntime as ort
    except ImportError:
        from onnx.reference import ReferenceEvaluator

        session = ReferenceEvaluator(str(model) if isinstance(model, Path) else model)
        wanted = set(session.input_names)
        return session.run(None, {k: v.detach().cpu().numpy() for k, v in feeds.items() if k in wanted})
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    source = str(model) if isinstance(model, Path) else model.SerializeToString()
    session = ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])
    wanted = {i.name for i in session.get_inputs()}
    return session.run(None, {k: v.detach().cpu().numpy() for k, v in feeds.items() if k in wanted})


def max_abs_diff(model: onnx.ModelProto, schema: IOSchema, module: nn.Module, args: tuple) -> float:
    """Run the graph (run_graph) and the module in torch (eval mode) on args; max |difference| of outputs.

    A training graph is checked through its inference view (dropout off), fed the module's parameters."""
    if any(n.op_type == "Dropout" for n in model.graph.node):
        model = copy.deepcopy(model)
        dropout_inference(model)
    flat_args, _ = flatten(tuple(args), "input")
    feeds = dict(zip(schema.input_names, flat_args))
    feeds.update(parameter_feeds(module, model))
    got = run_graph(model, feeds)
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            want, _ = flatten(module(*args), "out")
    finally:
        module.train(was_training)
    return _max_diff(got, want)


def export_checked(module: nn.Module, make_inputs, input_names: Sequence[str], output_names: Sequence[str],
                   dynamic_axes: dict[str, dict[int, str]], export_cfg, opset: int, max_seq: int,
                   params_as_inputs: bool, verbose: bool = False) -> tuple[onnx.ModelProto, IOSchema, dict]:
    """Export a module traced on make_inputs(batch, seq) and check the graph (run_graph) on other shapes
    than the traced ones (which proves the dynamic axes as well as the numbers). Raises when the check fails."""
    import time

    t0 = time.perf_counter()
    graph, schema = export_module(module, make_inputs(export_cfg.sample_batch, export_cfg.sample_seq), input_names,
                                  output_names, dynamic_axes, opset, params_as_inputs=params_as_inputs,
                                  verbose=verbose)
    export_s = time.perf_counter() - t0
    batch, seq = check_shape(export_cfg, max_seq)
    t0 = time.perf_counter()
    diff = max_abs_diff(graph, schema, module, make_inputs(batch, seq))
    if not diff <= export_cfg.verify_atol:
        raise RuntimeError(f"ONNX check failed: max |outputs({check_runtime()}) - outputs(torch)| = {diff:.3g} exceeds "
                           f"export.verify_atol={export_cfg.verify_atol} (batch {batch}, sequence {seq})")
    record = {"opset": opset, "ir_version": graph.ir_version, "nodes": len(graph.graph.node),
              "graph_inputs": len(graph.graph.input), "export_s": export_s, "check_s": time.perf_counter() - t0,
              "check": {"max_abs_diff": diff, "atol": export_cfg.verify_atol, "batch": batch, "sequence": seq,
                        "runtime": check_runtime()}}
    return graph, schema, record


def export_model(module: nn.Module, spec, model_cfg, export_cfg, opset: int, params_as_inputs: bool,
                 verbose: bool = False) -> tuple[onnx.ModelProto, IOSchema, dict]:
    """The whole registry model: token ids in, logits out."""
    return export_checked(module, lambda b, t: spec.example_inputs(model_cfg, b, t), spec.input_names,
                          spec.output_names, spec.dynamic_axes, export_cfg, opset, model_cfg.max_seq_len,
                          params_as_inputs, verbose)


def check_shape(export_cfg, max_seq: int) -> tuple[int, int]:
    """(batch, sequence) of the inputs an exported graph is checked on: other than the traced ones, which proves the
    dynamic axes as well as the numbers."""
    return export_cfg.sample_batch + 1, min(2 * export_cfg.sample_seq + 3, max_seq)


def save_inference(graph: onnx.ModelProto, schema: IOSchema, weight: Callable[[str], torch.Tensor], args: tuple,
                   reference: list[torch.Tensor], export_cfg, path: Path, external_above_bytes: int) -> dict:
    """A training graph (parameters as inputs, from export_model) turned into a self-contained inference model at
    path, at any size: dropout in inference mode, the weights written in one at a time from weight(name) (inside, or
    as external data above external_above_bytes: plugins/onnx/weights.py), then run in ONNX Runtime from its file on
    `args` (of check_shape's shape) and checked against `reference`, the torch model's outputs for them. Nothing here
    holds the model: the caller makes the reference as it likes (one piece at a time)."""
    import time

    t0 = time.perf_counter()
    dropout_inference(graph)
    params = [i.name for i in graph.graph.input if i.name not in set(schema.input_names)]
    stored = embed(graph, params, weight, path, external_above_bytes)
    save_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    batch, seq = tuple(args[0].shape[:2])
    flat_args, _ = flatten(tuple(args), "input")
    got = run_graph(Path(path), dict(zip(schema.input_names, flat_args)))
    want, _ = flatten(reference, "out")
    diff = _max_diff(got, want)
    if not diff <= export_cfg.verify_atol:
        raise RuntimeError(f"ONNX check failed: max |outputs({check_runtime()}) - outputs(torch)| = {diff:.3g} exceeds "
                           f"export.verify_atol={export_cfg.verify_atol} (batch {batch}, sequence {seq})")
    return {"nodes": len(graph.graph.node), "save_s": save_s, "check_s": time.perf_counter() - t0,
            "weights_bytes": stored["bytes"], "external_data": stored["external_data"],
            "check": {"max_abs_diff": diff, "atol": export_cfg.verify_atol, "batch": batch, "sequence": seq,
                      "runtime": check_runtime()}}


def _max_diff(got: list[np.ndarray], want: list[torch.Tensor]) -> float:
    if len(got) != len(want):
        raise AssertionError(f"graph returns {len(got)} outputs, the module {len(want)}")
    return max(float(np.abs(g - w.detach().numpy()).max()) for g, w in zip(got, want))


UNIT_AXES = {"x": {0: "batch", 1: "sequence"}, "y": {0: "batch", 1: "sequence"}}


def export_unit(core: nn.Module, spec, model_cfg, export_cfg, opset: int, verbose: bool = False
                ) -> tuple[onnx.ModelProto, IOSchema, dict]:
    """One unit of a block (hidden states x in, y out), parameters as graph inputs named as in the block."""
    return export_checked(core, lambda b, t: spec.block_inputs(model_cfg, b, t), ["x"], ["y"], UNIT_AXES,
                          export_cfg, opset, model_cfg.max_seq_len, params_as_inputs=True, verbose=verbose)
