"""The conductor: validate, plan, then run every stage that is not cached, in order, and report.

A failed stage marks its dependants "not run" and the command exits non-zero; the same command again
finds the finished stages in the cache and starts at the first one that is not (a train stage resumes
from its latest complete checkpoint).
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, OmegaConf
from rich.panel import Panel

from orchestrator.cache import Cache, link_output
from orchestrator.dag import PlannedStage, plan as make_plan
from orchestrator.executors import Launch, make_executor, write_spec
from orchestrator.report import Report, StageResult, console, plan_table, plan_text, result_table
from orchestrator.tracking import Invocation, process_alive
from orchestrator.validate import validate
from plugins.fsio import atomic_write_json, read_json
from stages import all_stages

ATTEMPT_FILE = "attempt.json"


def orchestrate(cfg: DictConfig, run_dir: Path, overrides: list[str], sweep_run_id: Optional[str] = None,
                follow_jobs: bool = True) -> Report:
    """Run the experiment described by cfg (a dry run only plans it).

    sweep_run_id: the MLflow run of the sweep this is a point of (its parent). follow_jobs=False (SLURM):
    return once the jobs are submitted (a sweep follows all its points' jobs together)."""
    t0 = time.perf_counter()
    validate(cfg, overrides)
    cache = Cache(Path(cfg.cache_dir).resolve())
    plan = make_plan(cfg, all_stages(), cache)

    run_dir = run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.yaml"
    config_path.write_text(OmegaConf.to_yaml(cfg, resolve=True))
    executor = make_executor(cfg.cluster)
    launches = {ps.name: _launch(cfg, ps, cache, run_dir, config_path) for ps in plan}
    to_run = [ps.name for ps in plan if not ps.cached]
    where = {name: executor.describe(launches[name]) for name in to_run}
    commands = {name: executor.command(launches[name]) for name in to_run}
    _write_plan(run_dir, plan, where, commands)
    console.print(plan_table(plan, where))
    if cfg.dry_run:
        for name, command in commands.items():
            console.print(f"{name}: {command}", soft_wrap=True)
        console.print(f"dry run: nothing was started (plan written to {run_dir / 'plan.json'})", soft_wrap=True)
        return Report(run_dir)
    if not to_run:
        console.print("every stage is cached: nothing to run")

    tags = {"orchestrator.run_dir": str(run_dir), **({"mlflow.parentRunId": sweep_run_id} if sweep_run_id else {})}
    tracking = Invocation(cfg, " ".join(overrides) or "default", tags) if cfg.tracking.name == "mlflow" else None
    if tracking:
        tracking.log_artifact(tracking.parent, config_path)
        tracking.log_artifact(tracking.parent, run_dir / "plan.json")
        tracking.log_artifact(tracking.parent, run_dir / "plan.txt")
    if cfg.cluster.name == "slurm":
        return _submit(cfg, plan, launches, cache, run_dir, tracking, follow_jobs and cfg.cluster.wait, t0)

    report = Report(run_dir, parent_run_id=tracking.parent if tracking else None)
    results = report.results
    try:
        for ps in plan:
            blocked = [u for u in ps.stage.after if results[u].status in ("failed", "not run")]
            if blocked:
                results[ps.name] = StageResult(ps.name, ps.key, "not run", summary=f"needs {', '.join(blocked)}")
                if tracking:
                    run_id = tracking.start_stage(ps.name, ps.key, {}, {"orchestrator.status": "not run"})
                    tracking.end_run(run_id, "KILLED")
                continue
            results[ps.name] = _run_stage(cfg, ps, cache, launches[ps.name], executor, tracking)
            link_output(run_dir, ps.name, cache.entry(ps.name, ps.key))
    except KeyboardInterrupt:
        if tracking:
            tracking.end_run(tracking.parent, "KILLED")
        raise

    failed = report.exit_code != 0
    total = time.perf_counter() - t0
    console.print(result_table(list(results.values()), total))
    console.print(f"outputs: {run_dir}", soft_wrap=True)
    if tracking:
        tracking.end_run(tracking.parent, "FAILED" if failed else "FINISHED", {"wall_s": total},
                         {"orchestrator.status": "failed" if failed else "ok"})
        console.print(f"MLflow: mlflow ui --backend-store-uri {cfg.tracking.uri}  (run {tracking.parent})",
                      soft_wrap=True)
    return report


def _submit(cfg: DictConfig, plan: list[PlannedStage], launches: dict[str, Launch], cache: Cache, run_dir: Path,
            tracking: Optional[Invocation], wait: bool, t0: float) -> Report:
    """cluster=slurm: every stage to run becomes a job, submitted now; then follow them (or return)."""
    from orchestrator.follow import follow
    from orchestrator.slurm import submit_plan

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
    console.print(f"outputs: {run_dir}", soft_wrap=True)
    return report


def _launch(cfg: DictConfig, ps: PlannedStage, cache: Cache, run_dir: Path, config_path: Path) -> Launch:
    log_dir = run_dir / "stages" / ps.name
    spec = {
        "stage": ps.name, "key": ps.key, "config": str(config_path),
        "inputs": {up: str(cache.entry(up, ps.material["inputs"][up])) for up in ps.stage.after},
        "out": str(cache.out(ps.name, ps.key)), "scratch": str(cache.scratch(ps.name, ps.key)),
        "cache_root": str(cache.root), "log_dir": str(log_dir),
        "entry_meta": {"material": ps.material, "run_dir": str(run_dir)},
        "threads": cfg.cluster.threads_per_rank, "pg_timeout_s": cfg.cluster.pg_timeout_s,
        "interactive": sys.stdout.isatty(), "tracking": None,
    }
    return Launch(ps, spec, log_dir / "spec.json", log_dir)


def _run_stage(cfg: DictConfig, ps: PlannedStage, cache: Cache, launch: Launch, executor,
               tracking: Optional[Invocation]) -> StageResult:
    with cache.lock(ps.name, ps.key):
        if cache.is_complete(ps.name, ps.key):  # cached before, or finished by a concurrent invocation
            if tracking:
                tracking.record_cached(ps.name, ps.key, cache.record(ps.name, ps.key).get("mlflow_run_id", ""))
            return StageResult(ps.name, ps.key, "cached", summary=_summary(ps, cache))

        attempt_path = cache.work(ps.name, ps.key) / ATTEMPT_FILE
        _close_stale_attempt(attempt_path, tracking)
        cache.begin(ps.name, ps.key)
        run_id = launch.open_run(tracking, cfg, "running")
        atomic_write_json(attempt_path, {"pid": os.getpid(), "host": os.uname().nodename,
                                         "runs": [r for r in (run_id, tracking and tracking.parent) if r]})
        write_spec(launch.spec_path, launch.spec)
        console.print(f"[bold]>> {ps.name}[/] ({executor.describe(launch)})")
        outcome = executor.run(launch)

    ok = outcome.ok and cache.is_complete(ps.name, ps.key)
    if outcome.ok and not ok:
        outcome.error = "the stage ended without publishing its output (see its log)"
    if tracking:
        tracking.end_run(run_id, "FINISHED" if ok else "FAILED", {"duration_s": outcome.seconds},
                         {"orchestrator.status": "ran" if ok else "failed"})
    if not ok:
        console.print(Panel(outcome.error or "unknown error", title=f"stage {ps.name} failed", style="red"))
        return StageResult(ps.name, ps.key, "failed", outcome.seconds, f"logs: {launch.log_dir}", outcome.error)
    return StageResult(ps.name, ps.key, "ran", outcome.seconds, _summary(ps, cache))


def _close_stale_attempt(attempt_path: Path, tracking: Optional[Invocation]) -> None:
    """An earlier attempt whose orchestrator died leaves its MLflow runs RUNNING: mark them KILLED."""
    if not attempt_path.is_file() or tracking is None:
        return
    attempt = read_json(attempt_path)
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


def _write_plan(run_dir: Path, plan: list[PlannedStage], where: dict[str, str], commands: dict[str, str]) -> None:
    atomic_write_json(run_dir / "plan.json", [
        {"stage": ps.name, "key": ps.key, "cached": ps.cached, "note": ps.note, "after": list(ps.stage.after),
         "resources": vars(ps.resources), "where": where.get(ps.name, "cached"),
         "command": commands.get(ps.name), "material": ps.material}
        for ps in plan])
    (run_dir / "plan.txt").write_text(plan_text(plan, where))
