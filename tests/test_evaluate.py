"""The evaluate stage: the aggregate's hf/ folder scored by lm-evaluation-harness, cached, in MLflow, a sweep's
objective, the same scores as lm-eval's own command line on the same folder, and the ONNX model's equal."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
import yaml

from plugins.evaluate.harness import SHIPPED
from tests.conftest import ROOT, cli_env, run_cli

pytestmark = pytest.mark.e2e

# the docs' offline walk-through (a tiny Llama fine-tuned on arithmetic chats) scored on the shipped chat task in
# its own template, a generation task and the run's validation split; the ONNX model scored beside hf/
FINE_TUNE = ["data=chat", "data.paths=[chats.jsonl]", "train.init_from=hf:tiny-llama", "model=llama_tiny", "train.steps=20", "train.progress=false", "evaluate.tasks=[arith_chat,arith_gen,"
             "val_perplexity]", "evaluate.apply_chat_template=true", "evaluate.onnx=true", "evaluate.limit=20",
             "evaluate.generations=2", "sweep.objective=arith_chat/acc"]
STUDY = ["hydra/sweeper=optuna", "hydra.sweeper.n_trials=2", "hydra.sweeper.n_jobs=1",
         "hydra.sweeper.direction=maximize", "hydra.sweeper.sampler.seed=3", "optimizer.lr=interval(1e-3,3e-2)"]


def test_an_optuna_study_ranks_fine_tunes_by_their_chat_score_each_as_lm_eval_scores_it(tmp_path):
    """Two trials (two learning rates) each scored; Optuna maximises arith_chat's accuracy (the direction the task
    gives); every score names the weights it is of; the ONNX model's loglikelihoods are hf/'s; lm-eval's own CLI
    on a trial's folder gives its score; the best trial's command again reuses everything."""
    made = subprocess.run([sys.executable, str(ROOT / "scripts" / "tiny_chat_model.py"), "tiny-llama", "--chats",
                           "chats.jsonl"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-2000:]
    study = run_cli(["-m", *STUDY, *FINE_TUNE], tmp_path, timeout=900)
    assert study.returncode == 0, study.stdout[-3000:] + study.stderr[-3000:]
    (summary_file,) = (tmp_path / "runs" / "multirun").rglob("sweep_summary.json")
    ranked = json.loads(summary_file.read_text())
    assert ranked["objective"] == "arith_chat/acc" and ranked["direction"] == "maximize"
    optuna = yaml.safe_load((summary_file.parent / "optimization_results.yaml").read_text())
    assert optuna["best_value"] == pytest.approx(ranked["points"][0]["objective"], rel=1e-12)

    scores = []
    for point in ranked["points"]:
        out = Path(point["run_dir"]) / "stages" / "evaluate" / "output"
        metrics = json.loads((out / "metrics.json").read_text())
        values = metrics["metrics"]
        assert {"arith_chat/acc", "arith_chat/acc_stderr", "arith_gen/exact_match",
                "val_perplexity/bits_per_byte"} <= set(values)
        assert point["objective"] == values["arith_chat/acc"]
        assert point["objective_stderr"] == values["arith_chat/acc_stderr"] > 0  # the table says "0.41 ± 0.049"
        manifest = Path(point["run_dir"]) / "stages" / "aggregate" / "output" / "manifest.json"
        assert metrics["scored"] == hashlib.sha256(manifest.read_bytes()).hexdigest()  # the weights it scored
        assert metrics["onnx"]["arith_chat/acc"] == values["arith_chat/acc"]
        assert metrics["onnx"]["val_perplexity/bits_per_byte"] == pytest.approx(values["val_perplexity/bits_per_byte"],
                                                                                rel=1e-5)
        files = json.loads((out / "results.json").read_text())["configs"]["val_perplexity"]["dataset_kwargs"]
        assert all(Path(f).is_file() for f in files["data_files"].values()), files  # where the cache keeps it
        table = json.loads((out / "generations.json").read_text())  # the first validation chats, as trained
        assert len(table["prompt"]) == 2 and all(p.endswith("<|im_start|>assistant\n") for p in table["prompt"])
        assert all(r.strip().endswith(".") for r in table["reference"])
        scores.append(metrics)
    assert [p["objective"] for p in ranked["points"]] == sorted((p["objective"] for p in ranked["points"]),
                                                                reverse=True)
    assert scores[0]["scored"] != scores[1]["scored"]  # other weights: another key, another score
    assert scores[0]["metrics"]["val_perplexity/bits_per_byte"] != scores[1]["metrics"]["val_perplexity/bits_per_byte"]

    store = tmp_path / "runs" / "mlflow.db"  # the stage's runs: the metrics, the tag, the generations table
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{store}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              "tags.`orchestrator.stage` = 'evaluate'")
    assert {r.data.tags["evaluate.scored"]: r.data.metrics["arith_chat/acc"] for r in runs} == \
        {m["scored"]: m["metrics"]["arith_chat/acc"] for m in scores}
    assert all(r.data.metrics["onnx/arith_chat/acc"] == r.data.metrics["arith_chat/acc"] for r in runs)
    assert all({"generations.json", "results.json"} <= {a.path for a in client.list_artifacts(r.info.run_id)}
               for r in runs)

    best = Path(ranked["points"][0]["run_dir"])  # lm-eval's command line on the same folder, the task from its folder
    by_hand = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
                              f"pretrained={best / 'stages' / 'aggregate' / 'output' / 'hf'},dtype=float32",
                              "--tasks", "arith_chat", "--include_path", str(SHIPPED), "--apply_chat_template",
                              "--batch_size", "8", "--device", "cpu", "--limit", "20", "--seed", "1234",
                              "--output_path", str(tmp_path / "by_hand")], cwd=SHIPPED, capture_output=True,
                             text=True, timeout=600, env=cli_env())
    assert by_hand.returncode == 0, by_hand.stdout[-2000:] + by_hand.stderr[-3000:]
    (written,) = (tmp_path / "by_hand").rglob("results_*.json")
    theirs = json.loads(written.read_text())["results"]["arith_chat"]
    assert theirs["acc,none"] == scores[0]["metrics"]["arith_chat/acc"]
    assert theirs["acc_norm,none"] == scores[0]["metrics"]["arith_chat/acc_norm"]

    again = run_cli([*FINE_TUNE, f"optimizer.lr={optuna['best_params']['optimizer.lr']}"], tmp_path)
    assert again.returncode == 0 and "│ evaluate   │ cached" in again.stdout, again.stdout[-3000:]
    m, log = scores[0]["metrics"], (Path(ranked["points"][0]["run_dir"]) / "stages/evaluate/rank0.log").read_text()
    assert f"arith_chat/acc {m['arith_chat/acc']:.4f} ± {m['arith_chat/acc_stderr']:.4f}" in log, log  # its noise
    assert log.count("answered '") == 2 and "; the reference: '" in log, log  # evaluate.generations=2, beside theirs
    out = (Path(ranked["points"][0]["run_dir"]) / "stages/evaluate/rank0.out").read_text()
    assert "it/s]" not in out and "Running loglikelihood" not in out, out[-2000:]  # no progress-bar frames in files


def test_a_task_of_lm_evals_own_without_the_hub_is_refused_before_launch(tmp_path):
    refused = run_cli(["evaluate.tasks=[hellaswag]", "dry_run=true"], tmp_path, env={"HF_HUB_OFFLINE": "1"})
    assert refused.returncode == 2 and "cannot be reached" in refused.stderr and "evaluate.include_path" in \
        refused.stderr, refused.stderr
    assert not (tmp_path / "runs").exists()
