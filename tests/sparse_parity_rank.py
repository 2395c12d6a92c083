"""One rank of the label-sparsity parity check (run by tests/test_head_loss.py with torch.distributed.run).

For each layout given (override lists separated by `--`, all of this world size), builds it twice, with
train.label_sparsity=false (the dense head and cross-entropy) and true (the head on the labelled positions only, in
chunks of train.loss_chunk), runs one step's forward and backward of a batch whose labels are ~70% ignored (as a
prompt/completion batch's are), then the held-out loss, and compares the losses and every local gradient shard.
Rank 0 prints one JSON line per layout.

    python -m torch.distributed.run --nproc_per_node=N tests/sparse_parity_rank.py overrides... [-- overrides...]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plugins.data import build_batcher  # noqa: E402
from plugins.models import get_model  # noqa: E402
from plugins.parallel.layout import build_layout  # noqa: E402
from planning.partition import build_plan  # noqa: E402
from tests.conftest import make_cfg  # noqa: E402

MASKED = 0.7


def masked(batch) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The batch's inputs, its labels with MASKED of them ignored (a seeded draw: every rank the same), their count."""
    g = torch.Generator().manual_seed(0)
    labels = batch.labels.clone()
    labels[torch.rand(labels.shape, generator=g) < MASKED] = -100
    return batch.inputs, labels, int((labels != -100).sum())


def step(cfg, plan, spec, inputs, labels, n_labels) -> tuple[float, float, dict[str, torch.Tensor]]:
    layout = build_layout(cfg, plan, spec, torch.device("cpu"))
    loss = layout.runner.train_step(layout.local_batch(inputs), layout.local_batch(labels), n_labels)
    layout.sync_and_clip(float("inf"))
    held_out = layout.runner.eval_sum(layout.local_batch(inputs), layout.local_batch(labels))
    sums = torch.stack([loss.detach().reshape(()), held_out.reshape(())])
    dist.all_reduce(sums)
    local = {name: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone() for name, p in layout.params}
    return float(sums[0]), float(sums[1]), local


def compare(overrides: list[str]) -> dict:
    dense_cfg = make_cfg(*overrides, "train.label_sparsity=false")
    sparse_cfg = make_cfg(*overrides, "train.label_sparsity=true")
    spec = get_model(dense_cfg.model.name)
    plan = build_plan(dense_cfg.model, dense_cfg.parallel)
    inputs, labels, n_labels = masked(build_batcher(dense_cfg).train_batch(0))
    dense_loss, dense_eval, dense = step(dense_cfg, plan, spec, inputs, labels, n_labels)
    sparse_loss, sparse_eval, sparse = step(sparse_cfg, plan, spec, inputs, labels, n_labels)
    scale = torch.tensor(max(g.abs().max().item() for g in dense.values()))
    dist.all_reduce(scale, op=dist.ReduceOp.MAX)
    worst, where = 0.0, ""
    for name, want in dense.items():  # |sparse - dense| against 1e-6 of the largest gradient anywhere
        ratio = (sparse[name] - want).abs().max().item() / (1e-6 * scale.item())
        if ratio > worst:
            worst, where = ratio, name
    result = [None] * dist.get_world_size()
    dist.all_gather_object(result, (worst, where, len(dense)))
    worst, where, _ = max(result)
    return {"layout": overrides, "dense_loss": dense_loss, "sparse_loss": sparse_loss, "dense_eval": dense_eval,
            "sparse_eval": sparse_eval, "labels": n_labels, "positions": labels.numel(), "worst": worst,
            "where": where, "compared": sum(r[2] for r in result)}


def main(groups: list[list[str]]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for overrides in groups:
        found = compare(overrides)
        if dist.get_rank() == 0:
            print(json.dumps(found), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    args, groups = sys.argv[1:], [[]]
    for a in args:
        groups.append([]) if a == "--" else groups[-1].append(a)
    main([g for g in groups if g])
