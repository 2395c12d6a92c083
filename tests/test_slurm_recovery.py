"""cluster=slurm on a real 2-node SLURM cluster, when things go wrong: the five stages as jobs, the train job on
both nodes preempted, requeued and resumed exactly, and a node lost mid-training named, with the same command on the
node left going on from the last checkpoint to the losses of an uninterrupted run. (A file of its own: the test workers share the
SLURM tests out file by file.)"""
from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import mlflow
import pytest

from tests.conftest import ROOT, run_cli
from tests.slurm_support import NODES, SCRIPT, jobs_of, losses, node_list, run_dirs, sacct, slurm  # noqa: F401

pytestmark = pytest.mark.slurm


# The whole DAG as jobs on two nodes (one-node jobs take the same path: the sweep in test_slurm.py, 1 and 2 ranks,
# and the lost node's rerun below, 4 ranks on the node left), its train job preempted (signal, save at the step,
# requeue, resume: dp2 x pp2, four ranks on two hosts, stop together; tensor parallelism across the two nodes is the
# lost node's test) and ending with the losses of one local process
def test_five_stages_as_jobs_on_two_nodes_a_preempted_train_job_requeued_with_the_loss_of_one_process(slurm, tmp_path):
    # the signal is sent once rank 0 has printed step 4 (its job log is written as it prints: the scratch metrics are
    # synced at checkpoints only): it lands mid-training, 20 steps before the last
    training = ["train.steps=24", "train.checkpoint_every=1000", "train.log_every=1", "train.eval_every=0",
                "model.n_layers=2", "train.batch_size=8", "train.seq_len=32"]
    args = [*training, "parallel=dp2_hp2_pp2", "parallel.hp=1", "cluster.nodes=2"]
    work = tmp_path / "slurm"
    work.mkdir()
    submitted = run_cli(["cluster=slurm", "cluster.wait=false", *args], work)
    assert submitted.returncode == 0 and "python -m orchestrator.follow" in submitted.stdout, submitted.stdout
    (run_dir,) = run_dirs(work)
    jobs = jobs_of(run_dir)
    assert [j["stage"] for j in jobs] == ["tokenize", "export", "transform", "train", "checkpoint", "aggregate"]
    train = next(j for j in jobs if j["stage"] == "train")
    deadline, log = time.time() + 300, Path(train["folder"]) / f"{train['job_id']}_0_log.out"
    while time.time() < deadline:  # signal once training is under way (some steps done, not all)
        if log.exists() and re.search(r"^step +4/24 ", log.read_text(), re.M):
            break
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=USR2", train["job_id"]], check=True)  # what SLURM sends before the limit
    followed = subprocess.run([os.sys.executable, "-m", "orchestrator.follow", str(run_dir)], cwd=work,
                              env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"},
                              capture_output=True, text=True, timeout=600)
    assert followed.returncode == 0, followed.stdout + followed.stderr
    log = (Path(train["folder"]) / f"{train['job_id']}_0_log.out").read_text()
    assert "stopped at step" in log and "starting from the checkpoint of step" in log
    assert train["tasks"] == 4 and len(list(Path(train["folder"]).glob("*_log.out"))) == 4
    assert len(node_list(train["job_id"])) == 2  # sacct: the job ran on both nodes
    tokenize = next(j for j in jobs if j["stage"] == "tokenize")  # one task per node, each writing a part
    assert tokenize["tasks"] == 2 and len(node_list(tokenize["job_id"])) == 2
    assert all(s["state"] == "COMPLETED" for s in sacct([j["job_id"] for j in jobs]).values())

    reference = tmp_path / "reference"
    reference.mkdir()
    uninterrupted = run_cli(["cluster=local", "tracking=none", *training], reference)  # one process
    assert uninterrupted.returncode == 0, uninterrupted.stdout + uninterrupted.stderr
    (ref_dir,) = [p.parent for p in (reference / "runs").rglob("plan.json")]
    assert len(losses(run_dir)) == 24
    assert losses(run_dir) == pytest.approx(losses(ref_dir), abs=1e-5)

    client = mlflow.MlflowClient(f"sqlite:///{work}/runs/mlflow.db")
    run = client.get_run(train["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["slurm.requeues"] == "1"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == list(range(1, 25))


def test_a_lost_node_is_named_and_the_run_goes_on_on_the_node_left(slurm, tmp_path):
    # hp2 x pp2, two ranks a node: a node's ranks lost together (after step 10's checkpoint), the rerun's four on the
    # node left
    training = ["train.steps=20", "train.checkpoint_every=5", "train.log_every=1", "train.eval_every=0",
                "model.n_layers=2", "train.batch_size=8", "train.seq_len=32"]
    args = ["parallel=dp2_hp2_pp2", "parallel.dp=1", "tracking=none", *training]  # MLflow: the preemption's test
    work = tmp_path / "slurm"
    work.mkdir()
    proc = subprocess.Popen([os.sys.executable, "-m", "orchestrator", "cluster=slurm", "cluster.nodes=2", *args],
                            cwd=work, env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 400
        while not any((work / "runs" / "cache" / "train").glob("*.work/scratch/checkpoints/step_0000010/manifest.json")):
            assert proc.poll() is None and time.time() < deadline, "the 2-node run ended before its step-10 checkpoint"
            time.sleep(0.1)
        # the node dies: its slurmd and every process in its network namespace
        subprocess.run(["kill", "-9", Path("/run/slurmd-slnode2.pid").read_text().strip()], check=True)
        pids = subprocess.run(["ip", "netns", "pids", "slnode2"], capture_output=True, text=True).stdout.split()
        subprocess.run(["kill", "-9", *pids], capture_output=True)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        subprocess.run([SCRIPT, "start"], capture_output=True, timeout=300, env=NODES)  # the node back, for the rest
    assert proc.returncode == 1, out[-4000:]
    flat = " ".join(re.sub(r"[│╭╮╰╯─]", " ", out).split())  # the message as one line, out of its panel
    assert "NODE_FAIL: the job lost node slnode2 (ranks 2-3) of its 2" in flat, out[-4000:]
    assert "the same command with cluster.nodes=1" in flat and "resumes from step" in flat, out[-4000:]

    resumed = run_cli(["cluster=slurm", "cluster.nodes=1", *args], work, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-4000:]
    assert "resumes from step" in resumed.stdout
    run_dir = max(run_dirs(work), key=lambda d: d.name)
    train = next(j for j in jobs_of(run_dir) if j["stage"] == "train")
    assert len(node_list(train["job_id"])) == 1

    reference = tmp_path / "reference"
    reference.mkdir()
    uninterrupted = run_cli(["cluster=local", "tracking=none", *training], reference)  # one process
    assert uninterrupted.returncode == 0, uninterrupted.stdout + uninterrupted.stderr
    (ref_dir,) = [p.parent for p in (reference / "runs").rglob("plan.json")]
    assert len(losses(run_dir)) == 20
    assert losses(run_dir) == pytest.approx(losses(ref_dir), abs=1e-5)
