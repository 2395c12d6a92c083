"""How long each stage will take: measured here before, scaled to this run.

Every stage that runs on this machine leaves its wall time in the store (`.stage_times.json` beside the cache,
storage/measured.py) with the machine's name and what sizes it: the train stage its median step time (the first
steps left out: allocator and caches warm up), its step's FLOPs, its start and end, and its pauses between steps
(evaluations and saves, on average); the others their model's parameters. The plan's estimate of a stage is the
newest record of it on this machine (the train stage's of the same layout, memory level, precision, engine and
compilation), scaled: a train step by its FLOPs, start and end as they were, each pause as long as then; another
stage by the parameters where it has more of them, never below the record (start-up, not size, is most of a small
stage's time). Where nothing comparable was recorded the train stage has its floor, its matmuls at this machine's
rate, and the others no figure; the plan says which. After the run the summary says planned against actual per
stage, and each stage's MLflow run gets `planned_s` beside `duration_s`. Where a first run's floor is not enough,
plan.calibrate_steps times a few of its steps before the plan (orchestrator/calibration.py), leaving a record here.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

from planning.estimate import step_flops
from plugins.parallel import world_size
from runtime.cadence import WARMUP_STEPS_EXCLUDED
from runtime.threads import usable_cores
from storage import measured

TIMES = ".stage_times.json"  # in the store's root
KEPT = 256
STARTUP = "start-up"  # not a stage: the wait for the stage processes' imports, once a run (cluster/local.py)


@dataclass(frozen=True)
class Expected:
    seconds: float
    source: str          # where the figure comes from, for the plan's line
    floor: bool = False  # nothing comparable measured: a lower bound


@dataclass(frozen=True)
class Timing:
    """What a run's records are kept and found by, worked out once a run (timing_of) for its plan and its records."""
    machine: str         # machine(): where and how the stages run
    train_kind: str      # train_kind(): what else makes a train step of the same FLOPs faster or slower
    where: str           # where(): the machine, as the plan says it
    n_parameters: int    # the model's (the plan's partition), which scales a stage other than train
    step_flops: float    # a train step's, which scales a measured step


def timing_of(cfg, plan) -> Timing:
    """The point's Timing, from its plan (planning/plan.py's Plan: the model's parameters, its objective)."""
    kind, said, flops = train_kind(cfg, plan), where(cfg), step_flops(cfg, plan.n_parameters)
    return Timing(machine(cfg), kind, said, plan.n_parameters, flops)


def machine(cfg) -> str:
    """Where and how the stages run: the GPU by its name, else this machine's cores, and the executor (cluster=debug
    starts no processes; a record of another machine says nothing of this one). On SLURM the nodes, as the job's
    request names them: the partition, the resources per task, the nodes (this host is not one of them)."""
    from runtime.machine import has_cuda

    ranks = f"{world_size(cfg.parallel)} rank(s), cluster={cfg.cluster.name}"
    if cfg.cluster.name == "slurm":
        c = cfg.cluster
        sbatch = json.dumps(OmegaConf.to_container(c.sbatch), sort_keys=True) if c.sbatch else "{}"
        return (f"{where(cfg)}, {c.gpus_per_task} GPU(s) and {c.cpus_per_task or c.threads_per_rank or 1} CPU(s) "
                f"per task, {c.nodes} node(s), sbatch {sbatch}, {ranks}")
    if has_cuda():  # off SLURM the ranks get this machine's GPUs (runtime.machine.ranks_on_cuda)
        import torch

        return f"{torch.cuda.get_device_name()}, {ranks}"
    return f"cpu, {usable_cores()} core(s), {ranks}"


def where(cfg) -> str:
    """Where a record was measured, as the plan says it."""
    return f"on SLURM partition {cfg.cluster.partition or '(the default)'}" if cfg.cluster.name == "slurm" else "here"


def train_kind(cfg, plan) -> str:
    """What makes a step of the same FLOPs faster or slower on the same machine (plan: the point's)."""
    p = cfg.parallel
    kind = (f"dp{p.dp} hp{p.hp} pp{p.pp} {p.dp_mode} microbatches {p.microbatches} {p.pp_schedule}, memory level "
            f"{cfg.memory.level}, {cfg.precision.name}, {cfg.engine.name}, compiled {bool(cfg.triton.enabled)}")
    spec, online = plan.objective, plan.reference is not None and plan.reference.where == "online"
    if spec.loss is not None:  # an objective of rows runs more forwards a step (a reference online, mismatched rows)
        kind += f", objective {cfg.objective.name}" + (" online" if online else "") + \
            (" mismatched" if spec.mismatched(cfg.objective) else "")
    return kind


