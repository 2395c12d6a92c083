"""`python -m orchestrator -m a=1,2 b=x,y`: a sweep, launched by this Hydra launcher (the default one).

Unlike Hydra's submitit launcher, each point keeps its own resources (a ddp2 point gets 2 tasks, a
megatron_hp4 point 4) and its own stage DAG. Every point is validated before anything starts. On SLURM all
points are submitted at once and followed together; stages that several points share (same content key, e.g.
one export for a sweep over optimizer settings) are submitted once and depended on. On local clusters the
points run one after another, or `sweep.parallelism` at a time (a one-rank stage then takes its share of the
cores, not all of them). The sweep ends with a summary table, and MLflow holds one sweep run with a run per point
below it (stage runs below those).

Each point returns its objective (`sweep.objective`, orchestrator/sweeps/objective.py) to the sweeper, so Hydra's
Optuna, Nevergrad and Ax sweepers optimise it. Those sweepers call the launcher once per batch of trials: the
batches are one study here (the launcher keeps its points), with one sweep run, a summary rewritten after every
batch, and one table, best first, printed when Hydra is done (`finish_study`, called by `python -m orchestrator`).
"""
from __future__ import annotations

import copy
import json
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus, filter_overrides, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict
from rich.table import Table

from orchestrator import interrupt
from orchestrator.sweeps import objective, pictures
from orchestrator.config.errors import ConfigError, Problem
from orchestrator.report import EXIT_CODES, Report, console, plain_text, result_table, styled
from storage.fsio import atomic_write_json
from runtime.threads import cores_shared_by


@dataclass
class Point:
    index: int
    overrides: list[str]
    cfg: DictConfig              # the experiment (no hydra node)
    hydra_cfg: DictConfig        # the whole composed config, as Hydra's JobReturn wants it
    run_dir: Path
    report: Optional[Report] = None
    error: Optional[str] = None
    interrupted: bool = False    # a signal stopped it before its stages' results were in
    rejected: Optional["InvalidPoint"] = None  # invalid, found when an optimising sweeper picked it: not run


class SweepConfigError(ConfigError):
    def __init__(self, failures: list[tuple[list[str], ConfigError]]):
        self.failures = failures
        super().__init__([p for _, e in failures for p in e.problems])

    def __str__(self) -> str:
        return "\n".join([f"invalid sweep, nothing was started ({len(self.failures)} point(s) have problems):"] +
                         [f"point {' '.join(o) or '(no overrides)'}:\n" +
                          "\n".join(str(ConfigError(e.problems)).splitlines()[1:])
                          for o, e in self.failures])


class InvalidPoint(ConfigError):
    """A point an optimising sweeper picked that validation refuses (its space was too large to check every
    combination before the first): its trial is recorded FAIL and `invalid` (orchestrator/sweeps/study.py) and never
    run again; the sweep stops with this refusal after the batch's other points."""

    def __init__(self, overrides: list[str], error: ConfigError):
        self.overrides = overrides
        super().__init__(error.problems)

    def __str__(self) -> str:
        return "\n".join(["the sweeper picked an invalid point, recorded in its study as a failed trial (it is not "
                          "picked again); the sweep stopped: run the same command to go on with other points",
                          f"point {' '.join(self.overrides)}:"] + str(ConfigError(self.problems)).splitlines()[1:])


def _every_point_checked(config: DictConfig) -> bool:
    """Whether the command's check validated every point the sweeper can launch (orchestrator/sweeps/check.py):
    the basic sweeper's always (above sweep.max_points it is refused)."""
    return str(OmegaConf.select(config, "hydra.sweeper._target_", default="")).endswith("BasicSweeper")


_ACTIVE: list["SweepLauncher"] = []  # the study this process runs (finish_study prints and closes it)


