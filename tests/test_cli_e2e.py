"""`python -m orchestrator` as a user runs it: real processes, the real MLflow store, a SIGKILL mid-training."""
from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import mlflow
import psutil
import pytest

from tests.conftest import QUICK, ForkedCommand, run_cli, run_folder, signal_cli

pytestmark = pytest.mark.e2e
STAGES = ["tokenize", "export", "transform", "train", "checkpoint", "aggregate"]


def mlflow_runs(workdir: Path):
    client = mlflow.MlflowClient(f"sqlite:///{workdir}/runs/mlflow.db")
    exp = client.get_experiment_by_name("orchestrator")
    return client, client.search_runs([exp.experiment_id], order_by=["attribute.start_time ASC"])


def children(runs, parent_id):
    return {r.info.run_name: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent_id}


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("default")
    result = run_cli(QUICK, workdir)
    assert result.returncode == 0, result.stdout + result.stderr
    return workdir, result


def test_default_experiment_prints_plan_and_stage_table(default_run):
    _, result = default_run
    out = result.stdout
    assert "plan" in out and "stages (" in out
    assert re.search(r"\[train\] data: 12 steps of 8 rows = 0\.\d\d epochs of the training split's [\d,]+ windows "
                     r"of 64 tokens \(\d+\.\d\d% of them, none twice\)", out), out
    for stage in STAGES:
        assert stage in out
    assert out.count(" ran ") >= 5 and "eval" in out


def test_mlflow_holds_one_parent_with_five_stage_runs(default_run):
    workdir, _ = default_run
    client, runs = mlflow_runs(workdir)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    parent = parents[0]
    assert parent.data.params["model.n_layers"] == "8" and parent.data.params["train.steps"] == "12"
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} == {"config.yaml", "plan.json", "plan.txt"}
    kids = children(runs, parent.info.run_id)
    assert sorted(kids) == sorted(STAGES)
    assert all(k.info.status == "FINISHED" and k.data.tags["orchestrator.status"] == "ran" for k in kids.values())
    train = kids["train"]
    for metric in ("loss", "lr", "tokens_per_s", "step_time_s", "grad_norm", "input_density", "label_density",
                   "memory/rss_post_backward_mb"):
        history = client.get_metric_history(train.info.run_id, metric)
        assert [m.step for m in history] == list(range(1, 13)), metric
    assert [m.step for m in client.get_metric_history(train.info.run_id, "eval_loss")] == [6, 12]
    assert train.data.params["optimizer.lr"] == "0.001"
    assert {"loss_curve.png", "metrics.jsonl", "summary.json"} <= {a.path for a in client.list_artifacts(train.info.run_id)}
    assert "model.onnx" in {a.path for a in client.list_artifacts(kids["export"].info.run_id)}
    assert "manifest.json" in {a.path for a in client.list_artifacts(kids["checkpoint"].info.run_id)}
    assert kids["aggregate"].data.metrics["eval_loss"] == pytest.approx(train.data.metrics["final_eval_loss"], rel=1e-6)


def test_rerun_reports_everything_cached(default_run):
    """Nothing to run: the command returns without importing MLflow, and a detached process records the run (the
    parent with one cached child per stage, pointing at the runs that computed them) a moment later."""
    workdir, _ = default_run
    result = run_cli(QUICK, workdir)
    assert result.returncode == 0, result.stderr
    assert "every stage is cached" in result.stdout  # nothing ran again (its time is a benchmark's to say, not this)
    assert result.stdout.count(" cached ") >= 5
    recorder = int(re.search(r"recorded by pid (\d+) in the background", result.stdout).group(1))
    _wait_for(lambda: not psutil.pid_exists(recorder), 120, "the recording process")
    assert not (run_folder(result) / "mlflow_pending.json").exists()
    parent_id = json.loads((run_folder(result) / "mlflow_recorded.json").read_text())["parent_run_id"]
    client, runs = mlflow_runs(workdir)
    parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["orchestrator.status"] == "ok"
    assert parent.data.params["train.steps"] == "12" and "wall_s" in parent.data.metrics
    assert {a.path for a in client.list_artifacts(parent_id)} == {"config.yaml", "plan.json", "plan.txt"}
    kids = children(runs, parent_id)
    assert sorted(kids) == sorted(STAGES)
    assert {k.data.tags["orchestrator.status"] for k in kids.values()} == {"cached"}
    assert all(k.data.tags["orchestrator.source_run_id"] for k in kids.values())


