"""An experiment of phases (orchestrator/phases.py, orchestrator/experiment.py; conf/experiment/sft_dpo.yaml) through
the real command: a sweep over the DPO phase's beta runs the SFT phase and the reference stage once, MLflow holds a
run per experiment with a child per phase, and a kill during the DPO phase leaves a state the same command continues
(SFT a cache hit, DPO resumed from its checkpoint). The recipe as pasted: test_readme_examples.py; SLURM's chain of
phases: test_slurm.py; refusals: the catalogue (tests/refusal_catalogue.py)."""
from __future__ import annotations

import re
import signal
import subprocess
import sys

import mlflow
import pytest

from tests.conftest import ROOT, run_cli, signal_cli

pytestmark = pytest.mark.e2e
FEW = ["train.batch_size=4", "train.seq_len=32", "train.eval_every=0", "train.checkpoint_every=0", "~phases.score"]


def make_recipe_files(folder):
    """The recipe's files (docs/preference.md): a tiny Llama folder, its chats and pairs."""
    made = subprocess.run([sys.executable, str(ROOT / "scripts" / "tiny_chat_model.py"), "tiny-llama", "--chats",
                           "chats.jsonl", "--pairs", "pairs.jsonl"], cwd=folder, capture_output=True, text=True,
                          timeout=300)
    assert made.returncode == 0, made.stderr[-2000:]
    return folder


@pytest.fixture
def recipe_files(workdir):
    return make_recipe_files(workdir)


def _statuses(out: str, stage: str) -> list[str]:
    return re.findall(rf"│ {re.escape(stage)}\s+│ (\w+)", out)


def test_a_sweep_over_the_dpo_phase_runs_sft_and_its_reference_once(recipe_files):
    workdir = recipe_files
    refused = run_cli(["experiment=sft_dpo", "phases.dpo.objective.beta=-1"], workdir)  # phase 2: before phase 1
    assert refused.returncode == 2 and "x phases.dpo.objective.beta=-1" in refused.stderr, refused.stderr[-3000:]
    assert "in phase dpo: " in refused.stderr and not (workdir / "runs").exists()
    args = ["-m", "experiment=sft_dpo", "phases.dpo.objective.beta=0.1,0.5", "phases.sft.train.steps=2",
            "phases.dpo.train.steps=2", *FEW, "cluster=debug", "tracking=mlflow"]
    swept = run_cli(args, workdir, timeout=900)
    out = swept.stdout
    assert swept.returncode == 0, out[-4000:] + swept.stderr[-3000:]
    assert _statuses(out, "sft/train") == ["ran", "cached"] and _statuses(out, "dpo/reference") == ["ran", "cached"]
    assert _statuses(out, "dpo/train") == ["ran", "ran"]
    client = mlflow.MlflowClient(f"sqlite:///{workdir}/runs/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("orchestrator").experiment_id])
    kind = {r.info.run_id: r.data.tags.get("orchestrator.kind") for r in runs}
    parent = {r.info.run_id: r.data.tags.get("mlflow.parentRunId") for r in runs}
    experiments = [r for r in runs if kind[r.info.run_id] == "experiment"]
    assert len(experiments) == 2 and all(kind[parent[r.info.run_id]] == "sweep" for r in experiments)
    for e in experiments:
        phases = {r.data.tags["orchestrator.phase"]: r for r in runs if parent[r.info.run_id] == e.info.run_id}
        assert set(phases) == {"sft", "dpo"} and e.info.status == "FINISHED"
        assert phases["dpo"].data.tags["orchestrator.started_from"] == f"phase sft (run {phases['sft'].info.run_id})"
        dpo = phases["dpo"].info.run_id
        stages = {r.data.tags.get("orchestrator.stage") for r in runs if parent[r.info.run_id] == dpo}
        assert {"reference", "train", "aggregate"} <= stages


def test_a_kill_during_the_dpo_phase_then_the_same_command_continues_it(recipe_files):
    workdir = recipe_files
    # the SFT phase counts its steps from train.epochs as it is planned: the DPO phase starts from the aggregate of
    # that count (orchestrator/phases.py retarget), on the first run and on the second
    args = ["experiment=sft_dpo", "~phases.sft.train.steps", "++phases.sft.train.epochs=0.02",
            "phases.dpo.train.steps=60", *FEW, "tracking=none", "train.log_every=2"]
    history = workdir / "runs" / "cache" / "train"

    def dpo_stepping(lines: list[str]) -> bool:  # more steps logged than the SFT phase has (4): DPO's are
        return any(len(p.read_text().splitlines()) >= 8 for p in history.glob("*.work/scratch/metrics.jsonl"))

    code, out, _ = signal_cli(args, workdir, dpo_stepping, signal.SIGINT)
    assert code == 130, out[-4000:]
    assert "interrupted: nothing is lost; run the same command to continue" in out
    assert _statuses(out, "sft/train") == ["ran"] and _statuses(out, "dpo/train") == ["interrupted"]
    again = run_cli(args, workdir, timeout=900)
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-3000:]
    assert _statuses(again.stdout, "sft/train") == ["cached"] and _statuses(again.stdout, "dpo/train") == ["ran"]
    assert re.search(r"dpo/train.*resumes from step \d+|resumes from step \d+", again.stdout), again.stdout[-4000:]
