"""Sweeps on this machine, and the SLURM settings checked without a cluster: job parameters, refusals in
config terms, validation."""
from __future__ import annotations

import json
import shutil

import mlflow
import pytest

from orchestrator.dag import plan
from orchestrator.cache.store import Cache
from orchestrator.config.errors import ConfigError
from orchestrator.cluster.slurm_submit import _rejection, sbatch_parameters
from orchestrator.config.validate import validate
from stages import all_stages
from tests.conftest import ROOT, make_cfg, run_cli, signal_cli


def planned(cfg, tmp_path, name):
    return next(ps for ps in plan(cfg, all_stages(), Cache(tmp_path / "cache")) if ps.name == name)


def test_train_job_has_one_task_per_rank_spread_over_nodes_and_waits_for_its_inputs(tmp_path):
    cfg = make_cfg("cluster=slurm", "parallel=dp2_hp2_pp2", "cluster.nodes=2", "cluster.cpus_per_task=2",
                   "cluster.mem_per_task_gb=1.5", "cluster.partition=big", "+cluster.sbatch.constraint=a100",
                   "cluster.time_min.train=30", runs_dir=tmp_path)
    params = sbatch_parameters(cfg.cluster, planned(cfg, tmp_path, "train"), ["11", "12"])
    assert params["nodes"] == 2 and params["ntasks_per_node"] == 4 and params["cpus_per_task"] == 2
    assert params["mem"] == f"{int(1.5 * 1024 * 4)}M" and params["partition"] == "big" and params["time"] == 30
    assert params["dependency"] == "afterok:11:12"
    assert params["additional_parameters"] == {"kill_on_invalid_dep": "yes", "constraint": "a100"}
    export = sbatch_parameters(cfg.cluster, planned(cfg, tmp_path, "export"), [])
    assert export["nodes"] == 1 and export["ntasks_per_node"] == 1 and "dependency" not in export


@pytest.mark.parametrize("message, key", [
    ("sbatch: error: Batch job submission failed: Invalid partition name specified", "cluster.partition"),
    ("sbatch: error: Memory specification can not be satisfied\nsbatch: error: Batch job submission failed: "
     "Requested node configuration is not available", "cluster.mem_per_task_gb"),
    ("sbatch: error: Batch job submission failed: More processors requested than permitted", "parallel"),
    ("sbatch: error: Batch job submission failed: Node count specification invalid", "cluster.nodes"),
    ("sbatch: error: Batch job submission failed: Invalid account or account/partition combination specified",
     "cluster.account"),
])
def test_scheduler_refusals_name_the_key_to_change(tmp_path, message, key):
    cfg = make_cfg("cluster=slurm", "parallel=megatron_hp4", runs_dir=tmp_path)
    problem = _rejection(cfg, planned(cfg, tmp_path, "train"), message)
    assert problem.key == key
    assert message.splitlines()[-1].split("failed: ")[1] in problem.rule and problem.fix


def on_a_login_node(monkeypatch, nodes: list[tuple[str, str, str]], addresses: dict[str, str] = {}):
    """SLURM as `sinfo` would describe it, and the nodes' names as this machine resolves them."""
    import socket

    from orchestrator.cluster import slurm_queue

    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(slurm_queue, "default_partition", lambda: "debug")
    monkeypatch.setattr(slurm_queue, "partition_nodes", lambda partition: nodes)
    monkeypatch.setattr(socket, "gethostbyname", lambda name: addresses.get(name, "10.0.0.1"))


def test_slurm_layout_rules(tmp_path, monkeypatch):
    on_a_login_node(monkeypatch, [(f"n{i}", "idle", "(null)") for i in range(4)])
    cfg = make_cfg("cluster=slurm", "parallel=megatron_hp4", "cluster.nodes=3", "+cluster.time_min.eval=5",
                   runs_dir=tmp_path)
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    keys = {p.key for p in e.value.problems}
    assert keys == {"cluster.nodes", "cluster.time_min.eval"}
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ConfigError) as e:
        validate(make_cfg("cluster=slurm", runs_dir=tmp_path))
    assert any(p.key == "cluster" and "scripts/slurm_cluster.sh start" in p.fix for p in e.value.problems)


