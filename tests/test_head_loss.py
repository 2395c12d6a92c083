"""Label sparsity (plugins/models/head_loss.py): the head and the cross-entropy on the labelled positions only give
the dense path's loss and gradients, alone and in every layout."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from plugins.models.head_loss import head_loss
from plugins.models.transformer import loss as dense_loss
from tests.conftest import ROOT, cli_env


def _dense(h, w, y, vocab):
    return dense_loss((h @ w.t())[..., :vocab], y)


@pytest.mark.parametrize("chunk", [1, 7, 10_000])
def test_the_sparse_head_gives_the_dense_loss_and_gradients(chunk):
    """Chunks of one position, of some, of all; padded vocabulary rows (Megatron's) never count."""
    g = torch.Generator().manual_seed(0)
    vocab, rows = 500, 512
    h = torch.randn(4, 64, 64, generator=g, requires_grad=True)
    w = (torch.randn(rows, 64, generator=g) * 0.1).requires_grad_()
    y = torch.randint(0, vocab, (4, 64), generator=g)
    y[torch.rand(4, 64, generator=g) < 0.7] = -100
    want = _dense(h, w, y, vocab)
    want_h, want_w = torch.autograd.grad(want / 77, (h, w))
    got = head_loss(h, w, y, vocab, chunk)
    got_h, got_w = torch.autograd.grad(got / 77, (h, w))
    assert abs(got.item() - want.item()) <= 1e-6 * want.item()
    assert (got_h - want_h).abs().max() <= 2e-6 * want_h.abs().max()
    assert (got_w - want_w).abs().max() <= 2e-6 * want_w.abs().max()
    with torch.no_grad():  # evaluation: no gradient buffers, the same sum
        assert head_loss(h, w, y, vocab, chunk).item() == pytest.approx(got.item(), rel=1e-7)
    # the train step's way (the count read on the host, the positions found without asking the device): the same
    counted = head_loss(h, w, y, vocab, chunk, count=int((y != -100).sum()))
    assert torch.equal(counted, got)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(counted / 77, (h, w)), (got_h, got_w)))


def test_no_labelled_position_gives_zero_and_zero_gradients():
    h = torch.randn(2, 5, 8, requires_grad=True)
    w = torch.randn(11, 8, requires_grad=True)
    total = head_loss(h, w, torch.full((2, 5), -100), 11, 4)
    total.backward()
    assert total.item() == 0.0 and not h.grad.any() and not w.grad.any()
    assert F.cross_entropy(torch.zeros(0, 11), torch.zeros(0, dtype=torch.long), reduction="sum").item() == 0.0


COMMON = ["train.batch_size=8", "train.seq_len=32", "tracking=none", "train.loss_chunk=16", "model.dropout=0"]
WORLD_2 = [["parallel=ddp2", "parallel.dp_mode=replicate"], ["parallel=ddp2", "parallel.dp_mode=shard"],
           ["parallel=megatron_hp2", "parallel.sequence_parallel=true", "parallel.loss_parallel=true",
            "model=llama_tiny", "model.pad_vocab_to=128"],  # a padded, vocabulary-sharded, untied head
           ["parallel=pipeline_pp2"],
           ["parallel=pipeline_pp2", "parallel.pp_chunks=2", "parallel.pp_schedule=zbv", "parallel.microbatches=4"]]
WORLD_8 = [["parallel=dp2_hp2_pp2", "parallel.dp_mode=shard", "parallel.sequence_parallel=true",
            "parallel.loss_parallel=true"]]


@pytest.mark.e2e
@pytest.mark.parametrize("world,layouts", [(2, WORLD_2), (8, WORLD_8)], ids=["world2", "dp2_hp2_pp2"])
def test_every_layout_gives_the_dense_losses_and_gradients(world, layouts):
    """dp both modes, hp with sequence and loss parallelism, pp 1F1B and zero-bubble V (split backward), all three:
    one step's loss, every gradient shard (to 1e-6 of the largest gradient) and the held-out loss, on a batch whose
    labels are 70% ignored, in chunks of 16 positions (tests/sparse_parity_rank.py); and every registered objective of
    the head's per-row log-probabilities (DPO, SimPO, ORPO) with its measures and every gradient as one process
    without any parallelism gives them."""
    from plugins.objectives import get_objective, objective_names

    args = []
    for overrides in layouts:
        args += (["--"] if args else []) + [*COMMON, *overrides]
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             f"--nproc_per_node={world}", str(ROOT / "tests" / "sparse_parity_rank.py"), *args],
                            capture_output=True, text=True, timeout=600, env=cli_env())
    found = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    rows_objectives = [n for n in objective_names() if get_objective(n).loss is not None]
    assert len(found) == (1 + len(rows_objectives)) * len(layouts), result.stdout[-2000:] + result.stderr[-3000:]
    assert {r["objective"] for r in found if "objective" in r} == set(rows_objectives)
    for r in (r for r in found if "objective" in r):
        assert r["loss"] == pytest.approx(r["want_loss"], rel=1e-6) and r["held_out"] == pytest.approx(r["loss"]), r
        assert r["metrics"] == pytest.approx(r["want_metrics"], rel=1e-6, abs=1e-5), r
        assert r["worst"] <= 1.0 and r["compared"] > 0, r
    for r in (r for r in found if "objective" not in r):
        assert r["labels"] < 0.4 * r["positions"] and r["compared"] > 0, r
        assert abs(r["sparse_loss"] - r["dense_loss"]) <= 1e-6 * r["dense_loss"], r
        assert abs(r["sparse_eval"] - r["dense_eval"]) <= 1e-6 * r["dense_eval"], r
        assert r["worst"] <= 1.0, r  # every gradient within 1e-6 of the largest


def test_the_plan_says_what_the_step_leaves_out_and_counts_the_head_so():
    from planning.estimate import estimate
    from planning.plan import compute_line, partition_plan
    from tests.conftest import make_cfg

    assert "labelled positions only" in compute_line(make_cfg()) and "no padding to leave out" in compute_line(make_cfg())
    assert "every position" in compute_line(make_cfg("train.label_sparsity=false"))
    assert "as their real tokens only" in compute_line(make_cfg("data.packing=false"))
    for overrides, why in ((["parallel=pipeline_pp2"], "a pipeline's stages"), (["engine=ort"], "engine=ort's graphs"),
                           (["data.balance_ranks=false"], "data.balance_ranks=false")):
        assert f"padded rows keep their padding: {why}" in compute_line(make_cfg("data.packing=false", *overrides))
    big = ["model=gpt2_124m", "train.batch_size=8", "train.seq_len=1024"]
    dense, sparse = (estimate(cfg, partition_plan(cfg)) for cfg in (make_cfg(*big, "train.label_sparsity=false"),
                                                                   make_cfg(*big)))
    assert sparse.head < dense.head / 4 and sparse.total < dense.total and "labelled positions only" in sparse.describe()
