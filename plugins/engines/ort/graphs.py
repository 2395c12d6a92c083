"""Graph-side work of the ONNX Runtime engine (run by the transform stage, cached with its output).

- `partition_for_hp`: give a unit graph's parameter inputs the shard-local shapes of the layout, and prove
  by running it in ONNX Runtime that nothing in the graph hard-codes a head count or hidden size;
- `build_gradient_graph`: ORT's OrtModuleGraphBuilder turns the forward graph into the combined forward
  and backward graph that TrainingAgent runs; what the agent needs to know about it is returned as JSON.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import onnx


class OrtGraphError(RuntimeError):
    """ONNX Runtime could not build or run a unit's graph; the message is ORT's."""


def param_inputs(model: onnx.ModelProto, user_inputs: Sequence[str]) -> list[str]:
    """Graph inputs that are parameters (everything except the unit's own inputs), in graph order."""
    return [i.name for i in model.graph.input if i.name not in user_inputs]


def _set_shape(value: onnx.ValueInfoProto, shape: Sequence[int]) -> None:
    dims = value.type.tensor_type.shape.dim
    del dims[:]
    for d in shape:
        dims.add().dim_value = int(d)


def partition_for_hp(model: onnx.ModelProto, shard_shapes: dict[str, list[int]], user_inputs: Sequence[str],
                     example_shapes: dict[str, list[int]], unit: str) -> int:
    """Set parameter inputs to their shard shapes; returns how many changed. Raises OrtGraphError, naming
    the unit, when the graph no longer runs (it hard-codes a size that tensor parallelism divides)."""
    changed = 0
    for value in model.graph.input:
        if value.name in shard_shapes:
            old = [d.dim_value for d in value.type.tensor_type.shape.dim]
            if old != list(shard_shapes[value.name]):
                _set_shape(value, shard_shapes[value.name])
                changed += 1
    if changed:
        # the exporter annotated intermediate tensors with the full model's shapes (e.g. the heads grouped-query
        # attention repeats): stale now, and ORT would plan buffers by them. Let it infer them from the inputs.
        del model.graph.value_info[:]
        _run_once(model, user_inputs, example_shapes, unit, shard_shapes)
    return changed


def _run_once(model: onnx.ModelProto, user_inputs, example_shapes, unit: str, shard_shapes) -> None:
    import onnxruntime as ort

    from plugins.onnx.passes import dropout_inference

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    dropout_inference(probe)
    feeds = {}
    for value in probe.graph.input:
        if value.name in user_inputs:
            shape = example_shapes[value.name]
        else:
            shape = [d.dim_value for d in value.type.tensor_type.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
        feeds[value.name] = np.random.default_rng(0).standard_normal(shape).astype(dtype)
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    try:
        ort.InferenceSession(probe.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(None, feeds)
    except Exception as e:  # ORT's own message is what the user needs
        raise OrtGraphError(
            f"the {unit} graph does not run with the shard-local parameter shapes of this layout "
            f"({', '.join(f'{k}: {v}' for k, v in list(shard_shapes.items())[:4])}, ...): it hard-codes a head "
            f"count or hidden size. Reshape with -1 (e.g. view(B, T, -1, head_dim)) so the local size is inferred. "
            f"ONNX Runtime said: {str(e).strip().splitlines()[0]}") from e


def build_gradient_graph(model: onnx.ModelProto, user_inputs: Sequence[str], inputs_requiring_grad: Sequence[str],
                         unit: str) -> tuple[bytes, dict]:
    """The fw+bw graph of a unit and the facts TrainingAgent needs about it. Raises OrtGraphError with ORT's
    message when ORT cannot differentiate an op of the graph."""
    from onnxruntime.capi import _pybind_state as C

    params = param_inputs(model, user_inputs)
    config = C.OrtModuleGraphBuilderConfiguration()
    config.initializer_names = params
    config.initializer_names_to_train = params
    config.input_names_require_grad = list(inputs_requiring_grad)
    config.build_gradient_graph = True
    config.enable_caching = False
    config.loglevel = C.Severity.FATAL
    config.use_memory_efficient_gradient = False
    builder = C.OrtModuleGraphBuilder()
    try:
        builder.initialize(model.SerializeToString(), config)
        transformers = C.TrainingGraphTransformerConfiguration()
        transformers.propagate_cast_ops_config = C.PropagateCastOpsConfiguration()
        transformers.propagate_cast_ops_config.level = -1
        transformers.enable_compute_optimizer = False
        transformers.enable_gelu_approximation = False  # would change the numbers (Gelu -> tanh approximation)
        builder.build(transformers)
    except Exception as e:
        raise OrtGraphError(f"ONNX Runtime cannot build the gradient graph of the {unit} graph: "
                            f"{str(e).strip().splitlines()[0]}") from e
    info = builder.get_graph_info()
    grad_model = builder.get_gradient_model()
    fw_inputs = [i.name for i in model.graph.input]
    record = {
        "graph_inputs": fw_inputs,
        "trainable": [n for n in fw_inputs if n in params or n in inputs_requiring_grad],
        "user_outputs": list(info.user_output_names),
        "frontier_outputs": len(info.frontier_node_arg_map),
        "non_differentiable_outputs": list(info.output_grad_indices_non_differentiable),
        "full_shape_output_grads": list(info.output_grad_indices_require_full_shape),
        "backward_outputs": [o.name for o in onnx.load_model_from_string(grad_model).graph.output],
    }
    return grad_model, record

