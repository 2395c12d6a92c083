"""triton=on: torch.compile of the blocks (C++ kernels on this CPU) with the numbers of eager mode, Inductor's
cache reused by the next run, and compile failures either named (with the compiler's message) or run eagerly."""
from __future__ import annotations

import json
from pathlib import Path

import mlflow
import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.e2e
SMALL = ["train.steps=10", "train.batch_size=8", "train.seq_len=32", "train.eval_every=0", "train.log_every=5"]


def run_dir_of(result) -> Path:
    return Path([line for line in result.stdout.splitlines() if line.startswith("outputs: ")][-1].split(" ", 1)[1])


def train_output(result) -> tuple[list[float], dict]:
    out = run_dir_of(result) / "stages" / "train" / "output"
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    return losses, json.loads((out / "summary.json").read_text())


def train_run(workdir: Path, result):
    client = mlflow.MlflowClient(f"sqlite:///{workdir}/runs/mlflow.db")
    exp = client.get_experiment_by_name("orchestrator")
    (parent,) = client.search_runs([exp.experiment_id], f"tags.`orchestrator.run_dir` = '{run_dir_of(result)}'")
    (train,) = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}' and "
                                                      "tags.`orchestrator.stage` = 'train'")
    return train


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """One folder for the runs below: the eager run serves both layouts, and Inductor's cache the rerun."""
    return tmp_path_factory.mktemp("kernels")


@pytest.fixture(scope="module")
def eager_losses(store) -> list[float]:
    """One process, uncompiled: the losses every compiled layout must give (every layout gives one process's
    losses to RTOL 1e-5: test_layouts)."""
    eager = run_cli(["tracking=none", "parallel=single", "model.n_layers=2", *SMALL], store)
    assert eager.returncode == 0, eager.stdout + eager.stderr
    return train_output(eager)[0]


# dp2 x hp2 (4 ranks): compiled blocks under FSDP2 and DTensor, where compilation meets the layouts (a pipeline stage
# compiles its blocks as one process does; one process compiles the same blocks, without the collectives between
# them, so the layout takes its path too)
def test_compiled_blocks_give_the_losses_of_eager_mode(store, eager_losses):
    args = ["parallel=dp2_hp2_pp2", "parallel.pp=1", "model.n_layers=2", *SMALL]
    compiled = run_cli(["triton=on", *args], store)
    assert compiled.returncode == 0, compiled.stdout + compiled.stderr
    compiled_losses, summary = train_output(compiled)
    assert compiled_losses == pytest.approx(eager_losses, rel=1e-5)
    blocks_per_rank = 2
    assert summary["compiled"] == {"blocks": blocks_per_rank, "eager_fallbacks": {}}
    metrics = train_run(store, compiled).data.metrics
    assert metrics["compile/blocks_compiled"] == blocks_per_rank and metrics["compile/fx_graph_cache_misses"] > 0

    # the next run (another learning rate: train runs again) loads the compiled kernels
    again = run_cli(["triton=on", "optimizer.lr=3e-4", *args], store)
    assert again.returncode == 0, again.stdout + again.stderr
    cached = train_run(store, again).data.metrics
    assert cached["compile/fx_graph_cache_misses"] == 0 and cached["compile/fx_graph_cache_hits"] > 0
    assert cached["compile/first_step_s"] < metrics["compile/first_step_s"]
    assert "Inductor cache hits" in again.stdout


BROKEN_COMPILER = {"CXX": "false"}  # a C++ compiler that fails: Inductor cannot build the CPU kernels


def test_block_that_fails_to_compile_runs_eagerly_with_fallback_and_records_why(workdir):
    result = run_cli(["triton=on", "triton.fallback=eager", "cluster=debug", "model.n_layers=1",
                      "train.steps=3", "train.batch_size=4", "train.seq_len=32"], workdir, env=BROKEN_COMPILER)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "runs uncompiled (triton.fallback=eager)" in result.stdout
    _, summary = train_output(result)
    (why,) = summary["compiled"]["eager_fallbacks"].values()
    assert "No working C++ compiler" in why
    tags = train_run(workdir, result).data.tags
    assert "No working C++ compiler" in tags["triton.eager.block_layers.0"]


def test_compile_failure_names_the_block_and_the_compilers_message(workdir):
    result = run_cli(["triton=on", "cluster=debug", "model.n_layers=1", "train.steps=3", "train.batch_size=4",
                      "train.seq_len=32", "tracking=none"], workdir, env=BROKEN_COMPILER)
    assert result.returncode == 1
    out = result.stdout + result.stderr
    assert "triton: compiling block layers.0 failed" in out and "No working C++ compiler found" in out
    assert "triton.fallback=eager" in out
