"""What the objectives on preference pairs share (DPO, SimPO, ORPO: one file each): their rows, their loss object and
the measures TRL logs for all of them.

Rows come in pairs, the chosen completion's row then the rejected one's (rows 2k and 2k+1), so that any split of a
batch into ranks and microbatches by whole even slices keeps a pair together. Each objective gives, from the rows'
summed log-probabilities and token counts (and its per-row inputs), each pair's loss, its chosen and rejected
rewards and the log-probabilities it reports; PairLoss sums them over the microbatch's pairs (an empty pair, a held-out
batch's rows past the split's last, counts for nothing), and the step divides by the global batch's pairs. A term
that TRL averages over the chosen completions' tokens instead (CPO's and ORPO's NLL) is given per pair already scaled
by pairs / chosen tokens of the global batch (PairLoss.token_mean), so that the same division gives TRL's mean.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Optional

from common.problem import Problem
from plugins.objectives.spec import RowsLoss

if TYPE_CHECKING:  # torch is imported where a loss is computed: the config's checks and the plan never need it
    import torch

# what a step logs, as TRL names it: each a mean over the step's pairs
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")
# sweep.objective's names for the held-out pairs' measures (maximised), the same for every pair objective
SWEEP_OBJECTIVES = {"eval_reward_accuracy": ("final_eval_rewards/accuracies", "maximize"),
                    "eval_reward_margin": ("final_eval_rewards/margins", "maximize")}


class PairTerms(NamedTuple):
    losses: torch.Tensor            # (P,) each pair's loss (differentiable)
    chosen_rewards: torch.Tensor    # (P,)
    rejected_rewards: torch.Tensor  # (P,)
    chosen_logps: torch.Tensor      # (P,) what logps/chosen reports (summed, or per token where the loss averages)
    rejected_logps: torch.Tensor    # (P,)
    extra: tuple = ()               # (P,) each, the objective's own measures (PairLoss.extra names them)


class PairLoss(RowsLoss):
    """The runners' loss for preference pairs (plugins/parallel/pipeline.py): each microbatch's rows from the head
    against their per-row inputs, its pairs' summed loss; the measures' sums of the step's microbatches kept until
    the step takes them (`take`). Subclasses give `terms`."""

    extra: tuple[str, ...] = ()  # the objective's own measures, after METRICS

    def __init__(self):
        super().__init__()
        self.names = METRICS + self.extra
        self.pairs, self.chosen_tokens = 1, 1  # the global batch's (count)

    def terms(self, logps: torch.Tensor, tokens: torch.Tensor, row_inputs: Optional[torch.Tensor]) -> PairTerms:
        raise NotImplementedError

    def count(self, batch, score=None) -> int:
        """The global batch's pairs (what the step's loss is a mean over); its chosen completions' tokens kept."""
        self.pairs = max(batch.example_count(2), 1)
        self.chosen_tokens = max(int((batch.labels[0::2] != -100).sum()), 1)
        return self.pairs

    def token_mean(self, per_pair: torch.Tensor) -> torch.Tensor:
        """Per-pair sums (over the chosen completion's tokens) scaled so that their sum over the global batch's pairs
        divided by its pairs is their mean over its chosen tokens (TRL's CrossEntropyLoss over the chosen rows)."""
        return per_pair * (self.pairs / self.chosen_tokens)

    def __call__(self, rows: torch.Tensor, row_inputs: Optional[torch.Tensor] = None) -> torch.Tensor:
        import torch

        logps, tokens = rows[:, 0].float(), rows[:, 1].float()
        # an empty pair (a held-out batch's rows past the split's last) counts for nothing; its rows are given a
        # finite stand-in first (a mean log-probability of -1 a token), as an empty row's 0 is log(1 - e^0) = -inf
        # to ORPO's odds, whose NaN no mask removes, in a value or in a gradient
        held = tokens[0::2] > 0
        empty = ~held.repeat_interleave(2)  # both rows of an empty pair
        logps, tokens = torch.where(empty, -1.0, logps), torch.where(empty, 1.0, tokens)
        t = self.terms(logps, tokens, row_inputs)
        zero = torch.zeros((), dtype=t.losses.dtype, device=t.losses.device)
        with torch.no_grad():
            self.calls.append(torch.stack([torch.where(held, v.to(zero.dtype), zero).sum() for v in (
                t.chosen_rewards, t.rejected_rewards, (t.chosen_rewards > t.rejected_rewards).float(),
                t.chosen_rewards - t.rejected_rewards, t.chosen_logps, t.rejected_logps, *t.extra)]))
        return torch.where(held, t.losses, zero).sum()


def per_token(logps: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Each row's mean log-probability per learned token (TRL's average_log_prob: SimPO's, ORPO's, IPO's)."""
    return logps / tokens.clamp(min=1)


def pair_rules(cfg) -> list[Problem]:
    """What rows of pairs need of the layout: unpacked rows, whole pairs on every rank and microbatch, the torch
    engine (asked for every objective whose rows are pairs)."""
    d, p, t, name = cfg.data, cfg.parallel, cfg.train, cfg.objective.name
    problems = []
    if d.packing:
        problems.append(Problem("data.packing", d.packing, "a preference pair is two rows of one document each "
                                "(chosen and rejected side by side, on one rank), never packed with others",
                                "data.packing=false (data=preference sets it)"))
    split = p.dp * p.microbatches
    if t.batch_size % (2 * split):
        problems.append(Problem("train.batch_size", t.batch_size, f"a batch of pairs is split into parallel.dp="
                                f"{p.dp} ranks x parallel.microbatches={p.microbatches} microbatches, each holding "
                                f"whole pairs (two rows each): it must be divisible by {2 * split}",
                                f"train.batch_size={max(1, t.batch_size // (2 * split)) * 2 * split}"))
    if cfg.engine.name != "torch":
        problems.append(Problem("engine.name", cfg.engine.name, f"objective={name} on preference pairs is built and "
                                f"checked against TRL on the torch engine only; engine={cfg.engine.name} is not yet",
                                "engine=torch"))
    return problems
