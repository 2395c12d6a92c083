"""cluster=slurm against a real 2-node SLURM cluster (scripts/slurm_cluster.sh, NODES=2: each slurmd in a network
namespace of its own; started here if needed).

Five stages as jobs with the loss of a local run, a failing stage's dependants cancelled and the rerun resuming
there, a 4-point sweep with per-point resources and one shared export, a layout tune whose trials are jobs submitted
together, a preempted train job requeued from its checkpoint with the loss of an uninterrupted run, and requests the
scheduler refuses reported with their key; on both nodes: a dp2 hp2 pp2 job with the loss of a local run, a
preempted 2-node job requeued exactly, and a node lost mid-training named, with the same command on the node left
continuing from the last checkpoint.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import mlflow
import pytest

from tests.conftest import ROOT, run_cli

pytestmark = pytest.mark.slurm
SCRIPT = ROOT / "scripts" / "slurm_cluster.sh"
SMALL = ["model.n_layers=2", "train.batch_size=8", "train.seq_len=32", "train.log_every=1", "train.eval_every=0"]


NODES = {**os.environ, "NODES": "2"}


@pytest.fixture(scope="session")
def slurm():
    """A running 2-node cluster: the one already up, else one started here (and stopped again at the end)."""
    if subprocess.run([SCRIPT, "status"], capture_output=True, env=NODES).returncode == 0:
        yield
        return
    if os.geteuid() != 0:
        pytest.fail("the SLURM tests need a SLURM cluster: start one with `sudo scripts/slurm_cluster.sh start` "
                    "(root is needed to install and start munge, mariadb, slurmdbd, slurmctld, slurmd), or leave "
                    "them out: pytest -m 'not slurm'")
    started = subprocess.run([SCRIPT, "start"], capture_output=True, text=True, timeout=900, env=NODES)
    assert started.returncode == 0, f"could not start SLURM:\n{started.stdout}\n{started.stderr}"
    try:
        yield
    finally:
        subprocess.run([SCRIPT, "stop"], capture_output=True, timeout=120)


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


def our_queued_jobs(job_names: set[str]) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%j"], capture_output=True, text=True).stdout
    return [n for n in out.split() if n in job_names]


@pytest.mark.parametrize("layout,nodes,tasks", [("megatron_hp4", 1, 4), ("dp2_hp2_pp2", 2, 8)])
def test_five_stages_as_jobs_with_the_loss_of_a_local_run(slurm, tmp_path, layout, nodes, tasks):
    args = [f"parallel={layout}", "train.steps=6", *SMALL]
    (tmp_path / "slurm").mkdir()
    on_slurm = run_cli(["cluster=slurm", f"cluster.nodes={nodes}", *args], tmp_path / "slurm", timeout=600)
    assert on_slurm.returncode == 0, on_slurm.stdout + on_slurm.stderr
    (run_dir,) = run_dirs(tmp_path / "slurm")
    jobs = jobs_of(run_dir)
    assert [j["stage"] for j in jobs] == ["tokenize", "export", "transform", "train", "checkpoint", "aggregate"]
    train = next(j for j in jobs if j["stage"] == "train")
    assert train["tasks"] == tasks and len(list(Path(train["folder"]).glob("*_log.out"))) == tasks
    assert len(node_list(train["job_id"])) == nodes  # sacct: the job ran on that many nodes
    assert all(s["state"] == "COMPLETED" for s in sacct([j["job_id"] for j in jobs]).values())

    (tmp_path / "local").mkdir()
    local = run_cli(["cluster=local", "tracking=none", *args], tmp_path / "local", timeout=600)
    assert local.returncode == 0, local.stdout + local.stderr
    (local_dir,) = [p.parent for p in (tmp_path / "local" / "runs").rglob("plan.json")]
    assert losses(run_dir) == pytest.approx(losses(local_dir), abs=1e-5)


def test_failed_stage_cancels_dependants_shows_traceback_and_rerun_resumes(slurm, workdir):
    args = ["cluster=slurm", "train.steps=3", *SMALL]
    failed = run_cli(args, workdir, env={"ORCHESTRATOR_FAIL_STAGE": "train"})
    assert failed.returncode == 1, failed.stdout + failed.stderr
    out = failed.stdout
    assert "Traceback" in out and "injected failure: ORCHESTRATOR_FAIL_STAGE=train" in out
    (run_dir,) = run_dirs(workdir)
    jobs = {j["stage"]: j["job_id"] for j in jobs_of(run_dir)}
    states = sacct(list(jobs.values()))
    assert states[jobs["train"]]["state"] == "FAILED"
    assert states[jobs["checkpoint"]]["state"] == "CANCELLED" and states[jobs["aggregate"]]["state"] == "CANCELLED"
    assert "cancelled: needs train" in out

    again = run_cli(args, workdir)
    assert again.returncode == 0, again.stdout + again.stderr
    rerun_dir = next(d for d in run_dirs(workdir) if d != run_dir)
    assert [j["stage"] for j in jobs_of(rerun_dir)] == ["train", "checkpoint", "aggregate"]  # export, transform cached

    client = mlflow.MlflowClient(f"sqlite:///{workdir}/runs/mlflow.db")
    exp = client.get_experiment_by_name("orchestrator")
    stage_runs = client.search_runs([exp.experiment_id], "tags.`orchestrator.kind` = 'stage'")
    by = {(r.data.tags["orchestrator.stage"], r.info.status) for r in stage_runs}
    assert ("train", "FAILED") in by and ("checkpoint", "KILLED") in by and ("train", "FINISHED") in by
    assert not [r for r in stage_runs if r.info.status == "RUNNING"]


def test_sweep_runs_points_concurrently_with_their_own_resources_and_one_export(slurm, workdir):
    result = run_cli(["-m", "cluster=slurm", "parallel=ddp2,megatron_hp4", "optimizer.lr=1e-3,3e-4",
                      "train.steps=4", *SMALL], workdir, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    dirs = run_dirs(workdir)
    assert len(dirs) == 4
    jobs = [j for d in dirs for j in jobs_of(d)]
    assert len({j["job_id"] for j in jobs if j["stage"] == "export"}) == 1          # submitted once, shared
    assert sorted(j["tasks"] for j in jobs if j["stage"] == "train") == [2, 2, 4, 4]
    trains = sacct([j["job_id"] for j in jobs if j["stage"] == "train"])
    spans = sorted((t["start"], t["end"]) for t in trains.values())
    assert any(b[0] < a[1] for a, b in zip(spans, spans[1:])), f"no two train jobs overlapped: {spans}"

    summary = json.loads(next((workdir / "runs" / "multirun").rglob("sweep_summary.json")).read_text())
    rows = summary["points"]
    assert [r["status"] for r in rows] == ["ok"] * 4
    assert {r["layout"] for r in rows} == {"dp2 hp1 pp1", "dp1 hp4 pp1"}
    by_lr = {}
    for r in rows:  # every layout gives the loss of the others at the same learning rate
        by_lr.setdefault(r["overrides"].split("optimizer.lr=")[1], []).append(r["final_loss"])
    for values in by_lr.values():
        assert values[0] == pytest.approx(values[1], rel=1e-5)
    assert "final loss" in result.stdout and "tokens/s" in result.stdout

    client = mlflow.MlflowClient(f"sqlite:///{workdir}/runs/mlflow.db")
    exp = client.get_experiment_by_name("orchestrator")
    (sweep,) = client.search_runs([exp.experiment_id], "tags.`orchestrator.kind` = 'sweep'")
    assert sweep.info.status == "FINISHED"
    points = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{sweep.info.run_id}'")
    assert len(points) == 4
    for p in points:
        stages = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{p.info.run_id}'")
        assert sorted(s.data.tags["orchestrator.stage"] for s in stages) == \
            ["aggregate", "checkpoint", "export", "tokenize", "train", "transform"]
        assert all(s.info.status == "FINISHED" for s in stages)


def test_tune_submits_every_trial_at_once_and_ranks_them(slurm, workdir):
    result = run_cli(["cluster=slurm", "tune=layout", "tune.world_size=2", "tune.steps=4", "tracking=none", *SMALL],
                     workdir, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    record = json.loads(next((workdir / "runs").rglob("tune.json")).read_text())
    assert len(record["ranking"]) == 4 and all(t["status"] == "ran" for t in record["trials"])
    trains = [j["job_id"] for d in run_dirs(workdir) for j in jobs_of(d) if j["stage"] == "train"]
    spans = sorted((t["start"], t["end"]) for t in sacct(trains).values())
    assert len(spans) == 4 and any(b[0] < a[1] for a, b in zip(spans, spans[1:])), f"no two trials overlapped: {spans}"
    assert "cluster=slurm" in record["command"] and "tune" not in record["command"]


@pytest.mark.parametrize("layout", [[], ["parallel=dp2_hp2_pp2", "cluster.nodes=2"]], ids=["one-node", "two-nodes"])
def test_preempted_train_job_is_requeued_and_ends_with_the_uninterrupted_loss(slurm, tmp_path, layout):
    # full-size gpt_tiny steps (~0.1 s each under SLURM): the signal lands mid-training, not after the last step
    args = ["train.steps=40", "train.checkpoint_every=1000", "train.log_every=1", "train.eval_every=0", *layout]
    work = tmp_path / "slurm"
    work.mkdir()
    submitted = run_cli(["cluster=slurm", "cluster.wait=false", *args], work)
    assert submitted.returncode == 0 and "python -m orchestrator.follow" in submitted.stdout, submitted.stdout
    (run_dir,) = run_dirs(work)
    train = next(j for j in jobs_of(run_dir) if j["stage"] == "train")
    deadline = time.time() + 300
    while time.time() < deadline:  # signal once training is under way (some steps logged, not all)
        metrics = next((work / "runs" / "cache" / "train").glob("*.work/scratch/metrics.jsonl"), None)
        if metrics and metrics.exists() and len(metrics.read_text().splitlines()) >= 5:
            break
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=USR2", train["job_id"]], check=True)  # what SLURM sends before the limit
    followed = subprocess.run([os.sys.executable, "-m", "orchestrator.follow", str(run_dir)], cwd=work,
                              env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"},
                              capture_output=True, text=True, timeout=600)
    assert followed.returncode == 0, followed.stdout + followed.stderr
    log = (Path(train["folder"]) / f"{train['job_id']}_0_log.out").read_text()
    assert "stopped at step" in log and "starting from the checkpoint of step" in log

    reference = tmp_path / "reference"
    reference.mkdir()
    uninterrupted = run_cli(["cluster=local", "tracking=none", *args[:4]], reference)  # one process
    assert uninterrupted.returncode == 0, uninterrupted.stdout + uninterrupted.stderr
    (ref_dir,) = [p.parent for p in (reference / "runs").rglob("plan.json")]
    assert len(losses(run_dir)) == 40
    assert losses(run_dir) == pytest.approx(losses(ref_dir), abs=1e-5)

    client = mlflow.MlflowClient(f"sqlite:///{work}/runs/mlflow.db")
    run = client.get_run(train["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["slurm.requeues"] == "1"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == list(range(1, 41))


def test_oversized_request_is_refused_at_submission_and_nothing_stays_queued(slurm, workdir):
    result = run_cli(["cluster=slurm", "parallel=megatron_hp4", "cluster.cpus_per_task=64", *SMALL], workdir)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "cluster.cpus_per_task=64" in result.stderr and "More processors requested than permitted" in result.stderr
    assert "fix:  cluster.cpus_per_task=" in result.stderr
    plan = json.loads(next((workdir / "runs").rglob("plan.json")).read_text())
    assert not our_queued_jobs({f"{s['stage']}-{s['key'][:8]}" for s in plan})


def test_a_lost_node_is_named_and_the_run_goes_on_on_the_node_left(slurm, tmp_path):
    args = ["parallel=dp2_hp2_pp2", "train.steps=30", "train.checkpoint_every=5", "train.log_every=1",
            "train.eval_every=0", "model.n_layers=2", "train.batch_size=8", "train.seq_len=32"]
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
    assert "NODE_FAIL: the job lost node slnode2 (ranks 4-7) of its 2" in flat, out[-4000:]
    assert "the same command with cluster.nodes=1" in flat and "resumes from step" in flat, out[-4000:]

    resumed = run_cli(["cluster=slurm", "cluster.nodes=1", *args], work, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-4000:]
    assert "resumes from step" in resumed.stdout
    run_dir = max(run_dirs(work), key=lambda d: d.name)
    train = next(j for j in jobs_of(run_dir) if j["stage"] == "train")
    assert len(node_list(train["job_id"])) == 1

    reference = tmp_path / "reference"
    reference.mkdir()
    uninterrupted = run_cli(["cluster=local", "tracking=none", *args[1:]], reference)  # one process
    assert uninterrupted.returncode == 0, uninterrupted.stdout + uninterrupted.stderr
    (ref_dir,) = [p.parent for p in (reference / "runs").rglob("plan.json")]
    assert len(losses(run_dir)) == 30
    assert losses(run_dir) == pytest.approx(losses(ref_dir), abs=1e-5)
