"""One rank of the engine gradient-parity check (run by tests with torch.distributed.run).

Builds the same layout twice, with engine=torch and with engine=ort (the graphs of a real transform stage),
runs one step's forward and backward on both, and compares every local gradient shard. Rank 0 prints one
JSON line: the worst violation of |ort - torch| <= rtol * max|torch| + 1e-6 * (largest gradient anywhere).

    python -m torch.distributed.run --nproc_per_node=N tests/grad_parity_rank.py <transform output dir> overrides...
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
from plugins.engines.ort.engine import install  # noqa: E402
from storage.fsio import read_json  # noqa: E402
from plugins.models import get_model  # noqa: E402
from plugins.parallel.layout import build_layout  # noqa: E402
from tests.conftest import make_cfg  # noqa: E402

RTOL = 1e-4


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def grads(layout, batch) -> dict[str, torch.Tensor]:
    layout.runner.train_step(layout.local_batch(batch.inputs), layout.local_batch(batch.labels), batch.n_labels)
    layout.sync_and_clip(float("inf"))
    return {name: local(p.grad).clone() for name, p in layout.params}


def main(transform_dir: Path, overrides: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cfg = make_cfg(*overrides)
    plan = read_json(transform_dir / "partition_plan.json")
    spec = get_model(cfg.model.name)
    batch = build_batcher(cfg).train_batch(0)
    reference = grads(build_layout(make_cfg(*overrides, "engine=torch"), plan, spec, torch.device("cpu")), batch)
    layout = build_layout(cfg, plan, spec, torch.device("cpu"))
    hp_group = layout.mesh.get_group("hp") if layout.coords.hp_size > 1 else None
    fallbacks = install(layout.parts, spec, transform_dir / "ort", cfg.engine, hp_group, torch.device("cpu"), dist.get_rank())
    got = grads(layout, batch)
    scale = torch.tensor(max(g.abs().max().item() for g in reference.values()))
    dist.all_reduce(scale, op=dist.ReduceOp.MAX)
    worst, where = 0.0, ""
    for name, want in reference.items():
        allowed = RTOL * want.abs().max().item() + 1e-6 * scale.item()
        ratio = (got[name] - want).abs().max().item() / allowed
        if ratio > worst:
            worst, where = ratio, name
    result = [None] * dist.get_world_size()
    dist.all_gather_object(result, (worst, where, len(reference), fallbacks))
    if dist.get_rank() == 0:
        worst, where, _, fallbacks = max(result)
        print(json.dumps({"worst": worst, "where": where, "compared": sum(r[2] for r in result),
                          "fallbacks": fallbacks}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
