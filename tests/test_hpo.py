"""Hyperparameter search with Hydra's Optuna sweeper: every trial returns its objective (sweep.objective), the
study is one sweep (one table, one summary, one MLflow sweep run) kept under runs/studies so that the same command
continues it after a signal, a failed trial scores the worst value."""
from __future__ import annotations

import json
import math
from pathlib import Path

import mlflow
import pytest
import yaml

from orchestrator.sweeps import pictures
from tests.conftest import run_cli, signal_cli

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


SEARCH = ["hydra.sweeper.sampler.seed=7", "optimizer.lr=interval(1e-4,3e-2)", "hydra.sweeper.n_trials=4",
          "hydra.sweeper.n_jobs=2"]  # two batches of two trials: one study


def kept_trials(workdir: Path) -> list[dict]:
    (study_file,) = (workdir / "runs" / "studies").glob("*.json")
    return json.loads(study_file.read_text())["trials"]


def test_optuna_minimises_the_trials_eval_loss_and_the_same_command_continues_its_study(workdir, tmp_path):
    result, summary, sweep_dir = study(workdir, *SEARCH)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "new, 4 trial(s) (hydra.sweeper.n_trials)" in result.stdout
    assert "] A new study created" in result.stderr and "\x1b" not in result.stdout + result.stderr  # plain
    rows = summary["points"]
    assert len(rows) == 4 and summary["objective"] == "eval_loss" and summary["direction"] == "minimize"
    for row in rows:  # what the sweeper got is each point's own eval loss
        assert row["status"] == "ok" and row["objective"] == train_summary(row)["final_eval_loss"]
    assert [r["objective"] for r in rows] == sorted(r["objective"] for r in rows)
    assert len({r["objective"] for r in rows}) == 4  # four learning rates, four losses: not a constant

    optuna = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    assert optuna["best_value"] == pytest.approx(rows[0]["objective"], rel=1e-12) == summary["best"]["objective"]
    assert f"optimizer.lr={optuna['best_params']['optimizer.lr']}" in rows[0]["all_overrides"]
    assert result.stdout.count("sweep: ") == 2 and "sweep: 4 point(s)" in result.stdout  # the plan, the table
    assert "best eval_loss first" in result.stdout

    (sweep,), points = sweep_runs(workdir)
    assert sweep.info.status == "FINISHED" and len(points[sweep.info.run_id]) == 4
    assert sweep.data.metrics["best_eval_loss"] == pytest.approx(rows[0]["objective"])
    uninterrupted = [(t["params"], t["values"]) for t in kept_trials(workdir)]
    # its pictures, on the sweep's run: Optuna's history holds the four trials' values, its importance the parameter
    drawn = [pictures.OBJECTIVE, pictures.LOSSES, pictures.HISTORY, pictures.IMPORTANCE]
    assert summary["pictures"] == drawn and all((sweep_dir / name).stat().st_size > 10_000 for name in drawn)
    client = mlflow.MlflowClient(f"sqlite:///{workdir}/runs/mlflow.db")
    assert {a.path for a in client.list_artifacts(sweep.info.run_id)} >= set(drawn)
    (study_file,) = (workdir / "runs" / "studies").glob("*.json")
    history, importance = pictures.optuna_figures(json.loads(study_file.read_text()))
    shown = sorted(y for c in history.axes[0].collections for _, y in c.get_offsets())
    assert shown == sorted(v for _, (v,) in uninterrupted)
    assert [t.get_text() for t in importance.axes[0].get_yticklabels()] == ["optimizer.lr"]

    # The same study, stopped by SIGTERM in trial 2 (the second of the first batch) and continued by the same command
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    args = ["-m", "hydra/sweeper=optuna", *SMALL, *SEARCH]
    code, out, _ = signal_cli(args, stopped, lambda lines: any(line.startswith("─") and " point 1: " in line
                                                               for line in lines))
    assert code == 143, out[-3000:]
    assert [t["state"] for t in kept_trials(stopped)] == ["COMPLETE", "RUNNING"]

    again = run_cli([*args, "train.progress=false"], stopped, timeout=900)  # an execution key: the same study
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "Using an existing study" in again.stderr and "A new study created" not in again.stderr  # one story
    assert "continued, 1 of 4 trial(s) done" in again.stdout and "1 interrupted (resumed first), 3 to run" in \
        again.stdout
    assert " point 0: " not in again.stdout and " point 1: " not in again.stdout  # trial 1 done, 2 interrupted
    trials = kept_trials(stopped)
    assert [t["state"] for t in trials] == ["COMPLETE", "FAIL", "COMPLETE", "COMPLETE", "COMPLETE"]
    assert trials[1]["user_attrs"]["interrupted"] is True and trials[2]["params"] == trials[1]["params"]
    assert [(t["params"], t["values"]) for t in trials if t["state"] == "COMPLETE"] == uninterrupted
    continued = yaml.safe_load(next((stopped / "runs" / "multirun").rglob("optimization_results.yaml")).read_text())
    assert continued["best_value"] == optuna["best_value"]


