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

from pathlib import Path
from typing import TYPE_CHECKING

from common.keys import key

if TYPE_CHECKING:  # imported where the values are read: the config's checks and the plan never need them
    import numpy as np
    import torch

REFERENCE = "reference"  # the provider's name in a spec's row_inputs
SPLITS = ("train", "val")


def reference_key():
    """`objective.reference`, declared by each objective that takes the reference's log-probabilities."""
    return key("cached", "where the reference model's log-probabilities come from: cached (the reference stage "
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
    return needs_reference(cfg) and cfg.objective.get("reference", "cached") == "cached"


def online(cfg) -> bool:
    return needs_reference(cfg) and not cached(cfg)


class ReferenceRows:
    """The reference pass's objective: no loss (zero), each row's summed log-probability and its learned tokens kept,
    in the order the runner computes its microbatches (stages/reference.py; the train step's online reference; the
    held-out next-token pass of a rows objective). A pipeline's first-step shape inference does not happen in a
    forward-only pass."""

    names = ()

    def __init__(self):
        self.rows: list = []

    def __call__(self, rows: torch.Tensor, row_inputs=None) -> torch.Tensor:
        self.rows.append(rows.detach().double().cpu())
        return rows[:, 0].sum() * 0

    def keep_last(self, calls: int) -> None:
        del self.rows[:-calls]

    def take(self) -> torch.Tensor:
        """(rows, 2): the rows' log-probabilities and learned tokens since the last take (none where this rank holds
        no head)."""
        import torch

        rows, self.rows = self.rows, []
        return torch.cat(rows) if rows else torch.zeros((0, 2), dtype=torch.float64)


def reference_values(folder: Path) -> dict[str, np.ndarray]:
    """The reference stage's output as the batcher takes it: each split's log-probabilities, one a document
    ({split}.npy, float64, memory-mapped)."""
    import numpy as np

    return {split: np.load(Path(folder) / f"{split}.npy", mmap_mode="r") for split in SPLITS}