class SweepLauncher(Launcher):
    def __init__(self) -> None:
        self.config: Optional[DictConfig] = None
        self.hydra_context: Optional[HydraContext] = None
        self.points: list[Point] = []   # every batch's points: one study
        self.sweep_run: Optional[str] = None
        self.t0 = 0.0
        self.study_file: Optional[Path] = None  # an Optuna study's, as orchestrator/sweeps/study.py keeps it

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from orchestrator.config.resolve import with_tokenizer
        from orchestrator.config.validate import validate

        setup_globals()
        sweep_dir = Path(str(self.config.hydra.sweep.dir)).resolve()
        points = [self._compose(initial_job_idx + i, list(o), sweep_dir) for i, o in enumerate(job_overrides)]
        for p in points:
            try:
                validate(with_tokenizer(p.cfg), p.overrides)  # as the point's run resolves it first
                _check_direction(p.cfg, self.config)
            except ConfigError as e:  # a point the sampler picked: a failed trial (the batch's others run)
                p.rejected = InvalidPoint(p.overrides, e)
        failures = [(p.overrides, p.rejected) for p in points if p.rejected]
        if failures and _every_point_checked(self.config):  # a change since the check (a file removed): none runs
            raise SweepConfigError(failures)
        if not self.points:  # the study's first batch
            self.t0 = time.perf_counter()
            console.print(f"sweep in {sweep_dir}", soft_wrap=True)
            self.sweep_run = _start_sweep_run(points, sweep_dir)
            _ACTIVE.append(self)
        self.points += points
        try:
            _run_points([p for p in points if p.rejected is None], self.sweep_run)
        finally:
            write_summary(summary_rows(self.points), self.points, sweep_dir, time.perf_counter() - self.t0)
        return [self._job_return(p) for p in points]

    def finish(self, interrupted: bool = False) -> None:
        sweep_dir = Path(str(self.config.hydra.sweep.dir)).resolve()
        _finish(self.points, sweep_dir, self.sweep_run, time.perf_counter() - self.t0, interrupted, self.study_file)

    def statuses(self) -> dict[int, str]:
        """Each point's status (the sweep table's words) by its index: an Optuna study's trial number."""
        return {p.index: _status(p) for p in self.points}

    def finished_values(self, n: int) -> list[Optional[float]]:
        """The objectives of the last n points, None where a point did not finish (interrupted or not run): what a
        sweeper stopped by a signal may still record (orchestrator/sweeps/study.py)."""
        return [_objective(p) if _status(p) not in ("interrupted", "not run", "submitted") else None
                for p in self.points[-n:]]

    def _compose(self, index: int, overrides: list[str], sweep_dir: Path) -> Point:
        hydra_cfg = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        with open_dict(hydra_cfg):
            hydra_cfg.hydra.job.id = index
            hydra_cfg.hydra.job.num = index
        HydraConfig.instance().set_config(hydra_cfg)
        run_dir = sweep_dir / str(hydra_cfg.hydra.sweep.subdir)
        cfg = copy.deepcopy(hydra_cfg)
        with open_dict(cfg):
            del cfg["hydra"]
        return Point(index, list(filter_overrides(overrides)), cfg, hydra_cfg, run_dir)

    def _job_return(self, p: Point) -> JobReturn:
        """The sweeper gets the point's objective (the worst value when it did not train: a failed trial, not a
        failed study)."""
        ret = JobReturn(overrides=p.overrides, cfg=p.cfg, hydra_cfg=p.hydra_cfg, working_dir=str(p.run_dir),
                        task_name=str(p.hydra_cfg.hydra.job.name),
                        status=JobStatus.FAILED if p.rejected else JobStatus.COMPLETED)
        ret.return_value = p.rejected or _objective(p)  # the sweeper tells a rejected trial FAIL, then raises it
        return ret


def finish_study(interrupted: bool = False) -> None:
    """The summary table of the study this process ran (if any), and its MLflow sweep run closed."""
    while _ACTIVE:
        _ACTIVE.pop().finish(interrupted)


def _check_direction(cfg: DictConfig, hydra_cfg: DictConfig) -> None:
    """A sweeper told to maximise a loss (or minimise a speed) would optimise the wrong way, quietly."""
    wanted = OmegaConf.select(hydra_cfg, "hydra.sweeper.direction")
    if wanted is None:
        return
    wanted = [str(w).lower().rsplit(".", 1)[-1] for w in (wanted if OmegaConf.is_list(wanted) else [wanted])]
    natural = objective.direction(cfg.sweep.objective, cfg)  # Optuna's config holds an enum: Direction.minimize
    if len(wanted) == 1 and wanted[0] != natural:
        other = next(o for o in objective.OBJECTIVES if objective.direction(o) != natural)
        raise ConfigError([Problem("hydra.sweeper.direction", str(wanted[0]),
                                   f"sweep.objective={cfg.sweep.objective} improves when it goes "
                                   f"{'down' if natural == 'minimize' else 'up'}",
                                   f"hydra.sweeper.direction={natural}, or a sweep.objective to "
                                   f"{wanted[0]} (e.g. sweep.objective={other})")])


