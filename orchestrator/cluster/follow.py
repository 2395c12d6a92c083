"""Follow submitted SLURM jobs until they end (`python -m orchestrator.follow <run dir> [<run dir> ...]`).

A live table shows every stage's job; a failed job's dependants are cancelled and its remote traceback is
shown; a requeued train job held by SLURM is released at once. At the end the MLflow runs are closed and the
stage outcomes printed, as for a local run. The submitting command does this itself unless `cluster.wait=false`;
this module serves both, and sweeps follow all their points' run folders together.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from orchestrator.cache.store import Cache, link_output
from orchestrator.report import Report, StageResult, console, result_table, styled
from orchestrator.cluster.slurm_queue import (ACTIVE_STATES, JOBS_FILE, SubmittedStage, cancel, job_states, lost_nodes,
                                              release)
from storage.fsio import read_json

FAILED_STATES = {"FAILED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
TRACEBACK_LINES = 40
LOST_AFTER_S = 300.0


@dataclass
class Followed:
    """One run folder's submitted stages."""
    run_dir: Path
    stages: list[SubmittedStage]
    cached: list[str]
    keys: dict[str, str]
    order: list[str]
    cache: Cache
    tracking: Optional[dict]
    poll_s: float

    @staticmethod
    def load(run_dir: Path) -> "Followed":
        d = read_json(Path(run_dir) / JOBS_FILE)
        return Followed(Path(run_dir), [SubmittedStage(**s) for s in d["stages"]], d["cached"], d["keys"], d["order"],
                        Cache(Path(d["cache_root"])), d["tracking"], d["poll_s"])


def remote_error(s: SubmittedStage) -> str:
    """The failed job's traceback as the job wrote it (submitit's result file, else its log's last lines)."""
    import submitit

    job = submitit.SlurmJob(folder=Path(s.folder).parent / "%j", job_id=s.job_id, tasks=tuple(range(s.tasks)))
    for task in range(s.tasks):
        t = job.task(task)
        try:
            error = t.exception()
        except Exception:  # no result file: the task was killed (time limit, memory, node failure)
            error = None
        if error is not None:
            text = str(error)
            return f"rank {task}:\n" + "\n".join(text.splitlines()[-TRACEBACK_LINES:])
    for task in range(s.tasks):
        out = job.task(task).paths.stdout
        if out.exists() and out.stat().st_size:
            lines = out.read_text(errors="replace").splitlines()
            return f"rank {task}, last lines of {out}:\n" + "\n".join(lines[-TRACEBACK_LINES:])
    return "the job left neither a result nor a log (see sacct -j " + s.job_id + ")"


def _status_table(followed: list[Followed], states: dict) -> Table:
    table = Table(title="SLURM jobs", title_justify="left")
    for col in ("run", "stage", "job", "tasks", "state", "time", "note"):
        table.add_column(col)
    for f in followed:
        for name in f.cached:
            table.add_row(f.run_dir.name, name, "-", "-", styled("cached", "green"), "-", "")
        for s in f.stages:
            state, reason, used = states.get(s.job_id, ("UNKNOWN", "", ""))
            style = "green" if state == "COMPLETED" else "red" if state in FAILED_STATES else \
                "yellow" if state == "CANCELLED" else "cyan"
            note = reason if reason not in ("None", "") else ""
            table.add_row(f.run_dir.name, s.stage, s.job_id + (" (shared)" if s.shared else ""), str(s.tasks),
                          styled(state, style), used, note)
    return table