def test_train_epochs_counts_the_steps_from_the_tokenized_split(default_run):
    """train.epochs: with the corpus tokenized (the default run's), the steps are counted from its windows before the
    run is planned; epochs that come to the default run's 12 steps are that run, every stage cached. Where the
    corpus is not tokenized yet, a dry run says the steps are not counted."""
    import math

    from plugins.data.shards import INDEX

    workdir, _ = default_run
    (index,) = (workdir / "runs" / "cache" / "tokenize").glob(f"*/tokens/{INDEX}")
    windows = (json.loads(index.read_text())["train"]["tokens"] - 1) // 64
    epochs = (12 * 8 - 0.5) / windows  # ceil(epochs x windows / 8) = 12
    quick = [a for a in QUICK if not a.startswith("train.steps=")]
    result = run_cli([*quick, f"train.epochs={epochs!r}"], workdir)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"train.epochs={epochs:g}: 12 steps of 8 examples = {96 / windows:,.2f} epochs of the training split's " \
           f"{windows:,} examples (train.steps=12)" in result.stdout, result.stdout
    assert "every stage is cached" in result.stdout and math.ceil(epochs * windows / 8) == 12
    fresh = run_cli([*quick, "train.epochs=2", "data=synthetic", "dry_run=true"], workdir)
    assert fresh.returncode == 0 and "train.epochs=2: the steps are counted once the corpus is tokenized" in \
        fresh.stdout, fresh.stdout[-3000:]
    refused = run_cli([*QUICK, "train.epochs=2", "dry_run=true"], workdir)  # train.steps=12 would do nothing
    assert refused.returncode == 2 and "train.steps is read only when train.epochs=0" in refused.stderr


def test_dry_run_prints_plan_and_commands(default_run):
    workdir, _ = default_run
    result = run_cli([*QUICK, "optimizer.lr=3e-4", "dry_run=true"], workdir)
    assert result.returncode == 0, result.stderr
    assert "dry run: nothing was started" in result.stdout
    assert "train: " in result.stdout and "orchestrator.worker" in result.stdout
    assert "export: " not in result.stdout  # cached: nothing to run
    # the cached tokenize's counts: the steps in epochs of its windows
    assert "data: 12 steps of 8 rows = 0." in result.stdout and " windows of 64 tokens" in result.stdout


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_sigkill_during_training_resumes_with_the_same_loss_curve(tmp_path):
    # rank 0 prints nothing (log_every=0): nothing but the fork server's end may stop it (its closed output won't)
    args = ["train.steps=60", "train.checkpoint_every=10", "train.eval_every=20", "train.log_every=0",
            "train.progress=false", "train.batch_size=8", "train.seq_len=64", "tracking=mlflow"]
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    reference.mkdir()
    killed.mkdir()
    assert run_cli(args, reference).returncode == 0

    proc = ForkedCommand(args, killed, merged=True)
    try:
        checkpoints = killed / "runs" / "cache" / "train"
        _wait_for(lambda: any(checkpoints.glob("*.work/scratch/checkpoints/step_0000020/manifest.json")), 300,
                  "the checkpoint of step 20")
        ranks = psutil.Process(proc.pid).children(recursive=True)
        assert any(p.name() == "train.rank0" for p in ranks), "the train stage runs in a process of its own"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)  # and its process group: the fork server ends with it
        gone, alive = psutil.wait_procs(ranks, timeout=15)
        assert not alive, f"orphaned stage processes: {alive}"  # they die with the orchestrator
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not any(checkpoints.glob("*/summary.json")), "killed before training finished"

    result = run_cli(args, killed)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "resumes from step" in result.stdout
    ref = _metrics(reference)
    got = _metrics(killed)
    assert got["resumed_from_step"] >= 20
    assert [r["step"] for r in got["rows"]] == [r["step"] for r in ref["rows"]] == list(range(1, 61))
    for a, b in zip(got["rows"], ref["rows"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=0), a["step"]
        if "eval_loss" in b:
            assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=1e-6, abs=0)
    # the killed invocation's runs do not stay RUNNING forever
    _, runs = mlflow_runs(killed)
    assert [r.info.run_name for r in runs if r.info.status == "RUNNING"] == []
    assert any(r.info.status == "KILLED" and r.info.run_name == "train" for r in runs)


