"""The ONNX Runtime engine in one process: gradients equal torch's, recomputation and dropout compose,
in-place changes between forward and backward are caught, graphs that hard-code sizes are refused."""
from __future__ import annotations

import copy
from pathlib import Path

import onnx
import pytest
import torch
from torch import nn

from orchestrator.run import orchestrate
from plugins.engines.ort.engine import install
from plugins.engines.ort.graphs import OrtGraphError, partition_for_hp
from plugins.models import get_model
from plugins.onnx.exporter import export_module
from tests.conftest import QUICK, last_wins, make_cfg, requires_ort_training

pytestmark = requires_ort_training

ARGS = last_wins(["cluster=debug", "tracking=none", "engine=ort", *QUICK, "train.steps=2"])


@pytest.fixture(scope="module")
def ort_dir(tmp_path_factory) -> Path:
    """The transform stage's ORT graphs for gpt_tiny, made by a real (in-process) run."""
    tmp = tmp_path_factory.mktemp("ort")
    report = orchestrate(make_cfg(*ARGS, runs_dir=tmp / "runs"), tmp / "run", ARGS)
    assert report.exit_code == 0
    return tmp / "runs" / "cache" / "transform" / report.results["transform"].key / "ort"


def models(*overrides):
    cfg = make_cfg(*ARGS, *overrides)
    spec = get_model("gpt")
    reference = spec.build(cfg.model)
    spec.init_weights(reference, cfg.model, 7)
    return cfg, spec, reference, copy.deepcopy(reference)


def step(spec, model, batch_seed=0):
    g = torch.Generator().manual_seed(batch_seed)
    x = torch.randint(0, 256, (4, 32), generator=g)
    y = torch.randint(0, 256, (4, 32), generator=g)
    loss = spec.loss(model(x), y) / y.numel()
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_grads_close(got: dict, want: dict, rtol=1e-4):
    scale = max(g.abs().max().item() for g in want.values())
    for name, w in want.items():
        diff = (got[name] - w).abs().max().item()
        # relative to the tensor's own size, with a floor at 1e-6 of the largest gradient: some gradients
        # are zero in exact arithmetic (the key bias: softmax ignores a per-row shift) and pure rounding
        assert diff <= rtol * w.abs().max().item() + 1e-6 * scale, f"{name}: max|diff| {diff:.2e}"


def test_ort_gradients_equal_torch(ort_dir):
    cfg, spec, reference, ort_model = models()
    assert install([ort_model], spec, ort_dir, cfg.engine, None, torch.device("cpu"), 0) == {}
    loss_t, grads_t = step(spec, reference)
    loss_o, grads_o = step(spec, ort_model)
    assert loss_o == pytest.approx(loss_t, rel=1e-5)
    assert_grads_close(grads_o, grads_t)


def test_a_padded_vocabulary_keeps_torchs_gradients(ort_dir):
    """model.pad_vocab_to: ORT runs the blocks (their graphs hold no vocabulary, so the unpadded model's serve),
    torch the padded embedding and head; the padding's rows get no gradient."""
    cfg, spec, reference, ort_model = models("model.pad_vocab_to=128")
    assert ort_model.wte.weight.shape[0] == 384
    assert install([ort_model], spec, ort_dir, cfg.engine, None, torch.device("cpu"), 0) == {}
    loss_t, grads_t = step(spec, reference)
    loss_o, grads_o = step(spec, ort_model)
    assert loss_o == pytest.approx(loss_t, rel=1e-5)
    assert_grads_close(grads_o, grads_t)
    assert grads_o["wte.weight"][320:].abs().max().item() == 0.0


@pytest.mark.parametrize("level", [1, 2])
def test_ort_composes_with_recomputation(ort_dir, level):
    cfg, spec, reference, ort_model = models()
    install([ort_model], spec, ort_dir, cfg.engine, None, torch.device("cpu"), 0)
    spec.apply_memory(ort_model, level)
    _, grads_t = step(spec, reference)
    _, grads_o = step(spec, ort_model)
    assert_grads_close(grads_o, grads_t)


