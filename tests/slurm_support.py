"""What the SLURM tests share: a 2-node cluster (scripts/slurm_cluster.sh, NODES=2), and reading its jobs."""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import psutil
import pytest
from filelock import FileLock


SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "slurm_cluster.sh"
SMALL = ["model.n_layers=2", "train.batch_size=8", "train.seq_len=32", "train.log_every=1", "train.eval_every=0"]


NODES = {**os.environ, "NODES": "2", "SLURM_CPUS": "32"}  # 16 CPUs a node: the two SLURM test files run side by side
STARTED_HERE = Path(tempfile.gettempdir()) / "orchestrator-tests-started-slurm"  # the pid of the session that did


def _session_pid() -> int:
    """The pytest session's process: xdist's controller (a worker's parent), or this process under -n 0."""
    return os.getppid() if os.environ.get("PYTEST_XDIST_WORKER") else os.getpid()


@pytest.fixture(scope="session")
def slurm():
    """A running 2-node cluster: the one already up, else one started here. Two test workers may ask at once: one
    starts it (under a lock); the session's end (conftest's pytest_sessionfinish, once all workers are done)
    stops a cluster this session started, and only that: another pytest session on the machine (a clone's CI) may
    be using one it started itself. A cluster whose starting session is gone is adopted."""
    with FileLock(str(STARTED_HERE) + ".lock"):
        if subprocess.run([SCRIPT, "status"], capture_output=True, env=NODES).returncode != 0:
            if os.geteuid() != 0:
                pytest.fail("the SLURM tests need a SLURM cluster: start one with `sudo NODES=2 "
                            "scripts/slurm_cluster.sh start` (root is needed to install and start munge, mariadb, "
                            "slurmdbd, slurmctld, slurmd and the nodes' namespaces), or leave them out: "
                            "pytest -m 'not slurm'")
            started = subprocess.run([SCRIPT, "start"], capture_output=True, text=True, timeout=900, env=NODES)
            assert started.returncode == 0, f"could not start SLURM:\n{started.stdout}\n{started.stderr}"
            STARTED_HERE.write_text(str(_session_pid()))
        elif STARTED_HERE.exists() and not psutil.pid_exists(int(STARTED_HERE.read_text() or 0)):
            STARTED_HERE.write_text(str(_session_pid()))


def stop_if_started_here() -> None:
    """Called by the session's controller (its pid is the one the workers wrote)."""
    with FileLock(str(STARTED_HERE) + ".lock"):
        if STARTED_HERE.exists() and STARTED_HERE.read_text() == str(os.getpid()):
            subprocess.run([SCRIPT, "stop"], capture_output=True, timeout=300)
            STARTED_HERE.unlink()


def jobs_of(run_dir: Path) -> list[dict]:
    return json.loads((run_dir / "slurm_jobs.json").read_text())["stages"]


def run_dirs(workdir: Path) -> list[Path]:
    return sorted(p.parent for p in (workdir / "runs").rglob("slurm_jobs.json"))


def losses(run_dir: Path) -> list[float]:
    metrics = (run_dir / "stages" / "train" / "output" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in metrics]


def sacct(job_ids: list[str]) -> dict[str, dict]:
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", ",".join(job_ids), "-o", "JobIDRaw,State,Start,End"],
                         capture_output=True, text=True).stdout
    rows = [line.split("|") for line in out.splitlines()]
    return {r[0]: {"state": r[1].split()[0], "start": r[2], "end": r[3]} for r in rows if len(r) == 4}


def node_list(job_id: str) -> list[str]:
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "NodeList"], capture_output=True,
                         text=True).stdout.split()
    return subprocess.run(["scontrol", "show", "hostnames", out[-1]], capture_output=True, text=True).stdout.split()


def our_queued_jobs(workdir: Path) -> list[str]:
    """The queued jobs submitted from this folder (their batch scripts are under it; tests run side by side)."""
    out = subprocess.run(["squeue", "-h", "-o", "%i|%o"], capture_output=True, text=True).stdout
    return [line.split("|")[0] for line in out.splitlines() if line.split("|")[-1].startswith(str(workdir))]