def test_a_multi_node_job_is_checked_against_the_partition_before_submission(tmp_path, monkeypatch):
    two_nodes = ["cluster=slurm", "parallel=dp2_hp2_pp2", "cluster.nodes=2"]
    on_a_login_node(monkeypatch, [("n1", "idle", "(null)"), ("n2", "idle", "(null)")])
    validate(make_cfg(*two_nodes, runs_dir=tmp_path))  # two nodes up, resolving to a real address: fine

    on_a_login_node(monkeypatch, [("n1", "idle", "(null)"), ("n2", "down*", "(null)")])  # a node lost
    with pytest.raises(ConfigError) as e:
        validate(make_cfg(*two_nodes, runs_dir=tmp_path))
    (p,) = e.value.problems
    assert p.key == "cluster.nodes" and "1 node(s) up of 2" in p.rule and p.fix.startswith("cluster.nodes=1")

    on_a_login_node(monkeypatch, [("n1", "idle", "(null)"), ("n2", "idle", "(null)")], {"n1": "127.0.1.1"})
    with pytest.raises(ConfigError) as e:
        validate(make_cfg(*two_nodes, runs_dir=tmp_path))
    (p,) = e.value.problems
    assert "node n1 resolves to 127.0.1.1" in p.rule and "rendezvous" in p.rule and "/etc/hosts" in p.fix

    with pytest.raises(ConfigError) as e:
        validate(make_cfg("cluster=slurm", "parallel=ddp2", "cluster.gpus_per_task=1", runs_dir=tmp_path))
    (p,) = e.value.problems
    assert p.key == "cluster.gpus_per_task" and "has no GPUs" in p.rule
    on_a_login_node(monkeypatch, [("g1", "idle", "gpu:h100:8")])
    validate(make_cfg("cluster=slurm", "parallel=ddp2", "cluster.gpus_per_task=1", runs_dir=tmp_path))


def test_invalid_sweep_point_stops_the_whole_sweep_before_anything_runs(workdir):
    result = run_cli(["-m", "parallel=single,megatron_hp2", "model.n_heads=3", "model.d_model=96"], workdir)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "invalid sweep, nothing was started" in result.stderr and "point parallel=megatron_hp2" in result.stderr
    assert not (workdir / "runs" / "cache").exists()


def test_slurm_dry_run_needs_no_slurm(workdir, tmp_path):
    """From a laptop or a CI box: the sbatch scripts and the afterok chain, from the config alone."""
    empty = tmp_path / "bin"
    empty.mkdir()
    result = run_cli(["cluster=slurm", "parallel=megatron_hp2", "dry_run=true", "tracking=none"], workdir,
                     env={"PATH": str(empty)})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stdout.count("#SBATCH --job-name=") == 6 and "#SBATCH --ntasks-per-node=2" in result.stdout
    assert "train (submitted with --dependency=afterok on the jobs of transform, tokenize)" in result.stdout
    assert not (workdir / "runs" / "cache").exists()


SWEEP_SIGNAL = ["train.steps=200", "model.n_layers=1", "train.batch_size=4", "train.seq_len=32", "train.log_every=5",
                "train.eval_every=0", "train.checkpoint_every=0", "tracking=mlflow"]


@pytest.mark.e2e
@pytest.mark.parametrize("seeds,parallelism,statuses", [("21,22", 1, ["interrupted", "not run"]),
                                                        ("21,22,23", 2, ["interrupted", "interrupted", "not run"])],
                         ids=["one-at-a-time", "side-by-side"])
