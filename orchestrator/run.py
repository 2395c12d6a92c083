"""The conductor: validate, plan, then run every stage that is not cached, in order, and report.

A failed stage marks its dependants "not run" and the command exits non-zero; the same command again
finds the finished stages in the cache and starts at the first one that is not (a train stage resumes
from its latest complete checkpoint).
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from filelock import Timeout
from omegaconf import DictConfig, OmegaConf
from rich.panel import Panel
from rich.text import Text

from orchestrator.cache.store import Cache, link_output
from orchestrator.dag import PlannedStage, plan as make_plan
from orchestrator.cluster import fork_server
from orchestrator.cluster.launch import Launch, write_spec
from orchestrator.cluster.local import DebugExecutor, LocalExecutor
from orchestrator.report import Report, StageResult, console, plan_table, plan_text, result_table
from orchestrator import calibration, interrupt
from orchestrator.cache import resume
from orchestrator.tracking import later as tracking_later
from orchestrator.tracking.tracker import OVERRIDES_TAG_CHARS, Invocation, absolute_uri, process_alive
from orchestrator.tracking.tracker import run_name as short_run_name
from orchestrator.config.resolve import resolve_auto
from orchestrator.config.validate import refusing, validate, warnings
from planning import stage_time
from planning.plan import (STARTUP_SAID_S, actual_line, compute_line, expected_times, memory_line, partition_plan,
                           peft_line, planned_lines, time_line)
from planning.stage_time import Expected
from plugins.data.corpus import TOKENS_DIR, passes_line, plan_lines
from plugins.data.preview import PLAN_CHARS, preview
from runtime.threads import usable_cores
from storage.fsio import atomic_write_json, disk_space, read_json
from stages import all_stages

ATTEMPT_FILE = "attempt.json"
# A sweep's points side by side (sweep.parallelism) are threads of one process: each validates and plans, then runs.
# Planning reads and sets process-wide state (torch's thread count while the matmul rate is measured, the modules a
# check imports on first use, the cache's folders it creates), so the points plan one at a time, and each point's
# plan prints as one block; a calibration (a plan's first timed steps) runs within its point's planning, so a point
# beside it finds the layout timed instead of timing it again. Only the stages themselves run side by side.
_PLANNING = threading.RLock()


def data_preview(cfg) -> list:
    """The first record of each source as the model sees it (data.preview=N: N of them); a record that cannot be
    shown is the tokenize stage's to name (the checks before launch read the same records)."""
    text = cfg.data.format == "text"
    try:
        return preview(cfg, cfg.data.preview or 1, console.is_terminal,
                       chars=PLAN_CHARS if cfg.data.preview or not text else PLAN_CHARS // 4)
    except Exception as e:  # noqa: BLE001 (the plan goes on without it)
        return [f"data: no preview of the first record ({type(e).__name__}: {e})"]


def orchestrate(cfg: DictConfig, run_dir: Path, overrides: list[str], sweep_run_id: Optional[str] = None,
                follow_jobs: bool = True, until: Optional[str] = None, kind: str = "invocation",
                heading: Optional[str] = None) -> Report:
    """Run the experiment described by cfg (a dry run only plans it).

    sweep_run_id: the MLflow run of the sweep (or tune) this is a point of (its parent). follow_jobs=False (SLURM):
    return once the jobs are submitted (a sweep follows all its points' jobs together). until: run that stage and
    the stages it needs only (a layout trial stops after train). kind: the MLflow parent run's orchestrator.kind.
    heading: a rule printed above the plan (a sweep's point: its plan stays under it with points side by side)."""
    t0 = time.perf_counter()
    with _PLANNING:  # one point of a sweep at a time (see _PLANNING)
        if interrupt.requested():  # a signal came while this point waited for another's plan: it does not start
            raise KeyboardInterrupt
        if heading:
            console.rule(Text(heading))
        fresh = not Path(cfg.cache_dir).exists()  # before validation and planning, which may make the folder
        choices = resolve_auto(cfg)  # first: validation and its plan see the values that will run (one plan, not two)
        validate(cfg, overrides)
        startup = (cfg.cluster.name == "local" and cfg.cluster.start_method == "forkserver"
                   and not fork_server.running())
        executor = _executor(cfg.cluster)
        if not cfg.dry_run and not cfg.data.preview:  # e.g. the local fork server imports torch and the stages'
            # libraries (7 s of CPU on the 2-core VM) while the stages are planned, the plan printed, MLflow's runs
            # opened; a run whose stages are all cached ends soon after (the server with it)
            executor.prepare(tracking=cfg.tracking.name == "mlflow", pipeline=cfg.parallel.pp > 1)
        cache = Cache(Path(cfg.cache_dir).resolve())
        with refusing("overrides", " ".join(overrides), "planning the stages (orchestrator/dag.py)"):
            plan = make_plan(cfg, all_stages(until), cache)  # it reads the inputs again: they may have changed since
        _check_cache_writable(cfg, plan, cache)
        to_run = [ps.name for ps in plan if not ps.cached]
        if calibration.wanted(cfg, to_run, cache.root, until):
            timed = _calibrate(cfg, run_dir, overrides, cache, sweep_run_id)
            if timed.exit_code:
                return timed
            fresh, plan = False, make_plan(cfg, all_stages(until), cache)  # the stages before train are cached now
            to_run = [ps.name for ps in plan if not ps.cached]
        tokenize = next((ps for ps in plan if ps.name == "tokenize"), None)
        estimating = "the plan's estimates (planning/plan.py, plugins/data/corpus.py)"
        with refusing("overrides", " ".join(overrides), estimating):
            data = plan_lines(cfg, tokenize.resources.tasks, usable_cores()) if tokenize else []
            if tokenize and tokenize.cached and "train" in to_run:  # its counts are known: what the steps draw
                data += passes_line(cfg, cache.entry("tokenize", tokenize.key) / TOKENS_DIR)
            planned = expected_times(cfg, to_run, cache.root, startup)
            estimates = [*peft_line(cfg), memory_line(cfg, orchestrator_bytes(cfg)), compute_line(cfg),
                         time_line(cfg, saving=bool({"train", "aggregate"} & set(to_run))),
                         *planned_lines(planned, stage_time.where(cfg))]

        run_dir = run_dir.resolve()
        run_dir.mkdir(parents=True, exist_ok=True)
        config_path = run_dir / "config.yaml"
        config_path.write_text(OmegaConf.to_yaml(cfg, resolve=True))
        launches = {ps.name: _launch(cfg, ps, cache, run_dir, config_path) for ps in plan}
        where = {name: executor.describe(launches[name]) for name in to_run}
        commands = {name: executor.command(launches[name]) for name in to_run}
        _write_plan(run_dir, plan, where, commands)
        console.print(plan_table(plan, where))
        said = [*choices, *estimates, *data, *(data_preview(cfg) if tokenize else []), *warnings(cfg)]
        for line in [*_new_store(cfg, fresh), *(said if kind != "calibration" else [])]:  # the run's plan says them
            console.print(line, soft_wrap=True)
        if cfg.data.preview:
            console.print(f"data.preview={cfg.data.preview}: nothing was started", soft_wrap=True)
            return Report(run_dir)
        for ps in plan:
            if ps.damage:
                console.print(f"warning: the cached {ps.name} output {cache.entry(ps.name, ps.key)} is damaged "
                              f"({'; '.join(ps.damage)}): the stage runs again", soft_wrap=True)
        if cfg.dry_run:
            for name, command in commands.items():
                write_spec(launches[name].spec_path, launches[name].spec)  # the printed commands work when pasted
                after = [u for u in launches[name].planned.stage.after if u in commands]
                chain = f" (submitted with --dependency=afterok on the jobs of {', '.join(after)})" \
                    if cfg.cluster.name == "slurm" and after else ""
                console.print(f"{name}{chain}: {command}", soft_wrap=True)
            console.print(f"dry run: nothing was started (plan written to {run_dir / 'plan.json'})", soft_wrap=True)
            return Report(run_dir)
        if not to_run:
            console.print("every stage is cached: nothing to run")

    tags = {"orchestrator.kind": kind, "orchestrator.run_dir": str(run_dir),
            "orchestrator.overrides": " ".join(overrides)[:OVERRIDES_TAG_CHARS],
            **({"mlflow.parentRunId": sweep_run_id} if sweep_run_id else {})}
    run_name = short_run_name(overrides)
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
            results[ps.name] = _run_stage(cfg, ps, cache, launches[ps.name], executor, tracking,
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
        stage_time.record(cfg, stage_time.STARTUP, waited, run_dir, cache.root, 0)
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


def _new_store(cfg: DictConfig, fresh: bool) -> list[str]:
    """Said when there is no cache yet where this run keeps it: runs_dir is relative to the folder the command runs
    in, so a command started from another folder would otherwise make a new cache (and store) there silently."""
    if not fresh:
        return []
    store = f" and a new MLflow store, {absolute_uri(cfg.tracking.uri)}," if cfg.tracking.name == "mlflow" else ""
    where = "" if Path(cfg.runs_dir).is_absolute() else (f" (runs_dir={cfg.runs_dir} is relative to the folder the "
                                                          "command runs in; earlier runs are reused from theirs)")
    return [f"a new cache{store} in {Path(cfg.cache_dir).resolve()}: none there yet{where}"]


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


def _check_cache_writable(cfg: DictConfig, plan: list[PlannedStage], cache: Cache) -> None:
    """A read-only cache serves a run whose stages it holds; one with a stage to run is refused before anything
    is written (validation checked only that an existing cache_dir is a folder)."""
    from orchestrator.config.errors import ConfigError, Problem
    from storage.fsio import why_unwritable

    must_run = [ps.name for ps in plan if not ps.cached]
    why = why_unwritable(cache.root) if must_run and not (cfg.dry_run or cfg.data.preview) else ""
    if why:
        outputs = "its output" if len(must_run) == 1 else "their outputs"
        raise ConfigError([Problem("cache_dir", cfg.cache_dir, f"{', '.join(must_run)} must run and write {outputs} "
                                   f"under cache_dir, but {why}", "cache_dir= a folder you can write (a read-only "
                                   "cache serves only runs whose every stage it holds)")])


def _executor(cluster: DictConfig):
    """Who runs the stages (for slurm: a view that describes the jobs; slurm_submit submits them)."""
    if cluster.name == "debug":
        return DebugExecutor()
    if cluster.name == "local":
        return LocalExecutor(fork=cluster.start_method == "forkserver")
    from orchestrator.cluster.slurm_submit import SlurmView

    return SlurmView(cluster)


def _launch(cfg: DictConfig, ps: PlannedStage, cache: Cache, run_dir: Path, config_path: Path) -> Launch:
    log_dir = run_dir / "stages" / ps.name
    spec = {
        "stage": ps.name, "key": ps.key, "config": str(config_path),
        "inputs": {up: str(cache.entry(up, ps.material["inputs"][up])) for up in ps.stage.after},
        "out": str(cache.out(ps.name, ps.key)), "scratch": str(cache.scratch(ps.name, ps.key)),
        "cache_root": str(cache.root), "aside": str(cache.damaged(ps.name)), "log_dir": str(log_dir),
        "entry_meta": {"material": ps.material, "run_dir": str(run_dir)},
        "threads": cfg.cluster.threads_per_rank, "pg_timeout_s": cfg.cluster.pg_timeout_s,
        "heartbeat": cfg.cluster.name == "local", "heartbeat_timeout_s": cfg.cluster.heartbeat_timeout_s,
        "interactive": sys.stdout.isatty(), "tracking": None,
    }
    return Launch(ps, spec, log_dir / "spec.json", log_dir)


def _run_stage(cfg: DictConfig, ps: PlannedStage, cache: Cache, launch: Launch, executor,
               tracking: Optional[Invocation], planned: Optional[Expected] = None) -> StageResult:
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
    stage_time.record(cfg, ps.name, outcome.seconds, cache.entry(ps.name, ps.key), cache.root,
                      partition_plan(cfg)["n_parameters"])  # for the next plan's time
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


def _write_plan(run_dir: Path, plan: list[PlannedStage], where: dict[str, str], commands: dict[str, str]) -> None:
    atomic_write_json(run_dir / "plan.json", [
        {"stage": ps.name, "key": ps.key, "cached": ps.cached, "note": ps.note, "damage": ps.damage,
         "after": list(ps.stage.after),
         "resources": vars(ps.resources), "where": where.get(ps.name, "cached"),
         "command": commands.get(ps.name), "material": ps.material}
        for ps in plan])
    (run_dir / "plan.txt").write_text(plan_text(plan, where))


# What importing MLflow's client and store adds to this process (pandas, pyarrow, scipy, SQLAlchemy): 0.164 GB,
# measured with this project's pins (torch and the stages imported first). Not imported to be measured: a run with
# nothing to do never imports it (orchestrator/tracking/later.py), and the import takes seconds.
MLFLOW_BYTES = int(0.17 * 2**30)


def orchestrator_bytes(cfg: DictConfig) -> int:
    """What this process (planning, the executors, MLflow's client) holds once it has imported what a run imports:
    torch and every stage's module (ONNX among them) measured, MLflow's share added when tracking. The stages
    themselves run in processes of their own (except on cluster=debug)."""
    import psutil

    from stages import all_stages

    all_stages()
    mlflow = MLFLOW_BYTES if cfg.tracking.name == "mlflow" and "mlflow" not in sys.modules else 0
    return psutil.Process().memory_info().rss + mlflow
