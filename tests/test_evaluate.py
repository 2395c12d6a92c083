"""The evaluate stage: the aggregate's hf/ folder scored by lm-evaluation-harness, cached, in MLflow, and the same
scores as lm-eval's own command line on the same folder."""
from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest

from plugins.evaluate.harness import SHIPPED
from tests.conftest import cli_env, run_cli

pytestmark = pytest.mark.e2e

RUN = ["train.batch_size=4", "train.seq_len=32", "train.progress=false", "evaluate.tasks=[arith_mc]",
       "evaluate.limit=40", "sweep.objective=arith_mc/acc"]


def test_a_sweep_scores_its_points_as_lm_eval_does_ranks_them_by_a_score_and_a_rerun_is_cached(tmp_path):
    """Two points (4 and 5 steps) each scored on arith_mc, the sweep ranked by its accuracy (higher is better, as
    the task says); the same command again reuses everything; lm-eval's own CLI on a point's folder agrees."""
    sweep = run_cli(["-m", "train.steps=4,5", *RUN], tmp_path)
    assert sweep.returncode == 0, sweep.stdout[-3000:] + sweep.stderr[-3000:]
    folder = Path(re.search(r"^sweep in (\S+)$", sweep.stdout, re.M).group(1))
    ranked = json.loads((folder / "sweep_summary.json").read_text())
    assert ranked["objective"] == "arith_mc/acc" and ranked["direction"] == "maximize"
    scores = []
    for point in ranked["points"]:
        out = Path(point["run_dir"]) / "stages" / "evaluate" / "output"
        metrics = json.loads((out / "metrics.json").read_text())
        assert set(metrics["metrics"]) >= {"arith_mc/acc", "arith_mc/acc_stderr", "arith_mc/acc_norm"}
        assert point["objective"] == metrics["metrics"]["arith_mc/acc"]
        manifest = Path(point["run_dir"]) / "stages" / "aggregate" / "output" / "manifest.json"
        assert metrics["scored"] == hashlib.sha256(manifest.read_bytes()).hexdigest()  # the weights it scored
        scores.append(metrics)
    assert [p["objective"] for p in ranked["points"]] == sorted((p["objective"] for p in ranked["points"]),
                                                                reverse=True)
    assert scores[0]["scored"] != scores[1]["scored"]  # other weights, another key
    run_dir = Path(ranked["points"][0]["run_dir"])
    results = json.loads((run_dir / "stages" / "evaluate" / "output" / "results.json").read_text())
    assert results["results"]["arith_mc"]["sample_len"] == 40

    store = next((tmp_path / "runs").glob("mlflow.db"))  # the stage's run holds the metrics, the tag, the results
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{store}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              "tags.`orchestrator.stage` = 'evaluate'")
    by_weights = {r.data.tags["evaluate.scored"]: r.data.metrics["arith_mc/acc"] for r in runs}
    assert by_weights == {m["scored"]: m["metrics"]["arith_mc/acc"] for m in scores}

    again = run_cli(["-m", "train.steps=4,5", *RUN], tmp_path)
    assert again.returncode == 0 and again.stdout.count("│ evaluate   │ cached") == 2, again.stdout[-3000:]

    # lm-eval's own command line (`lm_eval` is its script) on the same folder, the shipped task from its folder (its data files are relative)
    hf = run_dir / "stages" / "aggregate" / "output" / "hf"
    by_hand = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
                              f"pretrained={hf},dtype=float32", "--tasks", "arith_mc", "--include_path", str(SHIPPED),
                              "--batch_size", "8", "--device", "cpu", "--limit", "40", "--seed", "1234",
                              "--output_path", str(tmp_path / "by_hand")], cwd=SHIPPED, capture_output=True,
                             text=True, timeout=600, env=cli_env())
    assert by_hand.returncode == 0, by_hand.stdout[-2000:] + by_hand.stderr[-3000:]
    (written,) = (tmp_path / "by_hand").rglob("results_*.json")
    theirs = json.loads(written.read_text())["results"]["arith_mc"]
    assert theirs["acc,none"] == results["results"]["arith_mc"]["acc,none"]
    assert theirs["acc_norm,none"] == results["results"]["arith_mc"]["acc_norm,none"]


def test_a_task_of_lm_evals_own_without_the_hub_is_refused_before_launch(tmp_path):
    refused = run_cli(["evaluate.tasks=[hellaswag]", "dry_run=true"], tmp_path, env={"HF_HUB_OFFLINE": "1"})
    assert refused.returncode == 2 and "cannot be reached" in refused.stderr and "evaluate.include_path" in \
        refused.stderr, refused.stderr
    assert not (tmp_path / "runs").exists()