def _run_points(points: list[Point], sweep_run: Optional[str]) -> None:
    """Run (or submit) the points. A signal stops the whole sweep: the point in flight takes the single run's path
    (its ranks save, its stages end interrupted), no further point starts, and KeyboardInterrupt goes up to the
    command (the sweeper, Optuna's included, stops with it; the summary says interrupted and not run)."""
    from orchestrator.cluster.follow import follow
    from orchestrator.experiment import conduct

    stopped = threading.Event()

    def run(p: Point, follow_jobs: bool) -> None:
        if stopped.is_set() or interrupt.requested():  # a point queued behind others (sweep.parallelism)
            return
        try:
            p.report = conduct(p.cfg, p.run_dir, p.overrides, sweep_run, follow_jobs=follow_jobs,
                                   heading=f"point {p.index}: {' '.join(p.overrides) or '(no overrides)'}")
        except ConfigError as e:  # e.g. SLURM refused a job: that point is reported, the others go on
            p.error = str(e)
            console.print(f"error: {e}", soft_wrap=True)
        except KeyboardInterrupt:  # a second signal, or one between stages
            p.interrupted = True
            stopped.set()
            raise
        if p.report is not None and any(r.status == "interrupted" for r in p.report.results.values()):
            stopped.set()

    on_slurm = [p for p in points if p.cfg.cluster.name == "slurm"]
    here = [p for p in points if p.cfg.cluster.name != "slurm"]
    for p in on_slurm:  # all submitted before any is waited for: SLURM runs them concurrently
        run(p, follow_jobs=False)
    parallelism = max((p.cfg.sweep.parallelism for p in here), default=1)
    if parallelism > 1 and len(here) > 1:
        with cores_shared_by(min(parallelism, len(here))), ThreadPoolExecutor(parallelism) as pool:
            list(pool.map(lambda p: run(p, True), here))
    else:
        for p in here:
            run(p, True)
    if stopped.is_set() or interrupt.requested():
        raise KeyboardInterrupt
    submitted = [p for p in on_slurm if p.report and p.report.submitted and p.report.job_dirs]
    waiting = [p for p in submitted if p.cfg.cluster.wait]
    if waiting:
        t0 = time.perf_counter()
        followed = iter(follow([d for p in waiting for d in p.report.job_dirs]))  # an experiment's: a folder a phase
        for p in waiting:
            p.report = p.report.with_followed([next(followed) for _ in p.report.job_dirs])
            console.print(result_table(list(p.report.results.values()), time.perf_counter() - t0,
                                       f"point {p.index} ({p.run_dir})"))
    elif submitted:
        dirs = " ".join(str(d) for p in submitted for d in p.report.job_dirs)
        console.print(f"submitted; follow the jobs with: python -m orchestrator.follow {dirs}", soft_wrap=True)


def _train_summary(p: Point) -> dict:
    return p.report.train_summary(p.cfg) if p.report else {}


def _scores(p: Point) -> dict:
    return p.report.scores(p.cfg) if p.report else {}


def _objective(p: Point) -> float:
    """What the point returns to the sweeper (sweep.objective; the worst value when it did not train)."""
    return objective.value(p.cfg.sweep.objective, _train_summary(p), _scores(p), p.cfg)


def _status(p: Point) -> str:
    if p.interrupted:
        return "interrupted"
    if p.error or p.rejected:
        return "rejected"
    if p.report is None:
        return "not run"
    if p.report.submitted and not p.report.results:
        return "submitted"
    statuses = {r.status for r in p.report.results.values()}
    if "interrupted" in statuses:
        return "interrupted"
    if "failed" in statuses or "not run" in statuses:
        return "failed"
    return "cached" if statuses == {"cached"} else "ok"


def summary_rows(points: list[Point]) -> list[dict]:
    """One row per point, best objective first; `overrides` shows what varies between points (all of a point's
    overrides if none do)."""
    common = set.intersection(*(set(p.overrides) for p in points)) if len(points) > 1 else set()
    rows = []
    for p in points:
        s = _train_summary(p)
        par = p.cfg.parallel
        rows.append({"point": p.index, "overrides": " ".join(o for o in p.overrides if o not in common) or
                     " ".join(p.overrides), "all_overrides": p.overrides, "layout": f"dp{par.dp} hp{par.hp} pp{par.pp}",
                     "objective": objective.value(p.cfg.sweep.objective, s, _scores(p), p.cfg),
                     "objective_stderr": objective.stderr(p.cfg.sweep.objective, _scores(p)),
                     "final_loss": s.get("final_loss"), "final_eval_loss": s.get("final_eval_loss"),
                     "tokens_per_s": s.get("tokens_per_s"), "peak_memory_mb": s.get("peak_memory_mb"),
                     "status": _status(p), "not_learned": s.get("not_learned"), "run_dir": str(p.run_dir),
                     "mlflow_run_id": p.report.parent_run_id if p.report else None})
    return objective.best_first(rows, points[0].cfg.sweep.objective, points[0].cfg) if points else rows


def _table(rows: list[dict], name: str, seconds: float) -> Table:
    table = Table(title=f"sweep: {len(rows)} point(s), {seconds:.1f} s, best {name} first", title_justify="left")
    for col in ("#", "overrides", "layout", name, "final loss", "tokens/s", "status"):
        table.add_column(col)
    style = {"ok": "bold green", "cached": "green", "failed": "bold red", "rejected": "bold red"}  # else yellow
    for r in rows:
        table.add_row(str(r["point"]), r["overrides"], r["layout"],
                      _with_stderr(r["objective"], r.get("objective_stderr")),
                      f"{r['final_loss']:.4f}" if r["final_loss"] is not None else "-",
                      f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "-",
                      styled(r["status"], style.get(r["status"], "yellow")) if not r.get("not_learned") else
                      styled(f"{r['status']}, learned nothing", "bold yellow"))
    return table


