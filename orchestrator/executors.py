"""Where a stage runs. One interface: `run(launch) -> Outcome`, blocking until the stage ends.

- debug: inside the orchestrator's process (one rank): breakpoints and tracebacks work directly.
- local: `resources.tasks` worker processes on this machine with torchrun's environment (RANK,
  WORLD_SIZE, MASTER_ADDR/PORT, ...). Rank 0's output is streamed to the terminal and its log; any
  rank's failure stops the others and is reported with its exit code or signal and its last log lines.
  Children die with the orchestrator (PR_SET_PDEATHSIG), so a killed run leaves no orphan ranks.
"""
from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from orchestrator.dag import PlannedStage
from orchestrator.tracking import config_params

TAIL_LINES = 25


@dataclass
class Launch:
    planned: PlannedStage
    spec: dict
    spec_path: Path
    log_dir: Path

    def open_run(self, tracking, cfg, status: str, closes_itself: bool = False) -> Optional[str]:
        """Create the stage's MLflow run (None without tracking) and have the stage's rank 0 log into it;
        closes_itself: the stage ends the run (no orchestrator watches it, as on SLURM)."""
        if tracking is None:
            return None
        ps = self.planned
        run_id = tracking.start_stage(ps.name, ps.key, config_params(cfg, ps.stage.reads),
                                      {"orchestrator.status": status})
        self.spec["tracking"] = {"uri": cfg.tracking.uri, "run_id": run_id,
                                 "max_artifact_mb": cfg.tracking.max_artifact_mb, "end_run": closes_itself}
        self.spec["entry_meta"]["mlflow_run_id"] = run_id
        return run_id


@dataclass
class Outcome:
    ok: bool
    seconds: float
    error: Optional[str] = None


class DebugExecutor:
    name = "debug"

    def describe(self, launch: Launch) -> str:
        return "in this process"

    def command(self, launch: Launch) -> str:
        return f"orchestrator.worker.execute({launch.spec_path}) in this process"

    def run(self, launch: Launch) -> Outcome:
        from orchestrator.worker import execute

        t0 = time.perf_counter()
        try:
            execute(launch.spec, rank=0, world=1)
        except Exception:
            return Outcome(False, time.perf_counter() - t0, traceback.format_exc())
        return Outcome(True, time.perf_counter() - t0)


def _die_with_parent() -> None:
    """Runs in the child before exec: deliver SIGKILL to it when the orchestrator dies."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: Path, n: int = TAIL_LINES) -> str:
    if not path.exists():
        return ""
    lines = path.read_text(errors="replace").splitlines()
    return "\n".join(lines[-n:])


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class LocalExecutor:
    name = "local"

    def __init__(self, poll_s: float = 0.1, grace_s: float = 5.0):
        self.poll_s, self.grace_s = poll_s, grace_s

    def argv(self, launch: Launch) -> list[str]:
        return [sys.executable, "-m", "orchestrator.worker", str(launch.spec_path)]

    def command(self, launch: Launch) -> str:
        n = launch.planned.resources.tasks
        env = f"RANK=0..{n - 1} WORLD_SIZE={n} " if n > 1 else ""
        return env + " ".join(self.argv(launch))

    def describe(self, launch: Launch) -> str:
        n = launch.planned.resources.tasks
        return f"local, {n} process{'es' if n > 1 else ''}"

    def run(self, launch: Launch) -> Outcome:
        tasks = launch.planned.resources.tasks
        launch.log_dir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        procs: list[subprocess.Popen] = []
        outputs: list[Path] = []
        pumps: list[threading.Thread] = []
        t0 = time.perf_counter()
        try:
            for rank in range(tasks):
                env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(tasks),
                       "LOCAL_WORLD_SIZE": str(tasks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "PYTHONUNBUFFERED": "1"}
                if sys.stdout.isatty():  # rank 0 prints through a pipe: tell it how wide the terminal is
                    env["COLUMNS"] = str(shutil.get_terminal_size().columns)
                if tasks > 1:
                    env["OMP_NUM_THREADS"] = str(launch.spec.get("threads") or 1)
                out_path = launch.log_dir / f"rank{rank}.out"
                outputs.append(out_path)
                if rank == 0:
                    p = subprocess.Popen(self.argv(launch), env=env, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
                    pump = threading.Thread(target=_pump, args=(p.stdout, out_path), daemon=True)
                    pump.start()
                    pumps.append(pump)
                else:
                    with open(out_path, "wb") as f:
                        p = subprocess.Popen(self.argv(launch), env=env, stdout=f, stderr=subprocess.STDOUT,
                                             preexec_fn=_die_with_parent)
                procs.append(p)
            failure = self._wait(procs, launch.planned.resources.timeout_min * 60, t0)
        except BaseException:
            _kill(procs)
            raise
        for pump in pumps:
            pump.join(timeout=5)
        seconds = time.perf_counter() - t0
        if failure is None:
            return Outcome(True, seconds)
        rank, what = failure
        log = tail(outputs[rank]) or tail(launch.log_dir / f"rank{rank}.log")
        return Outcome(False, seconds, f"rank {rank} of {tasks}: {what}\n--- last lines of {outputs[rank]} ---\n{log}")

    def _wait(self, procs: list[subprocess.Popen], timeout_s: float, t0: float) -> Optional[tuple[int, str]]:
        """None when every rank exits 0; else (rank, what happened) of the first failure."""
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                deadline = time.monotonic() + self.grace_s  # let the others report, then stop them
                while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                    time.sleep(self.poll_s)
                _kill(procs)
                return rank, describe_exit(code)
            if all(c == 0 for c in codes):
                return None
            if time.perf_counter() - t0 > timeout_s:
                _kill(procs)
                return 0, f"timed out after {timeout_s / 60:.0f} min (stage resources timeout_min)"
            time.sleep(self.poll_s)


def _pump(stream, path: Path) -> None:
    """Copy a child's output to our stdout and to its log file as it arrives."""
    out = getattr(sys.stdout, "buffer", None)
    with open(path, "wb") as f:
        for chunk in iter(lambda: stream.read1(65536), b""):
            f.write(chunk)
            f.flush()
            if out is not None:
                out.write(chunk)
                out.flush()
            else:
                sys.stdout.write(chunk.decode(errors="replace"))
                sys.stdout.flush()


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def make_executor(cluster):
    """The executor of a cluster config (for slurm: a view that describes jobs; orchestrator.slurm submits)."""
    if cluster.name == "debug":
        return DebugExecutor()
    if cluster.name == "local":
        return LocalExecutor()
    if cluster.name == "slurm":
        from orchestrator.slurm import SlurmView

        return SlurmView(cluster)
    raise ValueError(f"cluster={cluster.name!r}: known clusters are local, debug, slurm")


def write_spec(path: Path, spec: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(spec, indent=2, sort_keys=True))
