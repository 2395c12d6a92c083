"""The plan's lines on time: floors from this machine's matmul rate and disk speed (measured when a run starts, not
in a dry run), the stages' times from what ran here before (planning/stage_time.py), and after a run, its times
against the plan's."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from planning import stage_time
from planning.estimate import matmul_rate, step_flops
from planning.plan import Plan, checkpoint_saves
from planning.stage_time import Expected
from plugins.parallel import world_size
from runtime.threads import rank_threads, usable_cores
from storage.disk_speed import aggregate_kind, rates_for, size_text


def time_line(cfg, plan: Plan, saving: bool = True, first_step: int = 0) -> str:
    """The plan's lines on time: the step's FLOPs against this machine's matmul rate, measured now, and the saves'
    and the aggregate's bytes against this disk's write rate, measured now. Floors, not forecasts: the rest of a
    step (attention, norms, the optimizer, communication, pipeline bubbles) and the aggregate's checks come on top.
    A dry run does not measure (it only plans); saving=False (train and aggregate cached) leaves the disk out.
    first_step: the step a continued run starts from (the steps before it are not taken again). plan: the point's."""
    flops = step_flops(cfg, plan.n_parameters)
    head = f"time: {flops / 1e12:,.3f} TFLOP per step"
    if cfg.dry_run or cfg.data.get("preview"):
        return (f"{head}; this machine's matmul rate and disk speed are measured when the run starts (not in a "
                f"{'dry run' if cfg.dry_run else 'data preview'})")
    if cfg.cluster.name == "slurm":
        steps = f"{head}; the rate is not estimated here (the stages run on the cluster's nodes)"
    else:
        floor, rate, where = step_floor(cfg, flops)
        n = cfg.train.steps - first_step
        which = f"the {n} steps from step {first_step}" if first_step else f"{n} steps"
        steps = (f"{head}; matmuls here run at {rate / 1e9:,.0f} GFLOP/s ({where}, measured now), so a step takes at "
                 f"least {duration(floor)} and {which} at least {duration(floor * n)}")
    evaluate = (f"\n  {evaluate_time(cfg.evaluate, plan.n_parameters)}"
                if cfg.evaluate.tasks and cfg.cluster.name != "slurm" else "")
    return (f"{steps}\n  {saves_line(cfg, plan)}" if saving else steps) + evaluate


def expected_times(cfg, timing: stage_time.Timing, to_run: list[str], store: Path, startup: bool = False,
                   first_step: int = 0) -> dict[str, Optional[Expected]]:
    """The stages that will run, each's time from what ran here before (planning/stage_time.py); the train stage's
    floor where no comparable run was measured, except on SLURM (this host's matmuls say nothing of the nodes'), and
    in a dry run or data preview, which measure nothing (records alone are read there). startup: the stage
    processes' imports are still to come (a local run's fork server not started yet), timed as the stage
    "start-up". A SLURM job's wait in the queue is not estimated. first_step: the step the train stage continues
    from (its own or an adopted checkpoint's, or train.init_from's: continued_from). timing: the run's
    (stage_time.timing_of)."""
    slurm = cfg.cluster.name == "slurm"
    found = stage_time.expected(timing, cfg.train, [stage_time.STARTUP] * bool(startup and to_run and not slurm)
                                + to_run, store, first_step)
    if "train" in found and found["train"] is None and not (slurm or cfg.dry_run or cfg.data.get("preview")):
        floor, rate, where = step_floor(cfg, timing.step_flops)
        found["train"] = Expected(floor * (cfg.train.steps - first_step), f"at least: its matmuls at "
                                  f"{rate / 1e9:,.0f} GFLOP/s "
                                  f"({where}); no run of this layout measured here yet", floor=True)
    return found


def continued_from(cfg, resumes_at: Optional[int]) -> tuple[int, list[str]]:
    """The step the train stage starts from, and the plan's line on the checkpoint it continues: this key's own or an
    adopted attempt's (`resumes_at`, which the plan table's note names), else train.init_from's (its manifest's
    step; a Hugging Face folder starts at step 0)."""
    if resumes_at:
        return resumes_at, []
    start = cfg.train.init_from or ""
    if not start or start.startswith("hf:"):
        return 0, []
    from storage.checkpoint import read_manifest

    try:
        step = int(read_manifest(Path(start))["step"])
    except (OSError, ValueError, KeyError, TypeError):  # what is wrong with it is refused by train.init_from's check
        return 0, []
    step = min(step, cfg.train.steps)
    return step, [f"train: continues the checkpoint of step {step} ({start}): the {cfg.train.steps - step} steps "
                  f"from step {step} to {cfg.train.steps} run, and the plan's times count them"]


def planned_lines(planned: dict[str, Optional[Expected]], where: str = "here") -> list[str]:
    """The plan's time for the stages that run, in all and each, and where the train stage's figure comes from
    (where: the machine's name for the records, stage_time.where)."""
    if not planned:
        return []
    known = {stage: e for stage, e in planned.items() if e is not None}
    unknown = [stage for stage, e in planned.items() if e is None]
    lower = unknown or any(e.floor for e in known.values())
    each = ", ".join(f"{stage} {'>= ' if e.floor else ''}{duration(e.seconds)}" for stage, e in known.items())
    stages = len([s for s in planned if s != stage_time.STARTUP])
    first = " (their first run on this machine)" if where == "here" else ""
    if not known:  # a first run on SLURM's nodes (here the train stage has its floor)
        return [f"  stages: none of the {stages} that run measured {where} yet{first}"]
    lines = [f"  stages: {'at least' if lower else 'about'} {duration(sum(e.seconds for e in known.values()))} for "
             f"the {stages} that run ({each})"]
    if known.get("train"):
        lines.append(f"  train: {known['train'].source}")
    if unknown:
        lines.append(f"  not measured {where} yet{first}: {', '.join(unknown)}")
    return lines


