"""One command for a run or an experiment of phases (orchestrator/phases.py): every phase planned first, its plan
printed under its own heading, then the phases run in order, each as a run of its own (orchestrator/run.py) in its
own folder of the experiment's (`<run folder>/<phase>`).

What is shared is the cache: a phase whose stages are cached is a hit, an interrupted one resumes from its
checkpoint, and a sweep's points share the phases they have in common. On SLURM every phase is submitted at once:
a stage that reads an earlier phase's model waits for its aggregate's job (`afterok`: orchestrator/cluster/
slurm_submit.py). In MLflow the experiment is a run with a child run per phase, each tagged with the phase it
started from (`orchestrator.started_from`).
"""
from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Optional

from omegaconf import DictConfig
from rich.text import Text

from orchestrator import interrupt
from orchestrator.phases import Phase, compose, has_phases, retarget, trains
from orchestrator.report import Report, StageResult, console, result_table
from orchestrator.run import orchestrate, plan_point, run_planned
from orchestrator.run_plan import PLANNING, RunPlan
from planning.stage_time import Expected

if TYPE_CHECKING:
    from orchestrator.tracking.tracker import Invocation


def conduct(cfg: DictConfig, run_dir: Path, overrides: list[str], sweep_run_id: Optional[str] = None,
            follow_jobs: bool = True, heading: Optional[str] = None) -> Report:
    """Run what the command describes: one run (orchestrate), or an experiment's phases in order."""
    if not has_phases(cfg):
        return orchestrate(cfg, run_dir, overrides, sweep_run_id, follow_jobs, heading=heading)
    return _experiment(cfg, run_dir, overrides, sweep_run_id, follow_jobs, heading)


@dataclass
class ExperimentReport(Report):
    """The phases' reports, their stages named by phase (sft/train); the experiment's scores are its last scoring
    phase's, its train summary its last training phase's (what a sweep over a later phase optimises)."""
    phases: list[tuple[Phase, Report]] = field(default_factory=list)

    def scores(self, cfg) -> dict:
        return next((s for p, r in reversed(self.phases) if (s := r.scores(p.cfg))), {})

    def train_summary(self, cfg) -> dict:
        return next((s for p, r in reversed(self.phases) if trains(p.cfg) and (s := r.train_summary(p.cfg))), {})

    @property
    def job_dirs(self) -> list[Path]:
        return [d for _, r in self.phases for d in r.job_dirs]

    def with_followed(self, followed: list[Report]) -> "ExperimentReport":
        reports = iter(followed)
        for phase, report in list(self.phases):
            for _ in report.job_dirs:
                _add(self, phase, next(reports))
        return self


def _experiment(cfg: DictConfig, run_dir: Path, overrides: list[str], sweep_run_id: Optional[str],
                follow_jobs: bool, heading: Optional[str]) -> ExperimentReport:
    """Plan every phase, then run them in order (submit them all, on SLURM), under the experiment's MLflow run."""
    t0 = time.perf_counter()
    with PLANNING:  # Hydra's composition, one sweep point at a time (orchestrator/run_plan.py says why)
        phases = compose(cfg, overrides)
    if heading:
        console.rule(Text(heading))
    report = ExperimentReport(run_dir)
    planned = _plan_phases(cfg, phases, run_dir, report, sweep_run_id)
    if planned is None:  # a dry run, a preview, a calibration that failed: nothing runs
        return _finish(report, None, t0)
    tracked = _experiment_run(cfg, run_dir, overrides, sweep_run_id, phases)
    try:
        _run_phases(cfg, planned, report, tracked.parent if tracked else sweep_run_id, follow_jobs)
    except BaseException:
        _close(tracked, "KILLED" if interrupt.requested() else "FAILED")
        raise
    return _finish(report, tracked, t0)


def _plan_phases(cfg: DictConfig, phases: list[Phase], run_dir: Path, report: ExperimentReport,
                 sweep_run_id: Optional[str]) -> Optional[list[tuple[Phase, RunPlan]]]:
    """Each phase's plan, printed under its heading, then the experiment's line of totals (None: a phase's plan
    ended the run: a dry run, a preview, a calibration that failed)."""
    planned: list[tuple[Phase, RunPlan]] = []
    for i, phase in enumerate(phases, 1):
        title = f"phase {phase.name} ({i} of {len(phases)})" + (f": from phase {phase.start}" if phase.start else "")
        run = plan_point(_planned_config(phase), run_dir / phase.name, phase.overrides, sweep_run_id, kind="phase",
                         heading=title)
        if isinstance(run, Report):
            _add(report, phase, run)
            continue
        planned.append((phase, run))
        aggregate = next((ps.key for ps in run.plan if ps.name == "aggregate"), None)
        if aggregate:  # the key its plan gave it (train.epochs counted into steps changes it): what later ones read
            retarget(phases, phase, aggregate, run.cache.root)
    if len(planned) == len(phases):
        console.print(_totals([(p, r.to_run, len(r.plan), [r.planned[n] for n in r.to_run]) for p, r in planned]),
                      soft_wrap=True)
        return planned
    if cfg.dry_run:  # every phase planned and nothing run: the experiment's plan in one line all the same
        console.print(_totals([(p, r.to_run, len(r.plan), r.planned.values()) for p, r in planned] + [
            (p, [s["stage"] for s in plan if not s["cached"]], len(plan), []) for p, r in report.phases
            if (plan := _plan_file(r.run_dir))]), soft_wrap=True)
    return None