def follow(run_dirs: list[Path], interactive: Optional[bool] = None) -> list[Report]:
    """Wait for every job of these run folders; one Report per folder."""
    followed = [Followed.load(Path(d)) for d in run_dirs]
    jobs = sorted({s.job_id for f in followed for s in f.stages}, key=int)
    poll_s = min((f.poll_s for f in followed), default=2.0)
    interactive = console.is_terminal if interactive is None else interactive
    errors: dict[str, str] = {}           # job id -> remote traceback
    last_seen: dict[str, str] = {}
    unknown_since: dict[str, float] = {}
    live = Live(console=console, refresh_per_second=2, transient=False) if interactive else None
    if live:
        live.start()
    try:
        while True:
            states = job_states(jobs)
            for job_id, (state, reason, _) in states.items():
                if state == "PENDING" and reason == "BeginTime":  # a requeued job, held for ~2 min
                    release(job_id)
                if state == "PENDING" and "DOWN" in reason.upper() and job_id not in errors:
                    # requeued after a node failure, it would wait for the lost node: say so and stop it
                    lost = lost_nodes(job_id)
                    if lost:
                        cancel([job_id])
                        errors[job_id] = _failed(followed, job_id, "NODE_FAIL", lost, requeued=True)
                if state in FAILED_STATES and job_id not in errors:
                    errors[job_id] = _failed(followed, job_id, state,
                                             lost_nodes(job_id) if state == "NODE_FAIL" else None)
                if not live and last_seen.get(job_id) != state:
                    last_seen[job_id] = state
                    names = ", ".join(f"{f.run_dir.name}/{s.stage}" for f in followed for s in f.stages
                                      if s.job_id == job_id)
                    console.print(f"job {job_id} ({names}): {state}", soft_wrap=True)
            if live:
                live.update(_status_table(followed, states))
            for j in jobs:  # neither squeue nor sacct knows it: a moment after sbatch, or lost with the controller
                if j in states:
                    unknown_since.pop(j, None)
                elif time.monotonic() - unknown_since.setdefault(j, time.monotonic()) > LOST_AFTER_S:
                    states[j] = ("LOST", "unknown to squeue and sacct", "")
                    errors.setdefault(j, f"SLURM no longer knows job {j} (squeue and sacct); run the command again")
            if all(states.get(j, ("UNKNOWN",))[0] not in ACTIVE_STATES | {"UNKNOWN"} for j in jobs):
                break
            time.sleep(poll_s)
    finally:
        if live:
            live.stop()
    for job_id, error in errors.items():
        names = ", ".join(f"{s.stage} ({f.run_dir.name})" for f in followed for s in f.stages if s.job_id == job_id)
        console.print(Panel(error, title=Text(f"job {job_id}: {names} failed"), style="red"))
    return [_finish(f, states, errors) for f in followed]


def _failed(followed: list[Followed], job_id: str, state: str, lost: Optional[tuple[list[str], list[str]]] = None,
            requeued: bool = False) -> str:
    """A job failed: cancel what waits for it (in every followed run) and fetch its traceback (for a lost node:
    which node, which ranks, and how to go on)."""
    dependants: set[str] = set()
    frontier = {job_id}
    while frontier:
        nxt = {s.job_id for f in followed for s in f.stages if set(s.after) & frontier} - dependants
        dependants |= nxt
        frontier = nxt
    cancel(sorted(dependants))
    f, stage = next((f, s) for f in followed for s in f.stages if s.job_id == job_id)
    if lost:
        return f"{state}: " + node_loss(f, stage, *lost, requeued)
    return f"{state}: " + remote_error(stage)


