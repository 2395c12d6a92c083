"""The evaluate stage: the aggregate's hf/ folder scored by lm-evaluation-harness, cached, in MLflow, and the same
scores as lm-eval's own command line on the same folder."""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys

import mlflow
import pytest

from plugins.evaluate.harness import SHIPPED
from tests.conftest import cli_env, run_cli, run_folder

pytestmark = pytest.mark.e2e

RUN = ["train.steps=4", "train.batch_size=4", "train.seq_len=32", "train.progress=false", "evaluate.tasks=[arith_mc]",
       "evaluate.limit=40"]


def test_a_run_scores_its_model_as_lm_eval_does_and_a_rerun_is_cached(tmp_path):
    first = run_cli(RUN, tmp_path)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    out = run_folder(first) / "stages" / "evaluate" / "output"
    results, metrics = (json.loads((out / f).read_text()) for f in ("results.json", "metrics.json"))
    assert set(metrics["metrics"]) >= {"arith_mc/acc", "arith_mc/acc_stderr", "arith_mc/acc_norm"}
    assert results["results"]["arith_mc"]["sample_len"] == 40
    manifest = run_folder(first) / "stages" / "aggregate" / "output" / "manifest.json"
    assert metrics["scored"] == hashlib.sha256(manifest.read_bytes()).hexdigest()  # the weights it scored

    store = next((tmp_path / "runs").glob("mlflow.db"))  # the stage's run holds the metrics, the tag, the results
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{store}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                "tags.`orchestrator.stage` = 'evaluate'")
    assert run.data.metrics["arith_mc/acc"] == metrics["metrics"]["arith_mc/acc"]
    assert run.data.tags["evaluate.scored"] == metrics["scored"]

    again = run_cli(RUN, tmp_path)
    assert again.returncode == 0 and "│ evaluate   │ cached" in again.stdout, again.stdout[-3000:]

    # lm-eval's own command line on the same folder, the shipped task from its folder (its data files are relative)
    hf = run_folder(first) / "stages" / "aggregate" / "output" / "hf"
    by_hand = subprocess.run([shutil.which("lm_eval") or sys.executable, "--model", "hf", "--model_args",
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
