"""The conductor: plan (orchestrator/run_plan.py), then run every stage that is not cached, in order, and report.

A failed stage marks its dependants "not run" and the command exits non-zero; the same command again
finds the finished stages in the cache and starts at the first one that is not (a train stage resumes
from its latest complete checkpoint).
"""
from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Optional, Union

from filelock import Timeout
from omegaconf import DictConfig
from rich.panel import Panel
from rich.text import Text

from orchestrator.cache.store import Cache, link_output
from orchestrator.dag import PlannedStage
from orchestrator.cluster.launch import Launch, write_spec
from orchestrator.report import Report, StageResult, console, result_table
from orchestrator.run_plan import RunPlan, plan_run
from orchestrator import calibration, interrupt
from orchestrator.cache import resume
from orchestrator.tracking import later as tracking_later
from orchestrator.tracking.tracker import OVERRIDES_TAG_CHARS, Invocation, absolute_uri, process_alive
from orchestrator.tracking.tracker import run_name as short_run_name
from planning import stage_time
from planning.plan_time import STARTUP_SAID_S, actual_line
from planning.stage_time import Expected, Timing
from storage.fsio import atomic_write_json, disk_space, read_json

ATTEMPT_FILE = "attempt.json"


def orchestrate(cfg: DictConfig, run_dir: Path, overrides: list[str], sweep_run_id: Optional[str] = None,
                follow_jobs: bool = True, until: Optional[str] = None, kind: str = "invocation",
                heading: Optional[str] = None) -> Report:
    """Run the experiment described by cfg (a dry run only plans it).

    sweep_run_id: the MLflow run of the sweep (or tune) this is a point of (its parent). follow_jobs=False (SLURM):
    return once the jobs are submitted (a sweep follows all its points' jobs together). until: run that stage and
    the stages it needs only (a layout trial stops after train). kind: the MLflow parent run's orchestrator.kind.
    heading: a rule printed above the plan (a sweep's point: its plan stays under it with points side by side)."""
    planned_run = plan_point(cfg, run_dir, overrides, sweep_run_id, until, kind, heading)
    if isinstance(planned_run, Report):
        return planned_run
    return run_planned(planned_run, overrides, sweep_run_id, follow_jobs, kind)


def plan_point(cfg: DictConfig, run_dir: Path, overrides: list[str], sweep_run_id: Optional[str] = None,
               until: Optional[str] = None, kind: str = "invocation", heading: Optional[str] = None
               ) -> Union[RunPlan, Report]:
    """The run planned (orchestrator/run_plan.py), its calibration and counting runs tracked under sweep_run_id."""
    return plan_run(cfg, run_dir, overrides, until, kind, heading, lambda *args: _calibrate(*args, sweep_run_id),
                    lambda *args: _tokenize_first(*args, sweep_run_id))