def node_loss(f: Followed, s: SubmittedStage, down: list[str], nodes: list[str], requeued: bool) -> str:
    """Which node a job lost, its ranks (SLURM places a job's tasks node by node), and the command that goes on."""
    from stages import get_stage

    per_node = max(s.tasks // len(nodes), 1)
    lost = [f"{n} (ranks {i * per_node}-{(i + 1) * per_node - 1})" for i, n in enumerate(nodes) if n in down]
    up = len(nodes) - len(down)
    progress = get_stage(s.stage).progress
    hint = progress(f.cache.scratch(s.stage, s.key)) if progress else None
    return (f"the job lost node {', '.join(lost) or 'a node (up again now)'} of its {len(nodes)} "
            f"({', '.join(nodes)}). " +
            (f"SLURM requeued it, but it could start again only once {len(nodes)} nodes are up: it was cancelled. "
             if requeued else "") +
            f"Nothing is lost: the same command with cluster.nodes={max(up, 1)} (or a layout that fits the nodes that "
            f"are up) continues{f' ({hint})' if hint else ' from the last complete checkpoint'}.")


def _finish(f: Followed, states: dict, errors: dict[str, str]) -> Report:
    """Stage outcomes of one run folder; its MLflow runs closed."""
    client = None
    if f.tracking:
        from orchestrator.tracking.tracker import _client

        client = _client(f.tracking["uri"])
    report = Report(f.run_dir, parent_run_id=f.tracking["parent"] if f.tracking else None)
    for name in f.cached:
        report.results[name] = StageResult(name, f.keys[name], "cached", summary=_summary(f, name))
    failed_jobs = set(errors)
    for s in f.stages:
        state, _, used = states.get(s.job_id, ("UNKNOWN", "", ""))
        if f.cache.is_complete(s.stage, s.key):
            result = StageResult(s.stage, s.key, "ran", _seconds(used), f"job {s.job_id}" +
                                 (" (shared)" if s.shared else "") + (f": {_summary(f, s.stage)}" if
                                                                      _summary(f, s.stage) else ""))
            status = "FINISHED"
        elif s.job_id in failed_jobs or state == "COMPLETED":
            why = errors.get(s.job_id, "the job ended without publishing its output")
            result = StageResult(s.stage, s.key, "failed", _seconds(used), f"job {s.job_id}: see its log in {s.folder}",
                                 why)
            status = "FAILED"
        else:
            blocked = [u.stage for u in f.stages if u.job_id in s.after and u.job_id in failed_jobs]
            result = StageResult(s.stage, s.key, "not run", summary=f"cancelled: needs {', '.join(blocked)}"
                                 if blocked else f"job {s.job_id} {state.lower()}")
            status = "KILLED"
        report.results[s.stage] = result
        if client and s.run_id:
            _close(client, s.run_id, status, result.status)
    if client:
        failed = report.exit_code != 0
        _close(client, f.tracking["parent"], "FAILED" if failed else "FINISHED", "failed" if failed else "ok")
    report.results = dict(sorted(report.results.items(), key=lambda kv: f.order.index(kv[0])))
    for name, r in report.results.items():
        if r.status in ("ran", "cached"):
            link_output(f.run_dir, name, f.cache.entry(name, r.key))
    _record_times(f, report)
    return report


def _record_times(f: Followed, report: Report) -> None:
    """Each job that ran, its time (sacct's) for the next plan on these nodes (planning/stage_time.py). An estimate's
    input: never worth failing the follow over."""
    from omegaconf import OmegaConf

    from planning import stage_time
    from planning.plan import plan_of

    ran = [r for r in report.results.values() if r.status == "ran" and r.seconds > 0]
    try:
        cfg = OmegaConf.load(f.run_dir / "config.yaml") if ran else None
        timing = stage_time.timing_of(cfg, plan_of(cfg)) if ran else None
        for r in ran:
            stage_time.record(timing, cfg.train, r.name, r.seconds, f.cache.entry(r.name, r.key), f.cache.root)
    except Exception as e:  # noqa: BLE001 (a config or record that cannot be read: the next plan has no figure)
        console.print(f"(the jobs' times are not recorded for the next plan: {type(e).__name__}: {e})", soft_wrap=True)


def _summary(f: Followed, stage: str) -> str:
    from stages import get_stage

    summarize = get_stage(stage).summary
    try:
        return summarize(f.cache.entry(stage, f.keys[stage])) if summarize else ""
    except Exception as e:  # a summary is a nicety: never fail over it
        return f"(no summary: {e})"


def _close(client, run_id: str, status: str, outcome: str) -> None:
    """End a run the job did not end itself (cancelled, killed, shared); keep the status a job set."""
    run = client.get_run(run_id)
    client.set_tag(run_id, "orchestrator.status", outcome)
    if run.info.status == "RUNNING":
        client.set_terminated(run_id, status)


def _seconds(used: str) -> float:
    """SLURM's "[D-]HH:MM:SS" / "MM:SS" as seconds (0 when unknown)."""
    try:
        days, _, clock = used.rpartition("-")
        total = 0
        for part in clock.split(":"):
            total = total * 60 + int(part)
        return total + int(days or 0) * 86400
    except ValueError:
        return 0.0


def main(argv: list[str]) -> int:
    if not argv or any(a.startswith("-") for a in argv):
        print("usage: python -m orchestrator.follow <run dir> [<run dir> ...]", file=sys.stderr)
        return 2
    unfollowable = [a for a in argv if not (Path(a) / JOBS_FILE).is_file()]
    if unfollowable:
        print(f"nothing to follow in {', '.join(unfollowable)}: no {JOBS_FILE} there. Only a run submitted with "
              "cluster=slurm has jobs to follow (a local run's outcome is in its stage table and its stages/ folder); "
              "give the run folder printed after 'outputs:'", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    reports = follow([Path(a) for a in argv])
    for r in reports:
        console.print(result_table(list(r.results.values()), time.perf_counter() - t0))
        console.print(f"outputs: {r.run_dir}", soft_wrap=True)
    return max((r.exit_code for r in reports), default=0)