def _metrics(workdir: Path) -> dict:
    train = next(p for p in (workdir / "runs" / "cache" / "train").iterdir() if (p / "summary.json").exists())
    rows = [json.loads(line) for line in (train / "metrics.jsonl").read_text().splitlines()]
    return {"rows": rows, **json.loads((train / "summary.json").read_text())}


# What a stop must fit in: SLURM sends SIGKILL KillWait (30 s by default) after SIGTERM, Kubernetes
# terminationGracePeriodSeconds (30 s) after it. How soon a signal is acted on is checked by the steps, not
# by the clock: the checkpoint is within a few steps of the signal, and an evaluation stops within a batch.
SIGNAL_BOUND_S = 30


@pytest.mark.parametrize("sig,code,during,where", [(signal.SIGINT, 130, "training", "parallel=ddp2"),
                                                   (signal.SIGTERM, 143, "evaluation", "parallel=ddp2"),
                                                   (signal.SIGTERM, 143, "training", "cluster=debug")],
                         ids=["ctrl-c", "sigterm", "sigterm-in-process"])
def test_a_stop_signal_saves_a_checkpoint_and_the_same_command_continues(tmp_path, sig, code, during, where):
    """SIGINT to the orchestrator's process group, as a terminal's Ctrl-C sends it, during training steps, or SIGTERM,
    as `timeout`, SLURM, Kubernetes and `kill -- -PGID` send it, during a long evaluation (at step 10, after the
    5 steps awaited): one path for both, acted on within seconds (SLURM's and Kubernetes' grace is 30 s); and
    SIGTERM with the stages in the orchestrator's own process (cluster=debug), which saves as the ranks do. That the
    same command then continues, to the loss of a run never stopped, test_sweep_and_slurm_config's signal test checks
    on that path (a point stopped by SIGTERM, continued)."""
    # the evaluation's run writes its checkpoints in the background (train.async_checkpoint=async): step 5's is
    # finished, and the stop's written, before it exits
    steps = (["train.steps=80", "train.eval_every=0", "train.checkpoint_every=0"] if during == "training" else
             ["train.steps=20", "train.eval_every=10", "train.eval_batches=6000", "train.checkpoint_every=5",
              "train.async_checkpoint=async"])
    args = [where, *steps, "train.batch_size=8", "train.seq_len=64", "train.log_every=5", "tracking=mlflow"]
    history = tmp_path / "runs" / "cache" / "train"
    logged = [0]  # steps in metrics.jsonl when the signal went

    def ready(lines: list[str]) -> bool:
        if during == "training":
            logged[0] = max((len(p.read_text().splitlines()) for p in history.glob("*.work/scratch/metrics.jsonl")),
                            default=0)
            return logged[0] >= 10
        if any(re.search(r"step\s+5/20", line) for line in lines):  # steps 6-10 take about a second (3 s and more
            time.sleep(10)                                           # beside the other worker's 8 ranks), the
            return True                                              # evaluation of 6,000 batches most of a minute
        return False

    returncode, out, took = signal_cli(args, tmp_path, ready, sig)
    assert returncode == code, out[-3000:]
    assert "interrupted: nothing is lost; run the same command to continue" in out
    assert "Traceback" not in out, out[-6000:]
    checkpoints = sorted(history.glob("*.work/scratch/checkpoints/step_*/manifest.json"))
    assert len(checkpoints) == (1 if during == "training" else 2)  # evaluation: step 5's and the stop's
    step = json.loads(checkpoints[-1].read_text())["step"]
    if during == "training":  # rows are written every log_every=5 steps: the steps unwritten, the one in flight
        assert logged[0] <= step <= logged[0] + 2 * 5, (logged[0], step)
    else:  # stopped inside the evaluation at step 10: its loss never came
        assert step == 10
        (metrics,) = history.glob("*.work/scratch/metrics.jsonl")
        assert "eval_loss" not in json.loads(metrics.read_text().splitlines()[9])
    assert took < SIGNAL_BOUND_S, f"the run took {took:.1f} s to stop after {sig.name}"
    assert f"resumes from step {step}" in out
    _, runs = mlflow_runs(tmp_path)
    status = {r.info.run_name: r.info.status for r in runs if r.data.tags.get("orchestrator.stage")}
    assert status["train"] == "KILLED" and all(r.info.status != "RUNNING" for r in runs)


