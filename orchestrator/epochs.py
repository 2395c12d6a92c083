"""train.epochs: the steps counted from the training split's examples before the run is planned.

An epoch draws every training example once (plugins/data/epochs.py), so train.epochs=E is ceil(E x examples /
examples a batch) steps: the examples of the tokenized split, counted as the batcher draws them (its pairs, its
records, its rows of whole documents, its packed stream's windows). They are known once the corpus is tokenized: where
the tokenize stage's output is cached they are read from it; otherwise the tokenize stage runs first (on SLURM its
job, followed to its end; a dry run says that the steps are not counted yet). The count then becomes train.steps, and train.epochs 0:
the run, its cache keys, its schedule and its plan are those of that many steps, and the plan says both.
"""
from __future__ import annotations

import math
from pathlib import Path

from omegaconf import DictConfig

from common.problem import Problem


def wanted(cfg: DictConfig) -> bool:
    return bool(cfg.train.get("epochs", 0))


def resolve(cfg: DictConfig, tokens: Path) -> str:
    """Set train.steps from train.epochs and the tokenized split in `tokens` (then train.epochs=0); the plan's
    line."""
    from plugins.data import build_batcher

    batcher = build_batcher(cfg, tokens)
    epochs, n, units = float(cfg.train.epochs), batcher.examples(0, "train"), batcher.units()
    steps = max(math.ceil(epochs * n / units), 1)
    cfg.train.steps, cfg.train.epochs = steps, 0.0
    what = "pairs" if batcher.pairs else "examples"
    return (f"train.epochs={epochs:g}: {steps:,} steps of {units:,} {what} = {steps * units / n:,.2f} epochs of the "
            f"training split's {n:,} {what} (train.steps={steps})")


def not_counted(cfg: DictConfig) -> str:
    """The plan's line where the steps cannot be counted before the run (a dry run, a SLURM submission)."""
    return (f"train.epochs={float(cfg.train.epochs):g}: the steps are counted once the corpus is tokenized (the tokenize "
            f"stage is not cached): this plan's times are for train.steps={cfg.train.steps}")


def needs_wait(cfg: DictConfig) -> Problem:
    """cluster.wait=false with train.epochs and the corpus not tokenized: the jobs after tokenize would be submitted
    before anything counted their steps."""
    return Problem("train.epochs", cfg.train.epochs, "train.epochs counts the steps from the tokenized corpus, which "
                   "the tokenize job writes; with cluster.wait=false the train job would be submitted before it "
                   "ran, with no steps counted", "cluster.wait=true (the tokenize job is followed to its end, then "
                   "the rest submitted), or train.steps= the steps to train")
