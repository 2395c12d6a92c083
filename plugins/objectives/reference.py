"""The per-row input "reference": each row's summed log-probability under a frozen reference model (train.init_from's;
with peft=lora its base, the adapters off; a continued run's, the one it started with: storage/adapters.reference_of).

Any objective that names it in its spec's row_inputs gets it with each batch's rows (TRL's ref_chosen_logps column),
from one of two places, chosen by its `objective.reference` key (reference_key):
  cached  the reference stage (stages/reference.py) scores every document of both splits once, before train: its
          key is the reference model, the tokenized records and the code, so a sweep over the objective's settings,
          the learning rate or LoRA's rank computes them once;
  online  the train step scores each batch with a frozen copy beside the policy (with LoRA: the policy itself with
          its adapters off, no second model).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from common.keys import key

if TYPE_CHECKING:  # imported where the values are read: the config's checks and the plan never need them
    import numpy as np
    import torch

REFERENCE = "reference"  # the provider's name in a spec's row_inputs
SPLITS = ("train", "val")


def reference_key(default: str = "cached"):
    """`objective.reference`, declared by each objective that takes the reference's log-probabilities."""
    return key(default, "where the reference model's log-probabilities come from: cached (the reference stage "
                         "computes them once, before train, for every record of both splits: its key is the reference "
                         "model, the tokenized records and the code, so a sweep over the objective's settings, the "
                         "learning rate or LoRA's rank computes them once) or online (the train step computes them "
                         "for each batch with a frozen copy of the starting model beside the policy; with LoRA the "
                         "policy with its adapters off)", choices=("cached", "online"))


def needs_reference(cfg) -> bool:
    """Whether the experiment's objective takes the reference model's log-probabilities."""
    from plugins.objectives.spec import objective_of

    return REFERENCE in objective_of(cfg).row_inputs


def cached(cfg) -> bool:
    """Whether the reference stage computes them (objective.reference=cached)."""
    return needs_reference(cfg) and _where(cfg.objective) == "cached"


def online(cfg) -> bool:
    return needs_reference(cfg) and not cached(cfg)


def _where(objective) -> str:
    """`objective.reference` of an objective that takes the reference: cached or online."""
    return objective.get("reference", "cached")


def adapters_are_the_difference(cfg) -> bool:
    """Whether the policy with its adapters off is the reference model (peft=lora training nothing else: the
    online reference then needs no second model)."""
    return cfg.peft.name == "lora" and not list(cfg.peft.trainable)


@dataclass(frozen=True)
class Reference:
    """The reference model of a point whose objective takes one, as its plan says and sizes it: worked out once, where
    the plan is made (planning/plan.py's Plan.reference), instead of by each line that names it."""
    where: str            # "cached": the reference stage scores the rows once; "online": the train step, each batch
    is_the_policy: bool   # the policy with its adapters off (adapters_are_the_difference): no second model online
    model: Optional[str]  # what its weights are read from (storage/adapters.reference_of); None: train.seed's init


def reference_taken(cfg, spec) -> Optional[Reference]:
    """The point's reference model, None where its objective (spec: its ObjectiveSpec) takes none."""
    from storage import adapters

    if REFERENCE not in spec.row_inputs:
        return None
    return Reference(_where(cfg.objective), adapters_are_the_difference(cfg), adapters.reference_of(cfg))


def ReferenceRows():  # noqa: N802  (made as the class it was)
    """The reference pass's objective: each row's summed log-probability kept (runtime/evaluate.RowRecorder)."""
    from runtime.evaluate import RowRecorder

    return RowRecorder()


def reference_values(folder: Path) -> dict[str, np.ndarray]:
    """The reference stage's output as the batcher takes it: each split's log-probabilities, one a document
    ({split}.npy, float64, memory-mapped)."""
    import numpy as np

    return {split: np.load(Path(folder) / f"{split}.npy", mmap_mode="r") for split in SPLITS}