def expected(timing: Timing, train, stages: list[str], store: Path,
             first_step: int = 0) -> dict[str, Optional[Expected]]:
    """Each stage's estimate from the records in `store` (None where none is comparable; the train stage's floor
    is the caller's: it needs this machine's matmul rate). train: the config's; first_step: the step the train stage
    continues from."""
    kept = measured.read(Path(store) / TIMES)
    out: dict[str, Optional[Expected]] = {}
    for stage in stages:
        mine = [r for r in kept if r.get("stage") == stage and r.get("machine") == timing.machine]
        if stage == "train":
            mine = [r for r in mine if r.get("kind") == timing.train_kind and r.get("step_flops")]
            if mine:
                r, flops = mine[-1], timing.step_flops
                step = r["step_s"] * flops / r["step_flops"]
                steps = (f"{_short(step)} a step: {_short(r['step_s'])} at {r['step_flops'] / 1e9:,.2f} GFLOP measured "
                         f"{timing.where} {r['when']}, scaled to {flops / 1e9:,.2f}")
                besides, how = _besides_steps(r, pauses(train, first_step))
                out[stage] = Expected((train.steps - first_step) * step + besides, f"{steps}; {how}")
            else:
                out[stage] = None
        elif mine:
            r = mine[-1]
            scale = 1.0 if stage == STARTUP else max(1.0, timing.n_parameters / max(r.get("parameters", 1), 1))
            out[stage] = Expected(r["seconds"] * scale, f"measured {timing.where} {r['when']}"
                                  + (f", x{scale:,.1f} for the parameters" if scale > 1 else ""))
        else:
            out[stage] = None
    return out


def record(timing: Timing, train, stage: str, seconds: float, out: Path, store: Path) -> None:
    """A stage that ran here, for the next plan (timing: the run's; train: its config's). The train stage's steps come
    from its metrics.jsonl; one that continued a checkpoint is left out (its time covers part of the steps, and its
    start-up a restore)."""
    entry = {"stage": stage, "machine": timing.machine, "seconds": float(seconds),
             "parameters": 0 if stage == STARTUP else int(timing.n_parameters),  # the start-up: not the model's size
             "when": measured.now()}
    if stage == "train":
        try:
            summary = json.loads((out / "summary.json").read_text())
            rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
        except (OSError, ValueError):
            return
        steps = [r for r in rows if "step_time_s" in r]
        times = [r["step_time_s"] for r in steps]
        if summary.get("resumed_from_step") or not times:
            return
        entry.update(kind=timing.train_kind, step_flops=timing.step_flops,
                     step_s=statistics.median(times[WARMUP_STEPS_EXCLUDED:] or times),
                     fixed_s=max(0.0, seconds - sum(times)))
        if all("time" in r for r in steps):  # when each step ended: what lies between them is the pauses'
            span = steps[-1]["time"] - steps[0]["time"] + times[0]
            between, n = max(0.0, span - sum(times)), pauses(train)
            entry.update(start_s=max(0.0, seconds - span) + (0.0 if n else between),
                         pause_s=between / n if n else None)
    measured.append(Path(store) / TIMES, entry, KEPT)


def pauses(train, first_step: int = 0) -> int:
    """The evaluations and saves between a run's steps (those after its last step are part of its end; first_step:
    the step a continued run starts from): each a pause of the steps."""
    every = [e for e in (train.eval_every, train.checkpoint_every) if e]
    return sum(1 for s in range(first_step + 1, train.steps) if any(s % e == 0 for e in every)) if every else 0


def _besides_steps(r: dict, n: int) -> tuple[float, str]:
    """The train stage's time outside its steps, from record `r`, for a run with `n` pauses: its start and end as
    they were, and each pause as long as the record's were on average (an evaluation and a save)."""
    if "start_s" not in r:  # a record from before pauses were timed
        return r["fixed_s"], f"{_short(r['fixed_s'])} besides the steps, as then"
    start = f"{_short(r['start_s'])} to start and end, as then"
    if not n:
        return r["start_s"], start
    if r["pause_s"] is None:
        return r["start_s"], f"{start}; its {n} evaluation(s) and save(s) between steps not timed yet (that run " \
                             "had none)"
    return r["start_s"] + n * r["pause_s"], f"{start}, and {n} evaluation(s) and save(s) between steps at " \
                                            f"{_short(r['pause_s'])} each"


def _short(seconds: float) -> str:
    return f"{seconds * 1000:,.0f} ms" if seconds < 1 else f"{seconds:,.1f} s"