def test_an_invalid_grid_point_is_refused_before_the_first_trial_or_recorded_and_never_run_again(workdir):
    grid = ["-m", "hydra/sweeper=optuna", "hydra/sweeper/sampler=grid", "train.batch_size=choice(16,15)",
            "parallel.dp=choice(1,2)", "hydra.sweeper.n_trials=4", "dry_run=true", "tracking=none"]
    whole = run_cli(grid, workdir)  # 4 combinations: every one checked before the first trial
    assert whole.returncode == 2 and "point train.batch_size=15 parallel.dp=2" in whole.stderr, whole.stderr[-3000:]
    assert not (workdir / "runs" / "studies").exists()

    # past sweep.max_points each value is checked alone: (15, 2) is found when the grid picks it
    first = run_cli([*grid, "sweep.max_points=3"], workdir)
    assert first.returncode == 2 and "recorded in its study as a failed trial" in first.stderr, first.stderr[-3000:]
    again = run_cli([*grid, "sweep.max_points=3"], workdir)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    trials = kept_trials(workdir)
    points = [(t["params"]["train.batch_size"], t["params"]["parallel.dp"]) for t in trials]
    assert sorted(points) == [(15, 1), (15, 2), (16, 1), (16, 2)]  # each once: the invalid one not replayed
    (invalid,) = [t for t in trials if "invalid" in t["user_attrs"]]
    assert invalid["state"] == "FAIL" and "divisible by 2" in invalid["user_attrs"]["invalid"]


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
    assert "hydra.sweeper.direction=maximize" in result.stderr and result.stderr.count("goes down") == 1  # once
    assert "sweep.objective=tokens_per_s" in result.stderr
    assert not (workdir / "runs" / "cache").exists()


def test_a_study_file_that_does_not_read_is_refused_with_what_to_do(tmp_path):
    from orchestrator.config.errors import ConfigError
    from orchestrator.sweeps.study import KeptStudy

    trial = {"number": 0, "state": "COMPLETE", "params": {"x": 1}, "user_attrs": {}, "values": [1.0],
             "distributions": {"x": '{"name": "NoSuchDistribution", "attributes": {}}'}}
    broken = {"cut short": '{"name": "study-x", "trials": ', "no search entry": '{"name": "study-x", "trials": []}',
              "distribution of x cannot be read": json.dumps({"search": {}, "trials": [trial]}),
              "sampler": json.dumps({"search": {}, "trials": []})}
    for said, text in broken.items():
        kept = KeptStudy(tmp_path, "study-x", {"space": []})
        kept.path.write_text(text)
        (tmp_path / "study-x.sampler").write_bytes(b"\x80\x04\x95" if said == "sampler" else b"")
        if said != "sampler":
            (tmp_path / "study-x.sampler").unlink()
        with pytest.raises(ConfigError) as e:
            kept.saved()
        assert "x hydra.sweeper.study_dir=" in str(e.value) and "move it aside" in str(e.value)
        assert said == "cut short" or said in str(e.value), str(e.value)
