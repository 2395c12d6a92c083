"""One rank of the label-sparse head's parity checks (run by tests/test_head_loss.py with torch.distributed.run).

For each layout given (override lists separated by `--`, all of this world size), builds it twice, with
train.label_sparsity=false (the dense head and cross-entropy) and true (the head on the labelled positions only, in
chunks of train.loss_chunk), runs one step's forward and backward of a batch whose labels are ~70% ignored (as a
prompt/completion batch's are), then the held-out loss, and compares the losses and every local gradient shard.
Then every registered objective of per-row log-probabilities (DPO, SimPO, ORPO: row pairs (2k, 2k+1) a chosen and a
rejected completion; DPO's seeded reference log-probability per row): one step's loss, its measures and every
gradient in the layout against the same model in one process without any parallelism, and the held-out loss. Rank 0
prints a JSON line per layout and one per objective.

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
SETTINGS = {"dpo": {"beta": 0.5}, "simpo": {"cpo_alpha": 1.0}}  # beyond the defaults: each term computed


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


def objectives(cfg) -> list[tuple[str, object, object]]:
    """(name, spec, loss) of every registered objective of per-row log-probabilities."""
    from plugins.objectives import get_objective, objective_names

    specs = [(name, get_objective(name)) for name in objective_names()]
    return [(name, spec, fresh(name, spec)) for name, spec in specs if spec.loss is not None]


def settings(name: str, spec):
    """The objective's settings: its defaults but for the terms they leave out (SETTINGS)."""
    from omegaconf import OmegaConf

    return OmegaConf.merge(OmegaConf.structured(spec.config), SETTINGS.get(name, {}))


def fresh(name: str, spec):
    """A loss of the objective with its settings."""
    return spec.loss(settings(name, spec))


def one_process(cfg, batch, loss_of, row_inputs) -> tuple[float, dict[str, torch.Tensor], torch.Tensor]:
    """The loss, the gradients and the measures' sums of the plain model (no mesh, no sharding, one microbatch)."""
    spec = get_model(cfg.model.name)
    model = spec.build(cfg.model)
    spec.init_weights(model, cfg.model, cfg.train.seed)
    model.loss_chunk, model.per_row = cfg.train.loss_chunk, True
    with torch.no_grad():
        count = loss_of.count(batch, lambda rows: model(rows.inputs, labels=rows.labels)[:, 0].double())
    loss = loss_of(model(batch.inputs, labels=batch.labels), row_inputs) / count
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}, loss_of.take()


def row_inputs_for(spec, rows: int, seed: int):
    """Seeded per-row inputs of each provider the objective names: a reference log-probability, a label (a third
    of the rows desirable)."""
    from plugins.objectives.providers import LABEL
    from plugins.objectives.reference import REFERENCE

    made = {REFERENCE: -torch.rand(rows, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 100,
            LABEL: (torch.arange(rows) % 3 == 0).double()}
    columns = [made[name] for name in spec.row_inputs]
    return None if not columns else columns[0] if len(columns) == 1 else torch.stack(columns, 1)


def compare_objectives(overrides: list[str]) -> list[dict]:
    """Each registered objective of rows (DPO with a seeded reference log-probability per row; SimPO, ORPO with
    none; KTO with a label too, and the batch's rows shifted by one as its mismatched rows, scored by the policy in
    the layout) in one layout built once, its runner's loss swapped: one step's loss, measures and every gradient
    against one process, then the held-out loss."""
    import numpy as np

    from plugins.data.batcher import Batch
    from runtime.evaluate import objective_set, policy_scores

    cfg = make_cfg(*overrides)
    spec = get_model(cfg.model.name)
    plan = build_plan(cfg.model, cfg.parallel)
    inputs, labels, _ = masked(build_batcher(cfg).train_batch(0))
    found = objectives(cfg)
    layout = build_layout(cfg, plan, spec, torch.device("cpu"), objective=found[0][2])
    results = []
    for name, objective_spec, loss_of in found:
        row_inputs = row_inputs_for(objective_spec, len(inputs), 1)
        drawn = np.arange(len(inputs))
        batch = Batch(inputs, labels, 1.0, 1.0, drawn=drawn, row_inputs=row_inputs, mismatched=Batch(
            inputs.roll(1, 0), labels.roll(1, 0), 1.0, 1.0, drawn=drawn,
            row_inputs=row_inputs_for(objective_spec, len(inputs), 2)) if objective_spec.mismatched(
            settings(name, objective_spec)) else None)
        want_loss, want, want_sums = one_process(cfg, batch, fresh(name, objective_spec), row_inputs)
        for _, p in layout.params:
            p.grad = None
        with objective_set(layout, loss_of):
            pairs = loss_of.count(batch, policy_scores(layout))
            loss = layout.runner.train_step(layout.local_batch(inputs), layout.local_batch(labels), pairs,
                                            row_inputs=layout.local_batch(row_inputs))
            layout.sync_and_clip(float("inf"))
            names = loss_of.names
            sums = torch.cat([loss.detach().reshape(1).double(), loss_of.take().double()
                              if layout.loss_rank else torch.zeros(len(names), dtype=torch.float64)])
            held_out = layout.runner.eval_sum(layout.local_batch(inputs), layout.local_batch(labels),
                                              row_inputs=layout.local_batch(row_inputs))
            loss_of.take()
        sums = torch.cat([sums, held_out.detach().reshape(1).double()])
        dist.all_reduce(sums)
        worst, where, compared = 0.0, "", 0
        scale = max(g.abs().max().item() for g in want.values())
        for pname, p in layout.params:
            got = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            if pname in layout.aliases:  # a tied copy: its gradient is the weight's, counted where the weight lives
                continue
            ratio = (got - want[pname]).abs().max().item() / (1e-6 * scale)
            compared += 1
            if ratio > worst:
                worst, where = ratio, pname
        result = [None] * dist.get_world_size()
        dist.all_gather_object(result, (worst, where, compared))
        worst, where, _ = max(result)
        results.append({"objective": name, "layout": overrides, "loss": sums[0].item(), "want_loss": want_loss,
                        "metrics": (sums[1:1 + len(names)] / pairs).tolist(),
                        "want_metrics": (want_sums / pairs).tolist(), "held_out": sums[-1].item() / pairs,
                        "worst": worst, "where": where, "compared": sum(r[2] for r in result)})
    return results


def main(groups: list[list[str]]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for overrides in groups:
        for found in (compare(overrides), *compare_objectives(overrides)):
            if dist.get_rank() == 0:
                print(json.dumps(found), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    args, groups = sys.argv[1:], [[]]
    for a in args:
        groups.append([]) if a == "--" else groups[-1].append(a)
    main([g for g in groups if g])
