"""Where a stage runs on this machine. One interface: `run(launch) -> Outcome`, blocking until the stage ends.

- debug: inside the orchestrator's process (one rank): breakpoints and tracebacks work directly.
- local: `resources.tasks` worker processes on this machine with torchrun's environment (RANK,
  WORLD_SIZE, MASTER_ADDR/PORT, ...), forked from a server that has imported torch once
  (orchestrator.cluster.fork_server; `cluster.start_method=exec`: a fresh `python -m orchestrator.worker` each).
  Rank 0's output is streamed to the terminal and its log; any rank's failure stops the others and is reported
  with its exit code or signal and its last log lines.
  Children die with the orchestrator (PR_SET_PDEATHSIG, and each rank watches the orchestrator's pid), so a
  killed run leaves no orphan ranks.
  Ctrl-C and SIGTERM: the ranks run in their own session (a terminal's SIGINT, or a SIGTERM to the process group,
  reaches only the orchestrator), which passes the signal on once: the train stage saves a checkpoint at the step
  it is on and exits (130); a second signal kills them at once (orchestrator/interrupt.py).

SLURM jobs are described by orchestrator.cluster.slurm_submit, which submits them.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from pathlib import Path
from typing import Optional

import psutil

from common.problem import InputFault
from orchestrator import interrupt
from runtime import preemption
from orchestrator.cluster import fork_server
from orchestrator.cluster.launch import Launch, Outcome
from orchestrator.cluster.log_text import LogText

TAIL_LINES = 25


class DebugExecutor:
    name = "debug"

    def describe(self, launch: Launch) -> str:
        return "in this process"

    def command(self, launch: Launch) -> str:
        return f"orchestrator.worker.execute({launch.spec_path}) in this process"

    def prepare(self, tracking: bool, pipeline: bool = False) -> None:
        """Nothing to start ahead: the stages run in this process."""

    def run(self, launch: Launch) -> Outcome:
        """The train stage watches Ctrl-C and SIGTERM as a local rank does: a checkpoint at the step it is on, then
        the run stops as a local one does (the stage interrupted, the same command continues). Other stages stop at
        once, through this process's own handlers."""
        from orchestrator.worker import execute

        t0 = time.perf_counter()
        watched = (signal.SIGINT, signal.SIGTERM)
        before = {sig: signal.getsignal(sig) for sig in watched}
        if launch.spec["stage"] == "train":
            preemption.watch(watched)
        try:
            execute(launch.spec, rank=0, world=1)
        except preemption.Preempted as e:
            interrupt.note(signal.Signals[e.reason] if e.reason in signal.Signals.__members__ else signal.SIGINT)
            return Outcome(False, time.perf_counter() - t0, f"interrupted ({interrupt.said()})", interrupted=True)
        except InputFault as e:  # the user's input, said in full (as a rank says it)
            return Outcome(False, time.perf_counter() - t0, str(e))
        except Exception:
            return Outcome(False, time.perf_counter() - t0, traceback.format_exc())
        finally:
            for sig, handler in before.items():
                signal.signal(sig, handler)
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


def _root_cause(first_seen: tuple[int, int], codes: list[Optional[int]]) -> tuple[int, int]:
    """The (rank, exit code) to report: a rank killed by a signal (OOM killer, kill -9, a crash), since its peers
    then fail in their next collective ("Connection reset by peer") and may be seen first; else first_seen."""
    return next(((rank, code) for rank, code in enumerate(codes) if code is not None and code < 0), first_seen)


