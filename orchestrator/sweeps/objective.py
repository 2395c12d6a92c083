"""A sweep point's objective: the number Hydra's sweepers optimise (`sweep.objective`) and the sweep's summary
ranks by. A point that did not train (failed, refused, interrupted) gets the worst value of its direction, which
a sweeper records and never picks (Optuna stores it as a finished trial with value inf; NaN would end its study)."""
from __future__ import annotations

import math
from typing import Optional

# objective -> (the train summary's field, the direction that improves it)
OBJECTIVES = {
    "eval_loss": ("final_eval_loss", "minimize"),
    "loss": ("final_loss", "minimize"),
    "tokens_per_s": ("tokens_per_s", "maximize"),
    "peak_memory": ("peak_memory_mb", "minimize"),
}


def direction(objective: str) -> str:
    return OBJECTIVES[objective][1]


def worst(objective: str) -> float:
    return math.inf if direction(objective) == "minimize" else -math.inf


def value(objective: str, train_summary: dict) -> float:
    """The objective from a finished train stage's summary.json (the worst value when there is none)."""
    found: Optional[float] = train_summary.get(OBJECTIVES[objective][0])
    return float(found) if found is not None and math.isfinite(float(found)) else worst(objective)


def best_first(rows: list[dict], objective: str) -> list[dict]:
    """Rows with an "objective" field, best first (failed points last, in their order)."""
    sign = 1 if direction(objective) == "minimize" else -1
    return sorted(rows, key=lambda r: sign * r["objective"])
