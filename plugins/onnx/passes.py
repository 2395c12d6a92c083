"""ONNX -> ONNX passes, each a small function registered by name; `transform.passes` lists them in order.

A pass edits the ModelProto in place and returns a one-line summary of what it changed.
"""
from __future__ import annotations

from typing import Callable

import onnx
from onnx import helper

PASSES: dict[str, Callable[[onnx.ModelProto], str]] = {}


def register_pass(name: str):
    def deco(fn: Callable[[onnx.ModelProto], str]):
        PASSES[name] = fn
        return fn
    return deco


def apply_passes(model: onnx.ModelProto, names: list[str]) -> dict[str, str]:
    unknown = [n for n in names if n not in PASSES]
    if unknown:
        raise KeyError(f"transform.passes: unknown pass(es) {unknown}; known: {sorted(PASSES)}")
    return {name: PASSES[name](model) for name in names}


@register_pass("layernorm_stats_outputs")
def layernorm_stats_outputs(model: onnx.ModelProto) -> str:
    """Give every LayerNormalization its optional Mean and InvStdDev outputs.

    torch's exporter emits LayerNormalization with one output; ONNX Runtime's gradient builder reads the
    saved statistics and fails without them ("GradientBuilderBase::O(size_t, bool) const
    i < node_->OutputDefs().size() was false"). ORTModule fixed the same with a 3-output symbolic."""
    fixed = 0
    for i, node in enumerate(model.graph.node):
        if node.op_type == "LayerNormalization" and node.domain in ("", "ai.onnx") and len(node.output) == 1:
            node.output.extend([f"{node.output[0]}_mean_{i}", f"{node.output[0]}_invstddev_{i}"])
            fixed += 1
    return f"{fixed} LayerNormalization node(s) now output Mean and InvStdDev"


@register_pass("dropout_inference")
def dropout_inference(model: onnx.ModelProto) -> str:
    """Turn every Dropout into its inference form (training_mode=False): identity, deterministic.
    Used to check a training-mode export numerically against torch in eval mode."""
    false = "dropout_inference_training_mode_false"
    dropouts = [n for n in model.graph.node if n.op_type == "Dropout"]
    for node in dropouts:
        while len(node.input) < 3:
            node.input.append("")
        node.input[2] = false
    if dropouts:  # the constant goes first: nodes must come after the producers of their inputs
        const = helper.make_node("Constant", [], [false],
                                 value=helper.make_tensor(false, onnx.TensorProto.BOOL, [], [False]))
        nodes = [const, *model.graph.node]
        del model.graph.node[:]
        model.graph.node.extend(nodes)
    return f"{len(dropouts)} Dropout node(s) in inference mode"


@register_pass("check")
def check(model: onnx.ModelProto) -> str:
    """Validate the graph with ONNX's checker (structure, types, opset)."""
    onnx.checker.check_model(model)
    return "onnx.checker passed"