class LocalExecutor:
    name = "local"

    def __init__(self, poll_s: float = 0.1, grace_s: float = 5.0, fork: bool = True):
        self.poll_s, self.grace_s, self.fork = poll_s, grace_s, fork

    def argv(self, launch: Launch) -> list[str]:
        return [sys.executable, "-m", "orchestrator.worker", str(launch.spec_path)]

    def command(self, launch: Launch) -> str:
        n = launch.planned.resources.tasks
        env = f"RANK=0..{n - 1} WORLD_SIZE={n} " if n > 1 else ""
        return env + " ".join(self.argv(launch))

    def describe(self, launch: Launch) -> str:
        n = launch.planned.resources.tasks
        return f"local, {n} process{'es' if n > 1 else ''}"

    def prepare(self, tracking: bool, pipeline: bool = False) -> None:
        """Start the fork server now, so that its imports overlap the orchestrator's own work (pipeline: the run's
        train stage has pipeline stages)."""
        if self.fork:
            fork_server.start(tracking, pipeline)

    def _start(self, launch: Launch, env: dict, out_fd: int):
        """One rank, its stdout and stderr on out_fd (closed here once the rank holds it)."""
        try:
            if self.fork:
                return fork_server.RankProcess(str(launch.spec_path), env, out_fd, f"{launch.planned.name}.rank"
                                               f"{env['RANK']}", tracking=bool(launch.spec.get("tracking")))
            return subprocess.Popen(self.argv(launch), env=env, stdout=out_fd, stderr=subprocess.STDOUT,
                                    preexec_fn=_die_with_parent, start_new_session=True)
        finally:
            os.close(out_fd)

    def run(self, launch: Launch) -> Outcome:
        from orchestrator.worker import ORCHESTRATOR_PID_ENV

        tasks = launch.planned.resources.tasks
        launch.log_dir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        procs: list[subprocess.Popen] = []
        outputs: list[Path] = []
        pumps: list[threading.Thread] = []
        recent: deque = deque(maxlen=16)  # rank 0's last output, whether or not its log file could be written
        t0, waited = time.perf_counter(), 0.0
        try:
            for rank in range(tasks):
                env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(tasks),
                       "LOCAL_WORLD_SIZE": str(tasks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "PYTHONUNBUFFERED": "1", ORCHESTRATOR_PID_ENV: str(os.getpid())}
                if sys.stdout.isatty():  # rank 0 prints through a pipe: tell it how wide the terminal is
                    env["COLUMNS"] = str(shutil.get_terminal_size().columns)
                if tasks > 1:
                    env["OMP_NUM_THREADS"] = str(launch.spec.get("threads") or 1)
                out_path = launch.log_dir / f"rank{rank}.out"
                outputs.append(out_path)
                if rank == 0:  # streamed: the terminal and its log file
                    read_end, write_end = os.pipe()
                    p = self._start(launch, env, write_end)
                    # a forked rank starts once the server has imported torch and the stages: the first stage of a
                    # run waits for that here, once; it is the run's start-up, not this stage's time (which the next
                    # plan reads)
                    waited, t0 = time.perf_counter() - t0, time.perf_counter()
                    pump = threading.Thread(target=_pump, args=(os.fdopen(read_end, "rb"), out_path, recent),
                                            daemon=True)
                    pump.start()
                    pumps.append(pump)
                else:
                    p = self._start(launch, env, os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666))
                procs.append(p)
            try:
                failure = self._wait(procs, launch.planned.resources.timeout_min * 60, t0,
                                     launch.log_dir, launch.spec.get("heartbeat_timeout_s"))
            except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the ranks stop at a step boundary (a second kills them)
                for p in procs:
                    if p.poll() is None:
                        p.send_signal(interrupt.received())
                while any(p.poll() is None for p in procs):
                    if interrupt.signals() > 1:  # a second signal, seen from a sweep's thread
                        raise KeyboardInterrupt
                    time.sleep(self.poll_s)
                for pump in pumps:
                    pump.join(timeout=5)
                return Outcome(False, time.perf_counter() - t0, f"interrupted ({interrupt.said()})", interrupted=True,
                               waited_s=waited)
        except BaseException:
            _kill(procs)
            raise
        for pump in pumps:
            pump.join(timeout=5)
        seconds = time.perf_counter() - t0
        if failure is None:
            return Outcome(True, seconds, waited_s=waited)
        rank, what = failure
        log = b"".join(recent).decode(errors="replace") if rank == 0 else \
            tail(outputs[rank]) or tail(launch.log_dir / f"rank{rank}.log")
        if rank == 0:  # rank 0's output was streamed above: its last line, not its traceback a second time
            last = next((line for line in reversed(log.splitlines()) if line.strip()), "")
            return Outcome(False, seconds, f"rank 0 of {tasks}: {what}: {last.strip()}\n(its output is above; "
                                           f"the log: {outputs[0]})")
        return Outcome(False, seconds, f"rank {rank} of {tasks}: {what}\n--- last lines of {outputs[rank]} ---\n{log}")

    def _wait(self, procs: list[subprocess.Popen], timeout_s: float, t0: float, log_dir: Optional[Path] = None,
              heartbeat_timeout_s: Optional[float] = None) -> Optional[tuple[int, str]]:
        """None when every rank exits 0; else (rank, what happened) of the first failure: an exit, a timeout, or a
        rank whose heartbeat stopped (frozen or stopped: the others wait for it in a collective)."""
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                deadline = time.monotonic() + self.grace_s  # let the others report, then stop them
                while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                    time.sleep(self.poll_s)
                rank, code = _root_cause(failed[0], [p.poll() for p in procs])
                _kill(procs)
                return rank, describe_exit(code)
            if all(c == 0 for c in codes):
                return None
            if interrupt.requested():  # in a sweep's thread, which the signal does not interrupt
                raise KeyboardInterrupt
            if time.perf_counter() - t0 > timeout_s:
                _kill(procs)
                return 0, f"timed out after {timeout_s / 60:.0f} min (stage resources timeout_min)"
            silent = _silent_rank(procs, log_dir, heartbeat_timeout_s, time.perf_counter() - t0)
            if silent is not None:
                _kill(procs)
                return silent
            time.sleep(self.poll_s)


