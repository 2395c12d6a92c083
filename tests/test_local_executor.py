"""The local executor's bookkeeping, with stand-in ranks (the real processes are in test_layouts and test_cli_e2e)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from orchestrator.cluster.local import LocalExecutor
from orchestrator.worker import HEARTBEAT_S
from runtime.threads import cores_shared_by, rank_threads, usable_cores

ROOT = Path(__file__).resolve().parents[1]


class _ExitsAt:
    """A stand-in rank that exits with `code` on its `polls`-th poll."""

    def __init__(self, code, polls):
        self.code, self.polls = code, polls

    def poll(self):
        self.polls -= 1
        return self.code if self.polls <= 0 else None

    def kill(self):
        if self.polls > 0:
            self.code, self.polls = -signal.SIGKILL, 0

    def wait(self, timeout=None):
        return self.code


def test_a_rank_killed_by_a_signal_is_named_even_when_its_peer_is_seen_failing_first():
    executor = LocalExecutor(poll_s=0.001, grace_s=1.0)
    # rank 0 fails in its next collective ("Connection reset by peer") and is polled first; rank 1 was SIGKILLed
    failure = executor._wait([_ExitsAt(1, polls=1), _ExitsAt(-signal.SIGKILL, polls=3)], 60, time.perf_counter())
    assert failure == (1, "killed by signal SIGKILL")
    # without a signal, the first failure seen is the one named
    assert executor._wait([_ExitsAt(0, 5), _ExitsAt(3, 1)], 60, time.perf_counter()) == (1, "exit code 3")


def test_a_rank_ends_when_the_orchestrator_it_serves_is_gone(tmp_path):
    """The heartbeat thread's watch of the orchestrator's pid, alone (no PDEATHSIG, no fork server)."""
    orchestrator = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    beat = tmp_path / "rank0.heartbeat"
    rank = subprocess.Popen([sys.executable, "-c", f"from pathlib import Path; from orchestrator.worker import _beat; "
                             f"_beat(Path({str(beat)!r}), {orchestrator.pid})"], cwd=ROOT, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not beat.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(3 * HEARTBEAT_S)
        assert rank.poll() is None, "the rank ends only with the orchestrator"
        orchestrator.kill()
        orchestrator.wait()
        assert rank.wait(timeout=3 * HEARTBEAT_S) == -signal.SIGKILL
        assert f"orchestrator (pid {orchestrator.pid}) is gone" in rank.stderr.read().decode()
    finally:
        for p in (rank, orchestrator):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_rank_runs_the_configured_threads_else_omp_num_threads_else_its_usable_cores(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert rank_threads(5, 1) == 5  # cluster.threads_per_rank wins
    assert rank_threads(None, 1) == 3
    assert rank_threads(None, 4) == 1  # several ranks share the cores
    for unset in ("", "auto", "0"):
        monkeypatch.setenv("OMP_NUM_THREADS", unset)
        assert rank_threads(None, 1) == usable_cores() == len(os.sched_getaffinity(0))


def test_points_run_at_once_share_the_cores_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    with cores_shared_by(2):
        assert rank_threads(None, 1) == max(1, usable_cores() // 2)
    assert "OMP_NUM_THREADS" not in os.environ and rank_threads(None, 1) == usable_cores()
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    with cores_shared_by(2):
        assert rank_threads(None, 1) == 7


def test_the_fork_server_is_forked_from_the_orchestrator_only_while_no_thread_runs():
    """Forked, it inherits the orchestrator's imports; a thread started since them (Python's, torch's OpenMP pool,
    MLflow's) would leave its locks held in the copy: then the server is a fresh interpreter."""
    probe = ("import threading, time, torch\n"
             "from orchestrator.cluster import fork_server as f\n"
             "before = f._forkable()\n"
             "torch.set_num_threads(2); torch.ones(512, 512) @ torch.ones(512, 512)  # OpenMP's pool starts\n"
             "pool = f._forkable()\n"
             "threading.Thread(target=time.sleep, args=(3,), daemon=True).start()\n"
             "print(before, pool, f._forkable())\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1], env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert out.stdout.split() == ["True", "False", "False"], out.stdout + out.stderr