def run_planned(run: RunPlan, overrides: list[str], sweep_run_id: Optional[str], follow_jobs: bool, kind: str,
                tags: Optional[dict[str, str]] = None, name: Optional[str] = None) -> Report:
    """Open the run's tracking, then run every stage to run in order (or submit them all), and report. sweep_run_id:
    the MLflow run this one is a child of (a sweep's, an experiment's); tags, name: more of the run's tags, its name
    (else its overrides')."""
    cfg, plan, launches, cache, run_dir, planned, t0 = (run.cfg, run.plan, run.launches, run.cache, run.run_dir,
                                                       run.planned, run.t0)
    to_run, executor, config_path = run.to_run, run.executor, run.config_path
    tags = {"orchestrator.kind": kind, "orchestrator.run_dir": str(run_dir),
            "orchestrator.overrides": " ".join(overrides)[:OVERRIDES_TAG_CHARS],
            **({"mlflow.parentRunId": sweep_run_id} if sweep_run_id else {}), **(tags or {})}
    run_name = name or short_run_name(overrides)
    if tracking_later.worthwhile(cfg, nothing_to_run=not to_run):
        tracking = tracking_later.LaterInvocation(run_dir, run_name, tags)
    else:
        tracking = Invocation(cfg, run_name, tags) if cfg.tracking.name == "mlflow" else None
    if tracking:
        tracking.log_artifact(tracking.parent, config_path)
        tracking.log_artifact(tracking.parent, run_dir / "plan.json")
        tracking.log_artifact(tracking.parent, run_dir / "plan.txt")
    if cfg.cluster.name == "slurm":
        return _submit(cfg, plan, launches, cache, run_dir, tracking, follow_jobs and cfg.cluster.wait, t0, planned)

    report = Report(run_dir, parent_run_id=tracking.parent if isinstance(tracking, Invocation) else None)
    results = report.results
    try:
        for ps in plan:
            if interrupt.requested() and not any(r.status == "interrupted" for r in results.values()):
                raise KeyboardInterrupt  # a signal between stages, seen from a sweep's thread (main: raised there)
            blocked = [u for u in ps.stage.after if results[u].status in ("failed", "not run", "interrupted")]
            if blocked:
                results[ps.name] = StageResult(ps.name, ps.key, "not run", summary=f"needs {', '.join(blocked)}")
                if tracking:
                    run_id = tracking.start_stage(ps.name, ps.key, {}, {"orchestrator.status": "not run"})
                    tracking.end_run(run_id, "KILLED")
                continue
            results[ps.name] = _run_stage(cfg, ps, cache, launches[ps.name], executor, tracking, run.timing,
                                          planned.get(ps.name))
            link_output(run_dir, ps.name, cache.entry(ps.name, ps.key))
    except KeyboardInterrupt:
        if tracking:
            tracking.end_run(tracking.parent, "KILLED")
        raise

    failed = report.exit_code != 0
    interrupted = any(r.status == "interrupted" for r in results.values())
    total = time.perf_counter() - t0
    console.print(result_table(list(results.values()), total))
    waited = sum(r.waited_s for r in results.values())
    if waited >= STARTUP_SAID_S:
        stage_time.record(run.timing, cfg.train, stage_time.STARTUP, waited, run_dir, cache.root)
    against = actual_line(planned, {r.name: r.seconds for r in results.values() if r.status == "ran"}, waited)
    if against and kind != "calibration":  # planned by a floor: the calibration is what makes the run's plan
        console.print(against, soft_wrap=True)
    console.print(f"outputs: {run_dir}", soft_wrap=True)
    if results.get("aggregate") and results["aggregate"].status in ("ran", "cached"):
        from storage.adapters import PEFT  # the aggregate's folder of a LoRA run's adapters

        model = run_dir / "stages/aggregate/output"
        adapters = f" (merged); for peft: its {PEFT}/ folder, the adapters alone" if (model / PEFT).is_dir() else ""
        console.print(f"the trained model: {model} (in Python: orchestrator.load('{run_dir}'); for transformers: its "
                      f"hf/ folder{adapters})", soft_wrap=True)
    if interrupted:
        console.print("interrupted: nothing is lost; run the same command to continue", soft_wrap=True)
    if tracking:
        tracking.end_run(tracking.parent, "KILLED" if interrupted else "FAILED" if failed else "FINISHED",
                         {"wall_s": total},
                         {"orchestrator.status": "interrupted" if interrupted else "failed" if failed else "ok"})
        recorded = f"recorded by pid {tracking.pid} in the background, log {run_dir / tracking_later.LOG}" \
            if isinstance(tracking, tracking_later.LaterInvocation) else f"run {tracking.parent}"
        console.print(f"MLflow: mlflow ui --backend-store-uri {absolute_uri(cfg.tracking.uri)}  ({recorded})",
                      soft_wrap=True)
    return report


def _tokenize_first(cfg: DictConfig, run_dir: Path, overrides: list[str], sweep_run_id: Optional[str]) -> Report:
    """The tokenize stage alone (in a folder of the run's), so that train.epochs can count its examples."""
    console.rule(Text("train.epochs: the corpus is tokenized first, to count its examples"))
    done = orchestrate(cfg.copy(), run_dir / "tokenize_first", overrides, sweep_run_id, until="tokenize",
                       kind="tokenize")
    console.rule(Text("the run"))
    return done