def _run_phases(cfg: DictConfig, planned: list[tuple[Phase, RunPlan]], report: ExperimentReport,
                parent: Optional[str], follow_jobs: bool) -> None:
    """The phases in order, each a run of its own; after one that fails, the later ones are "not run"."""
    on_slurm = cfg.cluster.name == "slurm"
    started_from: dict[str, str] = {}
    for phase, run in planned:
        if report.exit_code:  # an earlier phase failed or was interrupted: the later ones start from nothing
            _add(report, phase, Report(run.run_dir, {ps.name: StageResult(ps.name, ps.key, "not run", summary=(
                f"needs phase {phase.start}" if phase.start else "an earlier phase did not finish"))
                for ps in run.plan}))
            continue
        tags = {"orchestrator.phase": phase.name,
                **({"orchestrator.started_from": started_from.get(phase.start, phase.start)} if phase.start else {})}
        done = run_planned(run, phase.overrides, parent, follow_jobs=follow_jobs and not on_slurm, kind="phase",
                           tags=tags, name=f"phase {phase.name}")
        started_from[phase.name] = f"phase {phase.name}" + (f" (run {done.parent_run_id})" if done.parent_run_id
                                                            else "")
        _add(report, phase, done)
    if on_slurm and follow_jobs and cfg.cluster.wait and report.job_dirs:
        from orchestrator.cluster.follow import follow

        report.with_followed(follow(report.job_dirs))


def _planned_config(phase: Phase) -> DictConfig:
    """A phase's config for its plan: one that starts from a model not written yet is not calibrated (its first
    steps cannot be timed before the model exists; its plan gives the train time's floor)."""
    from storage import hf
    from storage.init_from import PROMISED

    folder = hf.folder_of(phase.cfg.train.init_from)
    if not (phase.start and folder and str(folder) in PROMISED and not folder.is_dir() and
            phase.cfg.plan.calibrate_steps):
        return phase.cfg
    cfg = copy.deepcopy(phase.cfg)
    cfg.plan.calibrate_steps = 0
    return cfg


def _add(report: ExperimentReport, phase: Phase, done: Report) -> None:
    """A phase's report into the experiment's (a later one, of the same phase, replaces it: SLURM's follow)."""
    report.phases = [(p, r) for p, r in report.phases if p.name != phase.name] + [(phase, done)]
    for name, result in done.results.items():
        report.results[f"{phase.name}/{name}"] = dataclasses.replace(result, name=f"{phase.name}/{name}")
    report.submitted = any(r.submitted for _, r in report.phases)  # jobs left running (SLURM, cluster.wait=false)


def _totals(phases: list[tuple[Phase, list[str], int, Iterable[Optional[Expected]]]]) -> str:
    """The experiment's plan in one line: its phases, the stages each runs and the time they are expected to take
    (phases: each one's stages to run, its count of stages, their expected times where known)."""
    expected = [e for *_, times in phases for e in times if e is not None]
    time = f"; expected {'at least ' if any(e.floor for e in expected) else 'about '}" \
        f"{sum(e.seconds for e in expected):,.0f} s in all" if sum(e.seconds for e in expected) >= 1 else ""
    return f"experiment: {len(phases)} phases (" + "; ".join(f"{p.name}: {len(to_run)} of {n} stages to run"
                                                             for p, to_run, n, _ in phases) + f"){time}"


def _plan_file(run_dir: Path) -> list:
    from storage.fsio import read_json

    try:
        return read_json(run_dir / "plan.json")
    except (OSError, ValueError):
        return []


def _experiment_run(cfg: DictConfig, run_dir: Path, overrides: list[str], sweep_run_id: Optional[str],
                    phases: list[Phase]) -> Optional["Invocation"]:
    """The experiment's MLflow run (its `parent`: the phases' parent), or None: not tracked."""
    if cfg.tracking.name != "mlflow":
        return None
    from orchestrator.tracking.tracker import OVERRIDES_TAG_CHARS, Invocation, run_name

    return Invocation(cfg, f"experiment {run_name(overrides)}", {
        "orchestrator.kind": "experiment", "orchestrator.run_dir": str(run_dir.resolve()),
        "orchestrator.overrides": " ".join(overrides)[:OVERRIDES_TAG_CHARS],
        "orchestrator.phases": " ".join(p.name for p in phases),
        **({"mlflow.parentRunId": sweep_run_id} if sweep_run_id else {})}, log_config=False)


def _finish(report: ExperimentReport, tracked: Optional["Invocation"], t0: float) -> ExperimentReport:
    total = time.perf_counter() - t0
    if len(report.phases) > 1 and report.results:
        console.print(result_table(list(report.results.values()), total, "experiment"))
    interrupted = any(r.status == "interrupted" for r in report.results.values())
    _close(tracked, "KILLED" if interrupted else "FAILED" if report.exit_code else "FINISHED", {"wall_s": total},
           "submitted" if report.submitted else None)
    return report


def _close(tracked: Optional["Invocation"], status: str, metrics: Optional[dict] = None,
           said: Optional[str] = None) -> None:
    """The experiment's MLflow run ended (jobs left on SLURM: FINISHED, tagged submitted; their outcomes are the
    phases' runs')."""
    if tracked is not None:
        tracked.end_run(tracked.parent, status, metrics, {"orchestrator.status": said} if said else None)
