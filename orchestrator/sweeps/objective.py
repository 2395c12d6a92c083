"""A sweep point's objective: the number Hydra's sweepers optimise (`sweep.objective`) and the sweep's summary
ranks by. A point that did not train (failed, refused, interrupted) gets the worst value of its direction, which
a sweeper records and never picks (Optuna stores it as a finished trial with value inf; NaN would end its study).
Its rule (`check`: one the run measures) is among those validation collects (orchestrator/config/validate.py)."""
from __future__ import annotations

import math
from typing import Optional

from common.problem import Problem
from plugins.objectives.spec import sweep_objectives

# the train stage's objectives (orchestrator/config/schema.TRAIN_OBJECTIVES) -> (its summary's field, the direction
# that improves it), and those the training objectives offer (their specs'); any other is an evaluate score,
# <task>/<metric>
OBJECTIVES = {
    "eval_loss": ("final_eval_loss", "minimize"),
    "loss": ("final_loss", "minimize"),
    "tokens_per_s": ("tokens_per_s", "maximize"),
    "peak_memory": ("peak_memory_mb", "minimize"),
    **sweep_objectives(),
}


def direction(objective: str, cfg=None) -> str:
    """minimize or maximize; an evaluate score (<task>/<metric>) as its task says (cfg: the point's config)."""
    if objective in OBJECTIVES:
        return OBJECTIVES[objective][1]
    from plugins.evaluate.harness import higher_is_better

    return "maximize" if higher_is_better(objective, cfg.evaluate) else "minimize"


def worst(objective: str, cfg=None) -> float:
    return math.inf if direction(objective, cfg) == "minimize" else -math.inf


def value(objective: str, train_summary: dict, scores: Optional[dict] = None, cfg=None) -> float:
    """The objective from a finished train stage's summary.json, or from the evaluate stage's scores
    (metrics.json's `metrics`); the worst value when there is none."""
    found = train_summary.get(OBJECTIVES[objective][0]) if objective in OBJECTIVES else (scores or {}).get(objective)
    return float(found) if found is not None and math.isfinite(float(found)) else worst(objective, cfg)


def stderr(objective: str, scores: Optional[dict] = None) -> Optional[float]:
    """An evaluate score's standard error (lm-eval's `<metric>_stderr`), None for the train stage's objectives and
    where lm-eval gives none."""
    found = (scores or {}).get(f"{objective}_stderr") if objective not in OBJECTIVES else None
    return float(found) if isinstance(found, (int, float)) and math.isfinite(float(found)) else None


def best_first(rows: list[dict], objective: str, cfg=None) -> list[dict]:
    """Rows with an "objective" field, best first (failed points last, in their order)."""
    sign = 1 if direction(objective, cfg) == "minimize" else -1
    return sorted(rows, key=lambda r: sign * r["objective"])


def check(cfg) -> list[Problem]:
    """sweep.objective: one of the train stage's, or a metric an evaluate task produces."""
    from orchestrator.config.schema import TRAIN_OBJECTIVES

    from plugins.objectives import get_objective, objective_names

    offered = get_objective(cfg.objective.name).sweep_objectives
    if cfg.sweep.objective in sweep_objectives() and cfg.sweep.objective not in offered:
        by = [n for n in objective_names() if cfg.sweep.objective in get_objective(n).sweep_objectives]
        return [Problem("sweep.objective", cfg.sweep.objective, f"{cfg.sweep.objective} is measured by objective="
                        f"{' or '.join(by)}; objective={cfg.objective.name} has none",
                        f"objective={by[0]}, or sweep.objective=eval_loss")]
    if cfg.sweep.objective in TRAIN_OBJECTIVES:
        return []
    from plugins.evaluate.harness import objective_problems as evaluate_objective

    return evaluate_objective(cfg.sweep.objective, cfg.evaluate, TRAIN_OBJECTIVES)