def _calibrate(cfg: DictConfig, run_dir: Path, overrides: list[str], cache: Cache, sweep_run_id: Optional[str]
               ) -> Report:
    """A few steps of the run, timed for its plan (orchestrator/calibration.py); their model is then deleted."""
    console.rule(Text(calibration.heading(cfg)))
    timed = orchestrate(*calibration.calibration_run(cfg, run_dir, overrides), sweep_run_id, until="train",
                        kind="calibration")
    train = timed.results.get("train")
    if train is not None and train.status == "ran":
        cache.discard("train", train.key)
        (run_dir / calibration.FOLDER / "stages" / "train" / "output").unlink(missing_ok=True)
    console.rule(Text("the run"))
    return timed


def _submit(cfg: DictConfig, plan: list[PlannedStage], launches: dict[str, Launch], cache: Cache, run_dir: Path,
            tracking: Optional[Invocation], wait: bool, t0: float, planned: dict[str, Optional[Expected]]) -> Report:
    """cluster=slurm: every stage to run becomes a job, submitted now; then follow them (or return). Each job's time
    is what sacct says it ran (its wait in the queue left out), recorded by follow for the next plan."""
    from orchestrator.cluster.follow import follow
    from orchestrator.cluster.slurm_submit import submit_plan

    submitted = submit_plan(cfg, plan, launches, cache, run_dir, tracking)
    for s in submitted:
        console.print(f"{s.stage}: job {s.job_id}" + (" (already queued by another run)" if s.shared else "") +
                      (f", after {', '.join(s.after)}" if s.after else ""), soft_wrap=True)
    if not wait:
        if submitted:
            console.print(f"submitted; follow the jobs with: python -m orchestrator.follow {run_dir}", soft_wrap=True)
        return Report(run_dir, parent_run_id=tracking.parent if tracking else None, submitted=True)
    report = follow([run_dir])[0]
    console.print(result_table(list(report.results.values()), time.perf_counter() - t0))
    against = actual_line(planned, {r.name: r.seconds for r in report.results.values() if r.status == "ran"})
    if against:
        console.print(against, soft_wrap=True)
    console.print(f"outputs: {run_dir}", soft_wrap=True)
    return report


def _run_stage(cfg: DictConfig, ps: PlannedStage, cache: Cache, launch: Launch, executor,
               tracking: Optional[Invocation], timing: Timing, planned: Optional[Expected] = None) -> StageResult:
    """Run one stage (or find it cached), and record its time for the next plan's (timing: the run's, what the
    record is kept by)."""
    if ps.cached:  # verified by the plan; an entry never changes, so no lock (a read-only cache has none to take)
        return _cached(ps, cache, tracking)
    with _stage_lock(cache, ps):
        if cache.is_complete(ps.name, ps.key):  # finished by a concurrent invocation
            return _cached(ps, cache, tracking)

        attempt_path = cache.work(ps.name, ps.key) / ATTEMPT_FILE
        _close_stale_attempt(attempt_path, tracking)
        run_id = None
        try:
            resume.begin(cfg, cache, ps)
            run_id = launch.open_run(tracking, cfg, "running")
            atomic_write_json(attempt_path, {**_this_process(),
                                             "runs": [r for r in (run_id, tracking and tracking.parent) if r]})
            write_spec(launch.spec_path, launch.spec)
        except OSError as e:  # a full disk, a read-only cache: say where, and leave no run RUNNING
            if tracking:
                tracking.end_run(run_id, "FAILED", tags={"orchestrator.status": "failed"})
            error = f"could not prepare the stage's folders in {cache.work(ps.name, ps.key)}: {e}" + disk_space(cache.root)
            console.print(Panel(error, title=Text(f"stage {ps.name} failed"), style="red"))
            return StageResult(ps.name, ps.key, "failed", 0.0, "see the error above", error)
        console.print(Text.assemble((f">> {ps.name}", "bold"), f" ({executor.describe(launch)})"))
        outcome = executor.run(launch)

    ok = outcome.ok and cache.is_complete(ps.name, ps.key)
    if outcome.ok and not ok:
        outcome.error = "the stage ended without publishing its output (see its log)"
    if outcome.interrupted:
        if tracking:
            tracking.end_run(run_id, "KILLED", {"duration_s": outcome.seconds}, {"orchestrator.status": "interrupted"})
        hint = ps.stage.progress(cache.scratch(ps.name, ps.key)) if ps.stage.progress else None
        return StageResult(ps.name, ps.key, "interrupted", outcome.seconds,
                           f"run the same command to continue{f' (it {hint})' if hint else ''}", outcome.error)
    if tracking:
        tracking.end_run(run_id, "FINISHED" if ok else "FAILED",
                         {"duration_s": outcome.seconds, **({"planned_s": planned.seconds} if planned else {})},
                         {"orchestrator.status": "ran" if ok else "failed"})
    if not ok:
        console.print(Panel(outcome.error or "unknown error", title=Text(f"stage {ps.name} failed"), style="red"))
        return StageResult(ps.name, ps.key, "failed", outcome.seconds, f"logs: {launch.log_dir}", outcome.error)
    stage_time.record(timing, cfg.train, ps.name, outcome.seconds, cache.entry(ps.name, ps.key), cache.root)
    return StageResult(ps.name, ps.key, "ran", outcome.seconds, _summary(ps, cache), waited_s=outcome.waited_s)