def _silent_rank(procs: list[subprocess.Popen], log_dir: Optional[Path], limit: Optional[float],
                 running_s: float) -> Optional[tuple[int, str]]:
    """The first live rank whose heartbeat file is older than `limit` seconds (None: all beat, or no limit). A rank
    that has not beaten yet (still importing torch on a loaded machine) gets three times as long."""
    if not limit or log_dir is None or running_s < limit:
        return None
    from orchestrator.worker import heartbeat_path

    now = time.time()
    for rank, p in enumerate(procs):
        beat = heartbeat_path(log_dir, rank)
        age = now - beat.stat().st_mtime if beat.exists() else running_s / 3
        if p.poll() is None and age > limit:
            try:
                state = psutil.Process(p.pid).status()
            except psutil.Error:
                state = "unknown"
            return rank, (f"stopped responding: no heartbeat for {age:.0f} s (cluster.heartbeat_timeout_s={limit:g}; "
                          f"process state: {state}); the other ranks were waiting for it")
    return None


def _pump(stream, path: Path, recent: deque) -> None:
    """Copy a child's output to our stdout and to its log file as it arrives, keeping the last chunks in `recent`.
    The file gets plain lines (log_text.LogText: no progress-bar frames, no colour codes). A log file that cannot be
    written (a full disk) is given up with one line: the terminal still gets it all."""
    out = getattr(sys.stdout, "buffer", None)

    def show(data: bytes) -> None:
        if out is not None:
            out.write(data)
            out.flush()
        else:
            sys.stdout.write(data.decode(errors="replace"))
            sys.stdout.flush()

    f, plain = None, LogText()
    try:
        f = open(path, "wb")
    except OSError as e:
        show(f"(the log file {path} cannot be written: {e.strerror}; this output goes to the terminal only)\n".encode())
    for chunk in iter(lambda: stream.read1(65536), b""):
        recent.append(chunk)
        if f is not None:
            try:
                f.write(plain.feed(chunk))
                f.flush()
            except OSError as e:
                f = _give_up(f)
                show(f"(the log file {path} cannot be written further: {e.strerror}; the rest of this output goes "
                     "to the terminal only)\n".encode())
        show(chunk)
    if f is not None:
        try:
            f.write(plain.close())
        except OSError:
            pass
        _give_up(f)


def _give_up(f) -> None:
    try:
        f.close()
    except OSError:  # the unwritten buffer of a full disk
        pass


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
