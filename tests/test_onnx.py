"""ONNX: the input/output schema, export checked in ONNX Runtime, the passes, ORT's gradient builder."""
from __future__ import annotations

import json

import onnx
import pytest
import torch
from torch import nn

from plugins.models import get_model
from plugins.onnx.exporter import export_model, export_module, max_abs_diff
from plugins.onnx.io_schema import IOSchema, Node, flatten, unflatten
from plugins.onnx.passes import PASSES, apply_passes
from tests.conftest import make_cfg, requires_ort_training


# -- schema -----------------------------------------------------------------------------------------

def test_flatten_and_restore_a_nest():
    a, b, c = torch.ones(2), torch.zeros(3, dtype=torch.int64), torch.full((1,), 2.0)
    value = {"x": a, "pair": (b, None), "meta": [1.5, "tag", True], "deep": {"c": c}}
    tensors, node = flatten(value, "in")
    assert [t is x for t, x in zip(tensors, (a, b, c))] == [True, True, True]
    assert [leaf.name for leaf in node.leaves()] == ["in.x", "in.pair.0", "in.deep.c"]
    again = Node.from_json(json.loads(json.dumps(node.to_json())))
    restored = unflatten(again, tensors)
    assert restored["pair"][1] is None and restored["meta"] == [1.5, "tag", True]
    assert isinstance(restored["pair"], tuple) and restored["deep"]["c"] is c


def test_schema_names_positional_arguments_and_records_dtypes():
    _, node = flatten((torch.ones(2, 3), torch.ones(1, dtype=torch.int64)), "input", {"ids": {0: "batch"}},
                      item_names=["x", "ids"])
    leaves = node.leaves()
    assert [(l.name, l.dtype, l.rank) for l in leaves] == [("x", "float32", 2), ("ids", "int64", 1)]
    assert leaves[1].dynamic == {0: "batch"}


def test_unsupported_values_are_named():
    with pytest.raises(TypeError, match="in.bad: cannot pass a object"):
        flatten({"bad": object()}, "in")


class NestedModule(nn.Module):
    """Takes a dict and returns a (tensor, dict) pair: what ORTModule's schema handling is for."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, batch):
        h = self.lin(batch["x"]) * batch["scale"]
        return h, {"sum": h.sum(-1), "none": None}


def test_nested_module_exports_through_the_schema():
    torch.manual_seed(0)
    m = NestedModule()
    args = ({"x": torch.randn(2, 4), "scale": torch.tensor(2.0)},)
    graph, schema = export_module(m, args, ["batch"], ["out"], {"batch.x": {0: "n"}}, 17, params_as_inputs=True)
    assert schema.input_names == ["batch.x", "batch.scale"]
    assert schema.output_names == ["out.0", "out.1.sum"]
    assert [i.name for i in graph.graph.input] == ["batch.x", "batch.scale", "lin.weight", "lin.bias"]
    # outputs reach ~10: 1e-5 is fp32 rounding of ONNX Runtime's GEMM (MLAS) against torch's (MKL)
    assert max_abs_diff(graph, schema, m, ({"x": torch.randn(5, 4), "scale": torch.tensor(3.0)},)) < 1e-5
    assert IOSchema.from_json(schema.to_json()).output_names == schema.output_names


# -- the GPT export ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpt_export():
    cfg = make_cfg("model.dropout=0.1")
    spec = get_model("gpt")
    model = spec.build(cfg.model)
    spec.init_weights(model, cfg.model, 0)
    graph, schema, record = export_model(model, spec, cfg.model, cfg.export, cfg.engine.opset, params_as_inputs=True)
    return cfg, spec, model, graph, schema, record


def test_training_graph_takes_parameters_as_inputs(gpt_export):
    cfg, spec, model, graph, schema, record = gpt_export
    names = [i.name for i in graph.graph.input]
    assert names[0] == "input_ids"
    assert set(names[1:]) == {n for n, _ in model.named_parameters()}  # tied head weight appears once
    assert record["check"]["max_abs_diff"] < 1e-4
    assert any(n.op_type == "Dropout" for n in graph.graph.node)


def test_export_has_dynamic_batch_and_sequence(gpt_export):
    cfg, spec, model, graph, schema, _ = gpt_export
    dims = graph.graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_param for d in dims] == ["batch", "sequence"]
    for b, t in ((1, 5), (4, 100)):
        assert max_abs_diff(graph, schema, model, spec.example_inputs(cfg.model, b, t)) < 1e-4


def test_export_check_fails_loudly():
    cfg = make_cfg("export.verify_atol=0.0")
    spec = get_model("gpt")
    model = spec.build(cfg.model)
    spec.init_weights(model, cfg.model, 0)
    with pytest.raises(RuntimeError, match="exceeds export.verify_atol=0.0"):
        export_model(model, spec, cfg.model, cfg.export, cfg.engine.opset, params_as_inputs=True)


@requires_ort_training
def test_layernorm_pass_lets_ort_build_the_gradient_graph(gpt_export):
    """Without the pass ORT's gradient builder fails (FINDINGS); with it the fw+bw graph builds."""
    from onnxruntime.capi import _pybind_state as C

    *_, graph, schema, _ = gpt_export
    params = [i.name for i in graph.graph.input][1:]

    def build(model: onnx.ModelProto):
        config = C.OrtModuleGraphBuilderConfiguration()
        config.initializer_names = params
        config.initializer_names_to_train = params
        config.input_names_require_grad = []
        config.build_gradient_graph = True
        config.loglevel = C.Severity.FATAL
        builder = C.OrtModuleGraphBuilder()
        builder.initialize(model.SerializeToString(), config)
        builder.build(C.TrainingGraphTransformerConfiguration())
        return builder.get_gradient_model()

    with pytest.raises(Exception, match="OutputDefs"):
        build(graph)
    fixed = onnx.ModelProto()
    fixed.CopyFrom(graph)
    summary = apply_passes(fixed, ["layernorm_stats_outputs", "check"])
    assert summary["layernorm_stats_outputs"].startswith("17 LayerNormalization")
    assert len(build(fixed)) > 0


def test_dropout_inference_pass_makes_the_graph_deterministic(gpt_export):
    cfg, spec, model, graph, schema, _ = gpt_export
    g = onnx.ModelProto()
    g.CopyFrom(graph)
    assert apply_passes(g, ["dropout_inference", "check"])["dropout_inference"].endswith("in inference mode")


def test_unknown_pass_is_named():
    with pytest.raises(KeyError, match="unknown pass"):
        apply_passes(onnx.ModelProto(), ["nope"])
    assert {"layernorm_stats_outputs", "dropout_inference", "check"} <= set(PASSES)
