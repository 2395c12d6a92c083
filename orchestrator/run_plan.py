"""The planning half of a run: the config resolved and validated, the stages planned (cached or to run), their
launches made, the plan printed and written; a dry run or a data preview ends here.

orchestrator/run.py runs what this returns. Planning is one step that carries its results (RunPlan), so that the
run asks one object what to run, where its files go and what was expected of it.
"""
from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Union

from omegaconf import DictConfig, OmegaConf
from rich.text import Text

from orchestrator import calibration, epochs, interrupt
from orchestrator.cache.store import Cache
from orchestrator.cluster import fork_server
from orchestrator.cluster.launch import Launch, write_spec
from orchestrator.cluster.local import DebugExecutor, LocalExecutor
from orchestrator.config.resolve import resolve_auto
from orchestrator.config.validate import refusing, validate
from orchestrator.dag import PlannedStage, plan as make_plan
from orchestrator.report import Report, console, plan_table, plan_text
from orchestrator.tracking.tracker import absolute_uri
from planning import stage_time
from planning.plan import compute_line, memory_line, objective_line, peft_line
from planning.plan_time import continued_from, expected_times, planned_lines, time_line
from planning.stage_time import Expected, Timing
from plugins.data.corpus import TOKENS_DIR
from plugins.data.tokenize_cost import plan_lines
from plugins.data.preview import passes_line
from plugins.data.preview import PLAN_CHARS, preview
from runtime.threads import usable_cores
from storage.fsio import atomic_write_json
from stages import all_stages

# A sweep's points side by side (sweep.parallelism) are threads of one process: each validates and plans, then runs.
# Planning reads and sets process-wide state (torch's thread count while the matmul rate is measured, the modules a
# check imports on first use, the cache's folders it creates), so the points plan one at a time, and each point's
# plan prints as one block; a calibration (a plan's first timed steps) runs within its point's planning, so a point
# beside it finds the layout timed instead of timing it again. Only the stages themselves run side by side.
PLANNING = threading.RLock()


@dataclass
class RunPlan:
    """What planning decided, for the run to carry out."""
    cfg: DictConfig
    plan: list[PlannedStage]
    to_run: list[str]
    launches: dict[str, Launch]
    cache: Cache
    executor: object
    run_dir: Path
    config_path: Path
    planned: dict[str, Optional[Expected]]  # each stage's expected time, for the line that compares
    t0: float  # when planning began (the run's total time counts from here)
    timing: Timing  # what the stages' times are recorded by (planning/stage_time.py), worked out once a run


