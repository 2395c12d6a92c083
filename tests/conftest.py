"""Shared helpers: compose configs like the CLI does, and run the CLI in a scratch working directory."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from orchestrator.schema import register

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

# small but real: the default experiment with fewer steps (tests check behaviour, not model quality)
QUICK = ["train.steps=12", "train.eval_every=6", "train.checkpoint_every=6", "train.log_every=6",
         "train.batch_size=8", "train.seq_len=64"]

torch.set_num_threads(1)


def make_cfg(*overrides: str, runs_dir: Path | None = None):
    """The composed config for these overrides, as `python -m orchestrator` would see it."""
    register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3", job_name="orchestrator"):
        extra = [f"runs_dir={runs_dir}"] if runs_dir is not None else []
        return compose(config_name="config", overrides=[*overrides, *extra], return_hydra_config=False)


def run_cli(args: list[str], cwd: Path, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m orchestrator args...` in cwd; the run's files land in cwd/runs."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200", **(env or {})}
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    d = tmp_path / "work"
    d.mkdir()
    return d
