"""Training objectives: one file each registers its spec (spec.py: what the rest of the code asks of it); pairs.py
holds what the objectives on preference pairs share, reference.py the reference model's log-probabilities as a
per-row input, rules.py the checks every objective's config goes through."""
from plugins.objectives import dpo as _dpo  # noqa: F401  (registers "dpo")
from plugins.objectives import kto as _kto  # noqa: F401  (registers "kto")
from plugins.objectives import orpo as _orpo  # noqa: F401  (registers "orpo")
from plugins.objectives import sft as _sft  # noqa: F401  (registers "sft")
from plugins.objectives import simpo as _simpo  # noqa: F401  (registers "simpo")
from plugins.objectives.spec import (ObjectiveConfig, ObjectiveSpec, get_objective, loss_of, objective_names,
                                     objective_of, register_objective)

__all__ = ["ObjectiveConfig", "ObjectiveSpec", "get_objective", "loss_of", "objective_names", "objective_of",
           "register_objective"]
