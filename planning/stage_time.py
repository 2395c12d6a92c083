"""How long each stage will take: measured here before, scaled to this run.

Every stage that runs on this machine leaves its wall time in the store (`.stage_times.json` beside the cache,
storage/measured.py) with the machine's name and what sizes it: the train stage its median step time (the first
steps left out: allocator and caches warm up), its step's FLOPs and the time outside its steps (start-up, the
evaluations, the saves); the others their model's parameters. The plan's estimate of a stage is the newest record
of it on this machine (the train stage's of the same layout, memory level, precision, engine and compilation),
scaled: a train step by its FLOPs, the time outside the steps as it was; another stage by the parameters where it
has more of them, never below the record (start-up, not size, is most of a small stage's time). Where nothing
comparable was recorded the train stage has its floor, its matmuls at this machine's rate, and the others no
figure; the plan says which. After the run the summary says planned against actual per stage, and each stage's
MLflow run gets `planned_s` beside `duration_s`.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from planning.estimate import step_flops
from plugins.parallel import world_size
from runtime.cadence import WARMUP_STEPS_EXCLUDED
from runtime.threads import usable_cores
from storage import measured

TIMES = ".stage_times.json"  # in the store's root
KEPT = 256


@dataclass(frozen=True)
class Expected:
    seconds: float
    source: str          # where the figure comes from, for the plan's line
    floor: bool = False  # nothing comparable measured: a lower bound


def machine(cfg) -> str:
    """Where and how the stages run: the GPU by its name, else this machine's cores, and the executor (cluster=debug
    starts no processes; a record of another machine says nothing of this one)."""
    from runtime.machine import ranks_on_cuda

    ranks = f"{world_size(cfg.parallel)} rank(s), cluster={cfg.cluster.name}"
    if ranks_on_cuda(cfg)[0]:
        import torch

        return f"{torch.cuda.get_device_name()}, {ranks}"
    return f"cpu, {usable_cores()} core(s), {ranks}"


def train_kind(cfg) -> str:
    """What makes a step of the same FLOPs faster or slower on the same machine."""
    p = cfg.parallel
    return (f"dp{p.dp} hp{p.hp} pp{p.pp} {p.dp_mode} microbatches {p.microbatches} {p.pp_schedule}, memory level "
            f"{cfg.memory.level}, {cfg.precision.name}, {cfg.engine.name}, compiled {bool(cfg.triton.enabled)}")


def expected(cfg, stages: list[str], store: Path, n_parameters: int) -> dict[str, Optional[Expected]]:
    """Each stage's estimate from the records in `store` (None where none is comparable; the train stage's floor
    is the caller's: it needs this machine's matmul rate)."""
    kept, here = measured.read(Path(store) / TIMES), machine(cfg)
    out: dict[str, Optional[Expected]] = {}
    for stage in stages:
        mine = [r for r in kept if r.get("stage") == stage and r.get("machine") == here]
        if stage == "train":
            mine = [r for r in mine if r.get("kind") == train_kind(cfg) and r.get("step_flops")]
            if mine:
                r, flops = mine[-1], step_flops(cfg, n_parameters)
                step = r["step_s"] * flops / r["step_flops"]
                out[stage] = Expected(cfg.train.steps * step + r["fixed_s"],
                                      f"{_short(step)} a step: {_short(r['step_s'])} at {r['step_flops'] / 1e9:,.2f} "
                                      f"GFLOP measured here {r['when']}, scaled to {flops / 1e9:,.2f}; "
                                      f"{_short(r['fixed_s'])} besides the steps, as then")
            else:
                out[stage] = None
        elif mine:
            r = mine[-1]
            scale = max(1.0, n_parameters / max(r.get("parameters", 1), 1))
            out[stage] = Expected(r["seconds"] * scale, f"measured here {r['when']}"
                                  + (f", x{scale:,.1f} for the parameters" if scale > 1 else ""))
        else:
            out[stage] = None
    return out


def record(cfg, stage: str, seconds: float, out: Path, store: Path, n_parameters: int) -> None:
    """A stage that ran here, for the next plan. The train stage's steps come from its metrics.jsonl; one that
    continued a checkpoint is left out (its time covers part of the steps, and its start-up a restore)."""
    entry = {"stage": stage, "machine": machine(cfg), "seconds": float(seconds), "parameters": int(n_parameters),
             "when": measured.now()}
    if stage == "train":
        try:
            summary = json.loads((out / "summary.json").read_text())
            rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
        except (OSError, ValueError):
            return
        times = [r["step_time_s"] for r in rows if "step_time_s" in r]
        if summary.get("resumed_from_step") or not times:
            return
        entry.update(kind=train_kind(cfg), step_flops=step_flops(cfg, n_parameters),
                     step_s=statistics.median(times[WARMUP_STEPS_EXCLUDED:] or times),
                     fixed_s=max(0.0, seconds - sum(times)))
    measured.append(Path(store) / TIMES, entry, KEPT)


def _short(seconds: float) -> str:
    return f"{seconds * 1000:,.0f} ms" if seconds < 1 else f"{seconds:,.1f} s"