def test_a_signal_stops_the_whole_sweep_and_the_same_command_continues(workdir, tmp_path, seeds, parallelism,
                                                                       statuses):
    """SIGTERM to the command's process group while point 0 trains (and point 1 beside it, with sweep.parallelism=2,
    in a thread the signal does not interrupt): the points in flight save and end interrupted, no further point
    starts, the summary says so, the sweep's MLflow run ends KILLED and the command exits 143, as one run would.
    One at a time, the same command then finishes both points: point 0 from its checkpoint, with the loss of a run
    that never stopped."""
    import re

    from tests.conftest import signal_cli

    args = ["-m", f"train.seed={seeds}", f"sweep.parallelism={parallelism}", *SWEEP_SIGNAL]
    code, out, took = signal_cli(args, workdir, lambda lines: sum(bool(re.search(r"step\s+5/200", line))
                                                                  for line in lines) >= parallelism)
    said = "".join(line for line in out.splitlines(True) if line.startswith("error")) + out[-3000:]  # a refusal
    assert code == 143, said
    assert f"point {parallelism}:" not in out and "Traceback" not in out, said
    assert took < 30, f"the sweep took {took:.1f} s to stop"  # tests/test_cli_e2e.py: SIGNAL_BOUND_S
    summary = json.loads(next(workdir.rglob("sweep_summary.json")).read_text())
    assert [r["status"] for r in sorted(summary["points"], key=lambda r: r["point"])] == statuses
    client = mlflow.MlflowClient(f"sqlite:///{workdir}/runs/mlflow.db")
    exp = client.get_experiment_by_name("orchestrator")
    (sweep,) = client.search_runs([exp.experiment_id], "tags.`orchestrator.kind` = 'sweep'")
    assert sweep.info.status == "KILLED"
    if parallelism > 1:
        return  # continuing is the same path as one at a time

    again = run_cli(args, workdir)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert re.search(r"resumes from step \d+", again.stdout)
    rows = {r["point"]: r for r in json.loads(sorted(workdir.rglob("sweep_summary.json"))[-1].read_text())["points"]}
    assert [rows[i]["status"] for i in (0, 1)] == ["ok", "ok"]
    reference = tmp_path / "uninterrupted"
    reference.mkdir()
    alone = run_cli(["train.seed=21", *SWEEP_SIGNAL[:-1], "tracking=none"], reference)
    assert alone.returncode == 0, alone.stdout[-3000:] + alone.stderr[-3000:]
    (trained,) = (reference / "runs" / "cache" / "train").glob("*/summary.json")
    assert rows[0]["final_loss"] == json.loads(trained.read_text())["final_loss"]


def test_a_sweep_too_large_is_refused_at_once_and_a_signal_stops_its_check(workdir):
    import time

    t0 = time.monotonic()
    huge = run_cli(["-m", "train.seed=range(0,100000)", "dry_run=true"], workdir)
    assert huge.returncode == 2 and "this sweep has 100,000 points" in huge.stderr, huge.stderr[-2000:]
    assert time.monotonic() - t0 < 30  # under 1 s on an idle machine; the bound is for a loaded CI worker
    globbed = run_cli(["-m", "model=glob(*)", "train.seed=range(0,60)", "dry_run=true"], workdir)  # a group's options
    n = len(list((ROOT / "conf" / "model").glob("*.yaml")))
    assert globbed.returncode == 2 and f"{n * 60} points (model: {n} x train.seed: 60)" in globbed.stderr, \
        globbed.stderr
    code, out, took = signal_cli(["-m", "train.seed=range(0,200)", "dry_run=true"], workdir,
                                 lambda lines: any("checking 200 point(s)" in line for line in lines))
    assert code == 143 and took < 5 and "while the command was checked: nothing was started" in out, out[-2000:]
    assert not (workdir / "runs").exists()


def test_the_study_table_and_the_sweep_table_say_the_same_of_a_trial_that_never_started(tmp_path):
    """After a signal Optuna holds both trials of the batch running; the one whose point never started reads
    `not run` in the study's table, as in the sweep's, and the one stopped mid-way `interrupted` in both."""
    from orchestrator.report import plain_text
    from orchestrator.sweeps.study import KeptStudy

    running = {"state": "RUNNING", "params": {"optimizer.lr": 1e-3}, "values": None, "user_attrs": {}}
    kept = KeptStudy(tmp_path, "study-x", {"direction": "minimize"},
                     _saved={"trials": [{**running, "number": 0}, {**running, "number": 1}]})
    rows = [line.split("│")[1:3] for line in plain_text(kept.table({0: "interrupted", 1: "not run"})).splitlines()
            if line.startswith("│")]
    assert [[cell.strip() for cell in row] for row in rows] == [["0", "interrupted"], ["1", "not run"]]
