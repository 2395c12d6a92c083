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
from typing import TYPE_CHECKING, Callable, Optional

from omegaconf import DictConfig

from common.problem import Problem
from orchestrator.cache.store import Cache
from orchestrator.config.errors import ConfigError
from orchestrator.dag import PlannedStage, plan as make_plan
from plugins.data.corpus import TOKENS_DIR
from stages import all_stages

if TYPE_CHECKING:
    from orchestrator.report import Report


def wanted(cfg: DictConfig) -> bool:
    return bool(cfg.train.get("epochs", 0))


def count(cfg: DictConfig, run_dir: Path, overrides: list[str], until: Optional[str], plan: list[PlannedStage],
          cache: Cache, tokenize_first: Optional[Callable[[DictConfig, Path, list[str]], "Report"]]
          ) -> tuple[list[str], Optional["Report"]]:
    """train.epochs counted into train.steps before the run (plan: its stages, planned with the steps not counted),
    the tokenize stage run first (tokenize_first) where it is not cached; the caller then checks and plans the
    counted steps (wanted(cfg) is false once they are counted). -> (the plan's line on epochs, the tokenize run's
    Report where it failed)."""
    tokenize = next(ps for ps in plan if ps.name == "tokenize")
    if not tokenize.cached:
        if cfg.dry_run or cfg.data.preview or tokenize_first is None:
            return [not_counted(cfg)], None
        if not cfg.cluster.get("wait", True):  # the rest would be submitted with steps that nothing counted
            raise ConfigError([needs_wait(cfg)])
        tokenized = tokenize_first(cfg, run_dir, overrides)
        if tokenized.exit_code:
            return [], tokenized
        tokenize = next(ps for ps in make_plan(cfg, all_stages(until), cache) if ps.name == "tokenize")
    return [resolve(cfg, cache.entry("tokenize", tokenize.key) / TOKENS_DIR)], None


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
