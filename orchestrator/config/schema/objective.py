"""What the train stage minimises: the `objective` section. Each objective declares its own config dataclass in its
file (plugins/objectives/<name>.py); its option `conf/objective/<name>.yaml` starts with `defaults:
[<name>_schema]`, registered here from the objectives' registry (a third-party objective's too)."""
from __future__ import annotations

from plugins.objectives import get_objective, objective_names
from plugins.objectives.spec import ObjectiveConfig

__all__ = ["ObjectiveConfig", "objective_schemas", "without_row_loss"]


def objective_schemas() -> dict[str, type]:
    """<name>_schema -> the objective's config dataclass, for every registered objective."""
    return {f"{name}_schema": get_objective(name).config for name in objective_names()}


def without_row_loss() -> tuple[str, ...]:
    """The objectives whose loss is the head's next-token loss (keys of that loss are read for them only)."""
    return tuple(name for name in objective_names() if get_objective(name).loss is None)