STARTUP_SAID_S = 0.5  # a wait for the stage processes' imports shorter than this is not worth a word


def actual_line(planned: dict[str, Optional[Expected]], took: dict[str, float], waited: float = 0.0
                ) -> Optional[str]:
    """After the run: each stage that ran, its time against the plan's, with the stage processes' start-up (the fork
    server's imports, once a run: no stage's time holds it) where it was long enough to say."""
    if waited >= STARTUP_SAID_S:
        took = {stage_time.STARTUP: waited, **took}
    ran = [(stage, seconds, planned.get(stage)) for stage, seconds in took.items()]
    return _against(ran) if planned and ran else None


def _against(ran: list[tuple[str, float, Optional[Expected]]]) -> str:
    each = ", ".join(f"{stage} {duration(seconds)}" + (f" for {'>= ' if e.floor else ''}{duration(e.seconds)}" if e
                                                        else " (no estimate)") for stage, seconds, e in ran)
    timed = [(seconds, e) for _, seconds, e in ran if e]
    if not timed:
        return f"time against the plan: no stage that ran had an estimate (the next plan times them by these: {each})"
    took, total = sum(s for s, _ in timed), sum(e.seconds for _, e in timed)
    what = "the stage the plan timed" if len(timed) == 1 else f"the {len(timed)} stages the plan timed"
    ratio = "at least " if any(e.floor for _, e in timed) else f"{took / max(total, 1e-9):.2f}x of "
    return f"time against the plan: {what} took {duration(took)}, {ratio}{duration(total)} planned ({each})"


def evaluate_time(evaluate, n_parameters: int) -> str:
    """The evaluate stage's floor: a forward pass (2 FLOPs per parameter and token) over its tasks' local data, at
    least a token per 4 bytes (a byte tokenizer's 1, a BPE's 3-4), in fp32 on one GPU or this machine's cores."""
    import torch

    from plugins.evaluate.harness import data_bytes

    nbytes, unknown = data_bytes(evaluate)
    rate = matmul_rate("cuda", "fp32", 1) if torch.cuda.is_available() else matmul_rate("cpu", "fp32", usable_cores())
    flops = 2.0 * n_parameters * nbytes / 4
    others = f" ({', '.join(unknown)}: data not known before it is read)" if unknown else ""
    return (f"evaluate: at least {duration(flops / rate)} for its tasks' {size_text(nbytes)} of local data"
            f"{others}, each multiple-choice answer a pass of its own")


def saves_line(cfg, plan: Plan) -> str:
    """The checkpoints' and the aggregate's time at this disk's rate (cache_dir's, shared by the nodes on SLURM):
    a save or an aggregate of about that size measured here before, else a file written now (storage.disk_speed)."""
    t = cfg.train
    checkpoint, aggregate = plan.stages["checkpoint"].writes, plan.stages["aggregate"].writes
    saves = checkpoint_saves(t)
    root = Path(cfg.cache_dir).resolve()
    try:
        root.mkdir(parents=True, exist_ok=True)  # where the run writes next (a dry run does not come here)
        kind = aggregate_kind(cfg.aggregate.onnx)
        rates = rates_for(root, {"checkpoint": checkpoint, kind: aggregate})
    except OSError as e:  # a full or read-only disk is refused elsewhere; the estimate is only left out
        return f"saves: {saves} checkpoint(s) of {size_text(checkpoint)} (this disk's speed not measured: {e})"
    how = ("written in the background (train.async_checkpoint=async): a step waits for the copy to host memory, "
           "and a save for the one before") if t.get("async_checkpoint") == "async" else \
        "the steps wait for each (train.async_checkpoint=async writes them in the background)"
    return (f"saves: {saves} checkpoint(s) of {size_text(checkpoint)}, each {_timed(checkpoint, rates['checkpoint'])}: "
            f"{how}; the aggregate's {size_text(aggregate)} {_timed(aggregate, rates[kind])}")


def _timed(nbytes: int, rate) -> str:
    return (f"{'at least' if rate.floor else 'about'} {duration(nbytes / rate.bytes_per_s)} at "
            f"{rate.bytes_per_s / 2**20:,.0f} MB/s ({rate.source})")


def step_floor(cfg, flops: float) -> tuple[float, float, str]:
    """(seconds a train step of `flops` takes at least here, the matmul rate measured now, what measured it)."""
    import torch

    ranks = world_size(cfg.parallel)
    if torch.cuda.is_available():
        gpus = min(ranks, torch.cuda.device_count())
        rate, where = matmul_rate("cuda", cfg.precision.name, 1) * gpus, f"{gpus} GPU(s), {cfg.precision.name}"
    else:
        threads = min(usable_cores(), rank_threads(cfg.cluster.get("threads_per_rank"), ranks) * ranks)
        rate, where = matmul_rate("cpu", "fp32", threads), f"{threads} CPU thread(s)"
    return flops / rate, rate, where


def duration(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1000:,.0f} ms"
    if seconds < 120:
        return f"{seconds:,.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:,.0f} min"
    return f"{seconds / 3600:,.1f} h"
