"""Hyperparameter search with Hydra's Optuna sweeper: every trial returns its objective (sweep.objective), the
study is one sweep (one table, one summary, one MLflow sweep run), a failed trial scores the worst value."""
from __future__ import annotations

import json
import math
from pathlib import Path

import mlflow
import pytest
import yaml

from tests.conftest import run_cli

pytestmark = pytest.mark.e2e
SMALL = ["cluster=debug", "train.steps=4", "train.eval_every=4", "model.n_layers=1", "train.batch_size=4",
         "train.seq_len=32"]


def study(workdir: Path, *args: str):
    result = run_cli(["-m", "hydra/sweeper=optuna", *SMALL, *args], workdir, timeout=900)
    sweep_dir = next((workdir / "runs" / "multirun").rglob("sweep_summary.json")).parent
    return result, json.loads((sweep_dir / "sweep_summary.json").read_text()), sweep_dir


def train_summary(row: dict) -> dict:
    return json.loads((Path(row["run_dir"]) / "stages" / "train" / "output" / "summary.json").read_text())


def sweep_runs(workdir: Path):
    client = mlflow.MlflowClient(f"sqlite:///{workdir}/runs/mlflow.db")
    exp = client.get_experiment_by_name("orchestrator")
    sweeps = client.search_runs([exp.experiment_id], "tags.`orchestrator.kind` = 'sweep'")
    points = {s.info.run_id: client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{s.info.run_id}'")
              for s in sweeps}
    return sweeps, points


def test_optuna_minimises_the_trials_eval_loss_in_one_sweep(workdir):
    result, summary, sweep_dir = study(workdir, "hydra.sweeper.sampler.seed=7", "optimizer.lr=interval(1e-4,3e-2)",
                                       "hydra.sweeper.n_trials=4",
                                       "hydra.sweeper.n_jobs=2")  # two batches of two trials: one study
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = summary["points"]
    assert len(rows) == 4 and summary["objective"] == "eval_loss" and summary["direction"] == "minimize"
    for row in rows:  # what the sweeper got is each point's own eval loss
        assert row["status"] == "ok" and row["objective"] == train_summary(row)["final_eval_loss"]
    assert [r["objective"] for r in rows] == sorted(r["objective"] for r in rows)
    assert len({r["objective"] for r in rows}) == 4  # four learning rates, four losses: not a constant

    optuna = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    assert optuna["best_value"] == pytest.approx(rows[0]["objective"], rel=1e-12) == summary["best"]["objective"]
    assert f"optimizer.lr={optuna['best_params']['optimizer.lr']}" in rows[0]["all_overrides"]
    assert result.stdout.count("sweep: ") == 1 and "sweep: 4 point(s)" in result.stdout
    assert "best eval_loss first" in result.stdout

    (sweep,), points = sweep_runs(workdir)
    assert sweep.info.status == "FINISHED" and len(points[sweep.info.run_id]) == 4
    assert sweep.data.metrics["best_eval_loss"] == pytest.approx(rows[0]["objective"])


def test_a_failed_trial_scores_the_worst_value_and_the_study_goes_on(workdir):
    # lr=1e6 diverges: that trial's train stage fails; the grid sampler runs both points
    result, summary, sweep_dir = study(workdir, "hydra/sweeper/sampler=grid", "optimizer.lr=choice(1e-3,1e6)")
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    ok, failed = summary["points"]  # best first: the failed trial last
    assert ok["status"] == "ok" and "optimizer.lr=0.001" in ok["all_overrides"]
    assert failed["status"] == "failed" and failed["objective"] == math.inf and "optimizer.lr=1000000.0" in \
        failed["all_overrides"]
    assert "training diverged" in result.stdout + result.stderr
    optuna = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    assert optuna["best_value"] == pytest.approx(ok["objective"], rel=1e-12)

    (sweep,), points = sweep_runs(workdir)
    assert sweep.info.status == "FAILED" and len(points[sweep.info.run_id]) == 2


def test_a_sweeper_told_to_maximise_a_loss_is_refused_before_anything_runs(workdir):
    result = run_cli(["-m", "hydra/sweeper=optuna", "hydra.sweeper.direction=maximize",
                      "optimizer.lr=interval(1e-4,3e-2)", *SMALL], workdir)
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert "hydra.sweeper.direction=maximize" in result.stderr and "goes down" in result.stderr
    assert "sweep.objective=tokens_per_s" in result.stderr
    assert not (workdir / "runs" / "cache").exists()
