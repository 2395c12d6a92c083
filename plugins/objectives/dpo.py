"""Direct preference optimisation: a pair's loss from its chosen and rejected completions' summed log-probabilities
under the policy and under a frozen reference model (Rafailov et al. 2023), as TRL's DPOTrainer computes it.

Rows come in pairs, the chosen completion's row then the rejected one's (rows 2k and 2k+1), so that any split of a
batch into ranks and microbatches by whole even slices keeps a pair together. With Δ = (π_c − ref_c) − (π_r − ref_r):
  sigmoid  −(1 − ε)·log σ(βΔ) − ε·log σ(−βΔ)   (DPO; ε = label_smoothing: conservative DPO, 0 by default)
  hinge    max(0, 1 − βΔ)                      (SLiC)
  ipo      ((π_c − ref_c)/n_c − (π_r − ref_r)/n_r − 1/(2β))²   (n: the completion's tokens, TRL's normalisation)
The rewards are β times each completion's log-ratio; a pair is accurate when its chosen reward is strictly the
larger (TRL's `>`).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

LOSS_TYPES = ("sigmoid", "ipo", "hinge")
# what a step logs, as TRL names it: each a mean over the step's pairs
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def pair_losses(rows: torch.Tensor, reference: torch.Tensor, beta: float, loss_type: str,
                label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """rows (2P, 2): each row's summed log-probability under the policy (differentiable) and its count of completion
    tokens, chosen then rejected for each pair; reference (2P,): the reference model's summed log-probabilities of
    the same rows. Returns the pairs' summed loss (the caller divides by the global count of pairs) and the sums of
    METRICS over these pairs (2P → (len(METRICS),), detached: summed over ranks, then divided by the pairs)."""
    logps, tokens = rows[:, 0].float(), rows[:, 1].float()
    ratios = logps - reference.to(logps.dtype)
    chosen, rejected = ratios[0::2], ratios[1::2]
    delta = chosen - rejected
    if loss_type == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * delta) - label_smoothing * F.logsigmoid(-beta * delta)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * delta)
    elif loss_type == "ipo":
        per_token = ratios / tokens.clamp(min=1)
        losses = (per_token[0::2] - per_token[1::2] - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"objective.loss_type={loss_type!r}: one of {', '.join(LOSS_TYPES)}")
    with torch.no_grad():
        chosen_rewards, rejected_rewards = beta * chosen, beta * rejected
        metrics = torch.stack([chosen_rewards.sum(), rejected_rewards.sum(),
                               (chosen_rewards > rejected_rewards).float().sum(),
                               (chosen_rewards - rejected_rewards).sum(), logps[0::2].sum(), logps[1::2].sum()])
    return losses.sum(), metrics


def preference_loss(objective) -> "PreferenceLoss":
    """The objective config section's loss (objective=dpo)."""
    return PreferenceLoss(objective.beta, objective.loss_type, objective.label_smoothing)


class PreferenceLoss:
    """The runners' loss for preference pairs (plugins/parallel/pipeline.py): each microbatch's rows from the head
    (per_row) against their reference log-probabilities, its pairs' summed loss; the METRICS' sums of the step's
    microbatches kept until the step takes them (`take`). A pipeline schedule also calls its loss once on made-up
    outputs when it infers its stages' shapes (torch.distributed.pipelining, the first step): its runner keeps the
    sums of the step's microbatches only (keep_last)."""

    names = METRICS

    def __init__(self, beta: float, loss_type: str, label_smoothing: float = 0.0):
        self.beta, self.loss_type, self.label_smoothing = beta, loss_type, label_smoothing
        self.calls: list[torch.Tensor] = []  # each call's METRICS' sums since the last take

    def __call__(self, rows: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
        loss, sums = pair_losses(rows, reference, self.beta, self.loss_type, self.label_smoothing)
        self.calls.append(sums)
        return loss

    def keep_last(self, calls: int) -> None:
        del self.calls[:-calls]

    def take(self) -> torch.Tensor:
        """The METRICS' sums since the last take (zeros when this rank computed none)."""
        calls, self.calls = self.calls, []
        return torch.stack(calls).sum(0) if calls else torch.zeros(len(METRICS))


class ReferenceRows:
    """The reference pass's objective: no loss (zero), each row's summed log-probability and its learned tokens kept,
    in the order the runner computes its microbatches (stages/reference.py; the train step's online reference). A
    pipeline's first-step shape inference does not happen in a forward-only pass."""

    names = ()

    def __init__(self):
        self.rows: list[torch.Tensor] = []

    def __call__(self, rows: torch.Tensor, reference=None) -> torch.Tensor:
        self.rows.append(rows.detach().double().cpu())
        return rows[:, 0].sum() * 0

    def keep_last(self, calls: int) -> None:
        del self.rows[:-calls]

    def take(self) -> torch.Tensor:
        """(rows, 2): the rows' log-probabilities and learned tokens since the last take (none where this rank holds
        no head)."""
        rows, self.rows = self.rows, []
        return torch.cat(rows) if rows else torch.zeros((0, 2), dtype=torch.float64)


REFERENCE_SPLITS = ("train", "val")


def reference_values(folder: Path) -> dict[str, np.ndarray]:
    """The reference stage's output as the batcher takes it: each split's log-probabilities, one a document
    ({split}.npy, float64, memory-mapped)."""
    return {split: np.load(Path(folder) / f"{split}.npy", mmap_mode="r") for split in REFERENCE_SPLITS}