def _with_stderr(value: float, stderr: Optional[float]) -> str:
    """An objective as the table shows it, with its standard error where the score has one (lm-eval's): two points
    within it of each other are not told apart by it."""
    if not math.isfinite(value):
        return "-"
    return f"{value:.6g}" + (f" ± {stderr:.2g}" if stderr is not None and math.isfinite(stderr) else "")


def _best(rows: list[dict]) -> Optional[dict]:
    """The best point of rows ranked best first (None when no point trained)."""
    return next((r for r in rows if math.isfinite(r["objective"])), None)


def write_summary(rows: list[dict], points: list[Point], sweep_dir: Path, seconds: float,
                  pictures: Sequence[Path] = ()) -> Table:
    """sweep_summary.json and .txt of the points so far, their summary_rows (rewritten after every batch: a study
    cut short keeps what it measured); pictures: those drawn of them (at the end)."""
    name = points[0].cfg.sweep.objective
    table = _table(rows, name, seconds)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(sweep_dir / "sweep_summary.json", {
        "wall_s": seconds, "objective": name, "direction": objective.direction(name, points[0].cfg),
        "best": _best(rows), "points": rows, "pictures": [p.name for p in pictures]})
    (sweep_dir / "sweep_summary.txt").write_text(plain_text(table))
    return table


def _start_sweep_run(points: list[Point], sweep_dir: Path) -> Optional[str]:
    tracked = [p for p in points if p.cfg.tracking.name == "mlflow"]
    if not tracked:
        return None
    from orchestrator.tracking.tracker import Invocation

    inv = Invocation(tracked[0].cfg, f"sweep {sweep_dir.parent.name}/{sweep_dir.name}",
                     {"orchestrator.kind": "sweep", "orchestrator.sweep_dir": str(sweep_dir)}, log_config=False)
    inv.log_params(inv.parent, {"sweep.points": str(len(points)),
                                "sweep.overrides": "; ".join(" ".join(p.overrides) for p in points)})
    return inv.parent


def _pictures(rows: list[dict], points: list[Point], sweep_dir: Path, study_file: Optional[Path]) -> list[Path]:
    """The sweep's pictures (orchestrator/sweeps/pictures.py): what they cannot show costs a line, never the
    sweep's summary, exit code or MLflow run."""
    if not points:
        return []
    try:
        study = json.loads(study_file.read_text()) if study_file is not None and study_file.is_file() else None
        return pictures.draw(rows, points[0].cfg.sweep.objective, sweep_dir, study)
    except Exception as e:  # noqa: BLE001 (a picture is a view of results kept elsewhere)
        console.print(f"warning: the sweep's pictures were not drawn: {type(e).__name__}: {e}", soft_wrap=True)
        return []


def _finish(points: list[Point], sweep_dir: Path, sweep_run: Optional[str], seconds: float,
            interrupted: bool = False, study_file: Optional[Path] = None) -> None:
    rows = summary_rows(points)
    drawn = _pictures(rows, points, sweep_dir, study_file)
    table = write_summary(rows, points, sweep_dir, seconds, drawn)
    console.print(table)
    if drawn:
        console.print(f"pictures: {', '.join(p.name for p in drawn)} in {sweep_dir}", soft_wrap=True)
    failed = any(r["status"] in ("failed", "rejected", "not run") for r in rows)
    if sweep_run:
        from orchestrator.tracking.tracker import _client

        client = _client(points[0].cfg.tracking.uri)
        client.log_artifact(sweep_run, str(sweep_dir / "sweep_summary.json"))
        client.log_artifact(sweep_run, str(sweep_dir / "sweep_summary.txt"))
        for picture in drawn:
            client.log_artifact(sweep_run, str(picture))
        client.log_metric(sweep_run, "wall_s", seconds)
        best = _best(rows)
        if best:
            client.log_metric(sweep_run, f"best_{points[0].cfg.sweep.objective}", best["objective"])
            client.set_tag(sweep_run, "orchestrator.best_point", best["overrides"])
        status = "interrupted" if interrupted else "failed" if failed else "ok"
        client.set_tag(sweep_run, "orchestrator.status", status)
        client.set_terminated(sweep_run, {"interrupted": "KILLED", "failed": "FAILED"}.get(status, "FINISHED"))
    EXIT_CODES.append(2 if any(r["status"] == "rejected" for r in rows) else 1 if failed else 0)