def test_dropout_stays_in_torch_so_masks_match(ort_dir):
    cfg, spec, reference, ort_model = models("model.dropout=0.2")
    install([ort_model], spec, ort_dir, cfg.engine, None, torch.device("cpu"), 0)
    torch.manual_seed(3)
    loss_t, grads_t = step(spec, reference)
    torch.manual_seed(3)
    loss_o, grads_o = step(spec, ort_model)
    assert loss_o == pytest.approx(loss_t, rel=1e-5)
    assert_grads_close(grads_o, grads_t)


def test_in_place_change_between_forward_and_backward_is_caught(ort_dir):
    cfg, spec, _, ort_model = models()
    install([ort_model], spec, ort_dir, cfg.engine, None, torch.device("cpu"), 0)
    x = torch.randint(0, 256, (2, 16))
    loss = ort_model(x).sum()
    with torch.no_grad():
        ort_model.layers["0"].attn.wq.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


class HardCodedHeads(nn.Module):
    """Reshapes with a fixed head count: breaks when tensor parallelism gives each rank half the heads."""

    def __init__(self):
        super().__init__()
        self.wq = nn.Linear(16, 16)

    def forward(self, x):
        B, T, _ = x.shape
        return self.wq(x).view(B, T, 4, 4).transpose(1, 2).reshape(B, T, 16)


def test_graph_that_hard_codes_a_head_count_is_refused():
    graph, _ = export_module(HardCodedHeads(), (torch.randn(2, 5, 16),), ["x"], ["y"],
                             {"x": {0: "b", 1: "t"}}, 17, params_as_inputs=True)
    shards = {"wq.weight": [8, 16], "wq.bias": [8]}
    with pytest.raises(OrtGraphError, match="hard-codes a head count or hidden size"):
        partition_for_hp(graph, shards, ["x"], {"x": [2, 8, 16]}, "attention")


def test_head_inferring_graph_partitions(ort_dir):
    cache = ort_dir.parents[2]  # <cache>/transform/<key>/ort
    graph = onnx.load(next(cache.glob("export/*/units/attention.onnx")))
    shards = {"attn.wq.weight": [32, 64], "attn.wq.bias": [32], "attn.wk.weight": [32, 64], "attn.wk.bias": [32],
              "attn.wv.weight": [32, 64], "attn.wv.bias": [32], "attn.wo.weight": [64, 32]}
    assert partition_for_hp(graph, shards, ["x"], {"x": [2, 8, 64]}, "attention") == 7


def test_a_split_backward_runs_ort_once_and_gives_the_gradients_of_one_call(ort_dir):
    """Zero-bubble schedules ask a node for the input gradient, then for the weight gradients (two backward calls)."""
    cfg, spec, reference, ort_model = models()
    install([ort_model], spec, ort_dir, cfg.engine, None, torch.device("cpu"), 0)
    block = spec.blocks(ort_model)[0]
    unit = block.engine.units["attention"]
    params = [p for _, p in sorted(block.named_parameters()) if p.requires_grad]
    x = torch.randn(2, 16, cfg.model.d_model, requires_grad=True)
    unit.runs.update(forward=0, backward=0)
    y = block.engine("attention", block, x)
    (gx,) = torch.autograd.grad(y.sum(), [x], retain_graph=True)   # the input gradient first
    gw = torch.autograd.grad(y.sum(), params, allow_unused=True)    # then the weights'
    assert unit.runs == {"forward": 1, "backward": 1}
    y = block.engine("attention", block, x)
    together = torch.autograd.grad(y.sum(), [x, *params], allow_unused=True)
    assert torch.allclose(gx, together[0]) and all(
        (a is None and b is None) or torch.allclose(a, b) for a, b in zip(gw, together[1:]))
