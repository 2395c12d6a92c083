"""plan.trace's rules: what the trace cannot run as the run would, refused before anything is traced."""
from __future__ import annotations

from common.problem import Problem


def check(cfg) -> list[Problem]:
    if cfg.plan.trace and cfg.engine.name != "torch":
        return [Problem("plan.trace", True, f"the trace runs the layout's step on fake tensors, which engine="
                        f"{cfg.engine.name}'s graphs do not take (it would trace a step that is not the run's)",
                        "plan.trace=false, or engine=torch to trace the layout")]
    return []