def _cached(ps: PlannedStage, cache: Cache, tracking: Optional[Invocation]) -> StageResult:
    if tracking:
        tracking.record_cached(ps.name, ps.key, cache.record(ps.name, ps.key).get("mlflow_run_id", ""))
    return StageResult(ps.name, ps.key, "cached", summary=_summary(ps, cache))


@contextlib.contextmanager
def _stage_lock(cache: Cache, ps: PlannedStage):
    """One writer per stage key. When another invocation holds it, say who and since when while waiting."""
    lock, holder_path = cache.lock(ps.name, ps.key), cache.holder(ps.name, ps.key)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        deadline = time.monotonic() + 2.0  # the holder writes its name right after taking the lock
        while not (holder := _read_record(holder_path)) and time.monotonic() < deadline:
            time.sleep(0.05)
        who = f"pid {holder['pid']} on {holder['host']}, since " \
              f"{time.strftime('%H:%M:%S', time.localtime(holder['since']))}" if holder else \
            f"its holder is not recorded in {holder_path}"
        console.print(f"waiting for another run of {ps.name} ({who}) to finish: its result will be used",
                      soft_wrap=True)
        lock.acquire()
    try:
        atomic_write_json(holder_path, _this_process())
        yield
    finally:
        holder_path.unlink(missing_ok=True)
        lock.release()


def _this_process() -> dict:
    """Who is at work, for whoever finds the record: a waiter, or a later run closing a stale attempt."""
    return {"pid": os.getpid(), "host": os.uname().nodename, "since": time.time()}


def _read_record(path: Path) -> dict:
    try:
        return read_json(path)
    except (OSError, ValueError):
        return {}


def _close_stale_attempt(attempt_path: Path, tracking: Optional[Invocation]) -> None:
    """An earlier attempt whose orchestrator died leaves its MLflow runs RUNNING: mark them KILLED."""
    if not attempt_path.is_file() or tracking is None:
        return
    attempt = _read_record(attempt_path)
    if attempt.get("host") == os.uname().nodename and process_alive(attempt.get("pid", -1)):
        return
    tracking.close_stale(attempt.get("runs", []), f"superseded by run {tracking.parent}")


def _summary(ps: PlannedStage, cache: Cache) -> str:
    if ps.stage.summary is None:
        return ""
    try:
        return ps.stage.summary(cache.entry(ps.name, ps.key))
    except Exception as e:  # a summary is a nicety: never fail a run over it
        return f"(no summary: {e})"