def plan_run(cfg: DictConfig, run_dir: Path, overrides: list[str], until: Optional[str], kind: str,
             heading: Optional[str], calibrate: Callable[[DictConfig, Path, list[str], Cache], Report],
             tokenize_first: Optional[Callable[[DictConfig, Path, list[str]], Report]] = None
             ) -> Union[RunPlan, Report]:
    """Validate and plan the run (see orchestrate for the arguments): its RunPlan, or the Report of a run that ends
    at its plan (a dry run, a data preview, a calibration that failed). calibrate: times the run's first steps for
    its plan (orchestrator/calibration.py), when they were never timed here. tokenize_first: runs the tokenize stage
    alone, where train.epochs needs its counts (orchestrator/epochs.py)."""
    t0 = time.perf_counter()
    with PLANNING:  # one point of a sweep at a time (see PLANNING)
        if interrupt.requested():  # a signal came while this point waited for another's plan: it does not start
            raise KeyboardInterrupt
        if heading:
            console.rule(Text(heading))
        fresh = not Path(cfg.cache_dir).exists()  # before validation and planning, which may make the folder
        choices = resolve_auto(cfg)  # first: validation and its plan see the values that will run (one plan, not two)
        checked = validate(cfg, overrides)  # the point's plan and what the checks read, made once: the printout and
        # the run read these, not the config again
        startup = (cfg.cluster.name == "local" and cfg.cluster.start_method == "forkserver"
                   and not fork_server.running())
        executor = _executor(cfg.cluster)
        if not cfg.dry_run and not cfg.data.preview:  # e.g. the local fork server imports what the ranks use
            # (torch._dynamo, ONNX Runtime, matplotlib: 3-4 s of CPU on the 2-core VM, 7 s where it cannot be forked
            # from here) while the stages are planned, the plan printed, MLflow's runs opened; a run whose stages are
            # all cached ends soon after (the server with it)
            executor.prepare(tracking=cfg.tracking.name == "mlflow", pipeline=cfg.parallel.pp > 1)
        cache = Cache(Path(cfg.cache_dir).resolve())
        with refusing("overrides", " ".join(overrides), "planning the stages (orchestrator/dag.py)"):
            plan = make_plan(cfg, all_stages(until), cache)  # it reads the inputs again: they may have changed since
        _check_cache_writable(cfg, plan, cache)
        counted: list[str] = []
        if epochs.wanted(cfg) and any(ps.name == "train" for ps in plan):
            counted, stopped = epochs.count(cfg, run_dir, overrides, until, plan, cache, tokenize_first)
            if stopped is not None:
                return stopped
            if not epochs.wanted(cfg):  # counted into train.steps: they are checked against every rule (cadences,
                # warm-up, their saves' disk) and planned (train's key is the steps')
                checked = validate(cfg, overrides)
                plan = make_plan(cfg, all_stages(until), cache)
        figures = checked.plan
        to_run = [ps.name for ps in plan if not ps.cached]
        timing = stage_time.timing_of(cfg, figures)  # what the stages' times are kept and found by
        if calibration.wanted(cfg, to_run, cache.root, until, timing):
            timed = calibrate(cfg, run_dir, overrides, cache)
            if timed.exit_code:
                return timed
            fresh, plan = False, make_plan(cfg, all_stages(until), cache)  # the stages before train are cached now
            to_run = [ps.name for ps in plan if not ps.cached]
        tokenize = next((ps for ps in plan if ps.name == "tokenize"), None)
        estimating = "the plan's estimates (planning/plan.py, plan_time.py, plugins/data/tokenize_cost.py)"
        with refusing("overrides", " ".join(overrides), estimating):  # the lines read the point's plan (figures)
            train = next((ps for ps in plan if ps.name == "train"), None)
            first_step, continuing = continued_from(cfg, train.resumes_at if train else None)
            planned = expected_times(cfg, timing, to_run, cache.root, startup, first_step)
            times = [time_line(cfg, figures, bool({"train", "aggregate"} & set(to_run)), first_step), *continuing,
                     *planned_lines(planned, timing.where)]
            memory, objective = memory_line(figures, orchestrator_bytes(cfg)), objective_line(cfg, figures)
            estimates = [*peft_line(cfg.peft, figures.parameters), *objective, memory, compute_line(cfg), *times]
            data = plan_lines(cfg, checked.data, tokenize.resources.tasks, usable_cores()) if tokenize else []
            if tokenize and tokenize.cached and "train" in to_run:  # its counts are known: what the steps draw
                data += passes_line(cfg, cache.entry("tokenize", tokenize.key) / TOKENS_DIR)

        run_dir = run_dir.resolve()
        run_dir.mkdir(parents=True, exist_ok=True)
        config_path = run_dir / "config.yaml"
        config_path.write_text(OmegaConf.to_yaml(cfg, resolve=True))
        launches = {ps.name: _launch(cfg, ps, cache, run_dir, config_path) for ps in plan}
        where = {name: executor.describe(launches[name]) for name in to_run}
        commands = {name: executor.command(launches[name]) for name in to_run}
        _write_plan(run_dir, plan, where, commands)
        console.print(plan_table(plan, where))
        said = [*choices, *counted, *estimates, *checked.traced, *data, *(data_preview(cfg) if tokenize else []),
                *checked.warnings]
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
    return RunPlan(cfg, plan, to_run, launches, cache, executor, run_dir, config_path, planned, t0, timing)


def data_preview(cfg) -> list:
    """The first record of each source as the model sees it (data.preview=N: N of them); a record that cannot be
    shown is the tokenize stage's to name (the checks before launch read the same records)."""
    from plugins.data.formats.spec import format_of

    text = not format_of(cfg.data).records  # (text's first documents are shown shorter than a record)
    try:
        return preview(cfg, cfg.data.preview or 1, console.is_terminal,
                       chars=PLAN_CHARS if cfg.data.preview or not text else PLAN_CHARS // 4)
    except Exception as e:  # noqa: BLE001 (the plan goes on without it)
        return [f"data: no preview of the first record ({type(e).__name__}: {e})"]


def _new_store(cfg: DictConfig, fresh: bool) -> list[str]:
    """Said when there is no cache yet where this run keeps it: runs_dir is relative to the folder the command runs
    in, so a command started from another folder would otherwise make a new cache (and store) there silently."""
    if not fresh:
        return []
    store = f" and a new MLflow store, {absolute_uri(cfg.tracking.uri)}," if cfg.tracking.name == "mlflow" else ""
    where = "" if Path(cfg.runs_dir).is_absolute() else (f" (runs_dir={cfg.runs_dir} is relative to the folder the "
                                                          "command runs in; earlier runs are reused from theirs)")
    return [f"a new cache{store} in {Path(cfg.cache_dir).resolve()}: none there yet{where}"]


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
