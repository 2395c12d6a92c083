"""plan.calibrate_steps=N: time N train steps of this layout before the plan is made, so that a first run's plan
gives its train time as an estimate, not a floor.

Only where nothing comparable was timed on this machine (planning/stage_time.py reads the same records). The
calibration is the run itself cut short: the same config with train.steps=N, evaluated and saved once mid-way (the
run's pauses timed) and at the end, tracked as the run is (what MLflow costs a stage is timed too; its parent run
tagged orchestrator.kind=calibration), stopped after train (orchestrate(until="train")). Its tokenize, export and
transform are the run's own (the run then finds them cached); its train stage leaves its record in the store's
.stage_times.json, which the plan reads next, and its N-step model is deleted. A stage that fails there would fail
the same way in the run: the run stops with its report. It prints its plan's table and its stages' lines only:
the run's plan, next, says the rest.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig

from common.problem import Problem
from planning.plan_time import expected_times
from planning.stage_time import Timing
from runtime.cadence import WARMUP_STEPS_EXCLUDED

FOLDER = "calibration"  # in the run's folder: the calibration's own run folder


def check(cfg: DictConfig) -> list:
    n = cfg.plan.calibrate_steps
    if 0 < n <= WARMUP_STEPS_EXCLUDED:
        return [Problem("plan.calibrate_steps", n, f"the first {WARMUP_STEPS_EXCLUDED} steps of a run are warm-up "
                        "(allocator, caches), left out of a step's time: there would be no step left to time",
                        f"plan.calibrate_steps={WARMUP_STEPS_EXCLUDED + 5}, or 0 (no calibration)")]
    if n and cfg.cluster.name == "slurm":
        return [Problem("plan.calibrate_steps", n, "a calibration times steps on this machine, and a SLURM run's "
                        "steps run on the cluster's nodes (the plan times them by the jobs that ran there)",
                        "plan.calibrate_steps=0 with cluster=slurm, or cluster=local")]
    return []


def wanted(cfg: DictConfig, to_run: list[str], store: Path, until: Optional[str], timing: Timing) -> bool:
    """Calibrate: asked to, the train stage is to run, and no comparable train was timed here (not for a run
    that stops after train anyway, as a layout trial, nor for a dry run or a data preview, which start nothing, nor
    for a run no longer than its calibration would be: it times itself). timing: the run's (planning/stage_time.py)."""
    return bool(0 < cfg.plan.calibrate_steps < cfg.train.steps and "train" in to_run and until is None
                and not cfg.dry_run and not cfg.data.preview
                and expected_times(cfg, timing, ["train"], store)["train"].floor)


def calibration_run(cfg: DictConfig, run_dir: Path, overrides: list[str]) -> tuple[DictConfig, Path, list[str]]:
    """The calibration's config, run folder and overrides: the run's, cut to plan.calibrate_steps steps."""
    n = cfg.plan.calibrate_steps
    short = copy.deepcopy(cfg)
    half = n - n // 2  # one evaluation and one save mid-way: the run's pauses timed too
    cut = {"train.steps": n, "train.eval_every": half, "train.checkpoint_every": half, "plan.calibrate_steps": 0}
    for dotted, value in cut.items():
        section, name = dotted.split(".")
        short[section][name] = value
    kept = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in cut]
    return short, run_dir / FOLDER, [*kept, *(f"{k}={v}" for k, v in cut.items())]


def heading(cfg: DictConfig) -> str:
    return (f"calibration (plan.calibrate_steps={cfg.plan.calibrate_steps}): no run of this layout was timed on this "
            f"machine yet; timing {cfg.plan.calibrate_steps} steps of it before the plan")