def test_a_frozen_rank_is_named_within_the_heartbeat_timeout(tmp_path):
    """kill -STOP one rank of two: the other waits in a collective (still beating); the stopped one is named."""
    args = ["parallel=ddp2", "train.steps=400", "train.batch_size=8", "train.seq_len=64", "train.log_every=5",
            "train.checkpoint_every=0", "cluster.heartbeat_timeout_s=10", "tracking=mlflow"]
    proc = ForkedCommand(args, tmp_path, merged=True)
    try:
        history = tmp_path / "runs" / "cache" / "train"
        _wait_for(lambda: any(len(p.read_text().splitlines()) >= 5 for p in history.glob("*.work/scratch/metrics.jsonl")),
                  300, "5 training steps")
        rank1 = next(c for c in psutil.Process(proc.pid).children(recursive=True) if c.name() == "train.rank1")
        t0 = time.monotonic()
        rank1.suspend()
        out, _ = proc.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, out[-3000:]
    assert "rank 1 of 2: stopped responding: no heartbeat for" in out and "process state: stopped" in out
    assert took < 60, took  # far below cluster.pg_timeout_s (300 s)
    assert not psutil.pid_exists(rank1.pid) or psutil.Process(rank1.pid).status() == psutil.STATUS_ZOMBIE
    _, runs = mlflow_runs(tmp_path)
    assert all(r.info.status != "RUNNING" for r in runs)


def test_two_identical_commands_at_once_on_a_fresh_store_both_succeed(tmp_path):
    """The store is created under a file lock (MLflow's migration races otherwise); the second invocation says
    whom it waits for, then takes the first one's results from the cache."""
    args = [*QUICK, "tracking=mlflow"]
    procs = [ForkedCommand(args, tmp_path, merged=True) for _ in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert not any("alembic" in o or "Traceback" in o for o in outs)
    assert any("waiting for another run of" in o and "to finish: its result will be used" in o for o in outs)
    assert all(re.search(r"waiting for another run of \w+ \(pid \d+ on \S+, since \d\d:\d\d:\d\d\)", line)
               for o in outs for line in o.splitlines() if "waiting for another run of" in line), outs  # never "?"
    _, runs = mlflow_runs(tmp_path)
    assert len([r for r in runs if r.data.tags.get("orchestrator.kind") == "invocation"]) == 2


def test_forked_and_executed_ranks_train_alike(tmp_path):
    """cluster.start_method: ranks forked from the preloaded server (the default) and ranks started as fresh
    `python -m orchestrator.worker` processes give the same losses; the plan's command is the same either way.
    One store: the second run's train key differs by train.checkpoint_every (the losses do not), so it trains
    again on the first run's tokens, export and plan."""
    args = [*QUICK, "parallel=ddp2", "train.steps=4", "tracking=none"]
    losses = {}
    for method, every in (("forkserver", 0), ("exec", 2)):
        result = run_cli([*args, f"cluster.start_method={method}", f"train.checkpoint_every={every}"], tmp_path)
        assert result.returncode == 0, result.stdout + result.stderr
        run_dir = run_folder(result)
        rows = (run_dir / "stages/train/output/metrics.jsonl").read_text().splitlines()
        losses[method] = [json.loads(row)["loss"] for row in rows]
        plan = json.loads((run_dir / "plan.json").read_text())
        train = next(s for s in plan if s["stage"] == "train")
        assert train["command"].endswith(f"-m orchestrator.worker {run_dir}/stages/train/spec.json")
        assert not train["cached"]
    assert len(losses["exec"]) == 4 and losses["forkserver"] == losses["exec"]
