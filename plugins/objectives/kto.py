"""KTO: Kahneman-Tversky optimisation on unpaired records (Ethayarajh et al. 2024), as TRL's KTOTrainer computes it.

Each record is a prompt, a completion and a label (data.format=unpaired). With r = π − ref the completion's
log-ratio and z the batch's KL estimate:
  kto                desirable 1 − σ(β(r − z)), undesirable 1 − σ(β(z − r))
  apo_zero_unpaired  desirable 1 − σ(βr),       undesirable σ(βr)        (APO-zero, no z)
weighted by desirable_weight and undesirable_weight and averaged over the batch's records. z is the mean, over the
global batch, of π − ref of its mismatched rows (each record's prompt with the completion of the record drawn before
it: Batch.mismatched, TRL's KL completions rotated by one in the batch), scored by the policy without a gradient
and by the reference, clamped at 0: the same on every rank and for any split of the batch. The reference's
log-probabilities come from the "reference" provider, computed online (the mismatched rows change with every batch);
the label from the "label" provider (plugins/objectives/providers.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from common.keys import key
from common.problem import Problem
from plugins.objectives.providers import LABEL
from plugins.objectives.reference import REFERENCE, reference_key
from plugins.objectives.spec import NAME_HELP, ObjectiveConfig, ObjectiveSpec, RowsLoss, register_objective

LOSS_TYPES = ("kto", "apo_zero_unpaired")
# what a step logs, as TRL names it: means over the step's desirable or undesirable records (left out where it has
# none of one side, as TRL leaves them out), their difference, and z
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "kl")
# what the loss sums, each side's apart, and the records of each side: the means divide them once summed over the
# microbatches, ranks and held-out batches (a held-out batch's side means weighted by its records would be biased)
SUMS = ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "chosen", "rejected", "kl")


@dataclass
class KTOConfig(ObjectiveConfig):
    name: str = key("kto", NAME_HELP)
    beta: float = key(0.1, "how far the policy may move from the reference (a completion's reward is beta times "
                           "its log-ratio)", min=1e-6, max=1e6)
    loss_type: str = key("kto", "kto (the KL estimate z from the batch's mismatched rows) or apo_zero_unpaired "
                                "(APO-zero: no z)", choices=LOSS_TYPES)
    desirable_weight: float = key(1.0, "the weight of a desirable record's loss (KTO's paper: desirable_weight x "
                                       "desirable records / undesirable_weight x undesirable ones in [1, 4/3])",
                                  min=0.0, max=1e6)
    undesirable_weight: float = key(1.0, "the weight of an undesirable record's loss", min=0.0, max=1e6)
    reference: str = reference_key("online")


class KTOLoss(RowsLoss):
    names = SUMS

    def __init__(self, beta: float, loss_type: str, desirable_weight: float, undesirable_weight: float):
        super().__init__()
        self.beta, self.loss_type = beta, loss_type
        self.weights = (desirable_weight, undesirable_weight)
        self.kl = 0.0

    def count(self, batch, score=None) -> int:
        """The global batch's records, and z estimated from its mismatched rows (kto: score gives the policy's
        log-probability of each, the provider the reference's)."""
        if self.loss_type == "kto":
            import torch

            rows = batch.mismatched
            if score is None or rows is None:
                raise ValueError("kto's KL estimate scores the batch's mismatched rows: count(batch, score) needs both")
            kept = torch.from_numpy(rows.drawn >= 0)  # (an empty row past a held-out split's last: none to score)
            gaps = score(rows) - rows.row_inputs[:, 0]
            self.kl = max(float(gaps[kept].mean()), 0.0) if kept.any() else 0.0
        return super().count(batch)

    def __call__(self, rows, row_inputs=None):
        import torch

        logps, held = rows[:, 0].float(), rows[:, 1] > 0  # (an empty row: past a held-out split's last)
        reference, desirable = row_inputs[:, 0].to(logps.dtype), row_inputs[:, 1] > 0.5
        ratios = logps - reference
        b, kl = self.beta, self.kl  # (apo_zero_unpaired: 0, never estimated)
        losses = torch.where(desirable, self.weights[0] * (1 - torch.sigmoid(b * (ratios - kl))),
                             self.weights[1] * (1 - torch.sigmoid(b * (kl - ratios))))
        zero = torch.zeros((), dtype=losses.dtype, device=losses.device)
        with torch.no_grad():
            sides = (held & desirable, held & ~desirable)
            sums = [torch.where(side, values, zero).sum() for values in (b * ratios, logps) for side in sides]
            sums += [side.sum() for side in sides] + [held.sum() * kl]
            self.calls.append(torch.stack([v.to(zero.dtype) for v in sums]))
        return torch.where(held, losses, zero).sum()

    def means(self, shares: list) -> dict:
        """TRL's measures from the global sums (shares of the count: their ratios are the means): each side's over
        its records, left out where there are none; the margin where both sides have some; z over the records."""
        sums = dict(zip(SUMS, shares))
        found = {name: sums[name] / sums[side] for name in SUMS[:4]
                 if sums[side := "chosen" if name.endswith("chosen") else "rejected"] > 0}
        if {"rewards/chosen", "rewards/rejected"} <= set(found):
            found["rewards/margins"] = found["rewards/chosen"] - found["rewards/rejected"]
        records = sums["chosen"] + sums["rejected"]
        return {**found, **({"kl": sums["kl"] / records} if records > 0 else {})}


def _rules(cfg) -> list[Problem]:
    o, p = cfg.objective, []
    if o.reference != "online":
        p.append(Problem("objective.reference", o.reference, "kto's KL estimate scores rows made of each batch "
                         "(each record's prompt with another's completion) under the reference, so the reference "
                         "model runs beside the policy (with LoRA: the policy with its adapters off); a cached pass "
                         "cannot know them", "objective.reference=online"))
    if cfg.train.batch_size < 2 and o.loss_type == "kto":
        p.append(Problem("train.batch_size", cfg.train.batch_size, "kto's KL estimate pairs each record's prompt with "
                         "another record's completion in the batch: one record has no other (its estimate would be "
                         "its own reward)", "train.batch_size=8"))
    if cfg.data.packing:
        p.append(Problem("data.packing", cfg.data.packing, "a kto record is one row of one document (its completion's "
                         "log-probability, and its prompt's with another's completion), never packed with others",
                         "data.packing=false (data=unpaired sets it)"))
    if "val_perplexity" in cfg.evaluate.tasks:
        p.append(Problem("evaluate.tasks", list(cfg.evaluate.tasks), "val_perplexity scores the held-out records' "
                         "completions as text the model should write, and an undesirable one is not",
                         "evaluate.tasks= the other tasks (the held-out kto loss and rewards are logged by train)"))
    if cfg.engine.name != "torch":
        p.append(Problem("engine.name", cfg.engine.name, "objective=kto is built and checked against TRL on the "
                         f"torch engine only; engine={cfg.engine.name} is not yet", "engine=torch"))
    # The weights: a negative one is refused by its key's bounds (min 0: it would push that side's records the wrong
    # way, which TRL's KTOTrainer, multiplying each side's losses by its weight unchecked, would do). Both 0 leaves
    # nothing to learn. One 0 is a choice, said in the plan's objective line (_describe), not refused: the other
    # side is still learned against z, as from a file of one side's records only, which TRL and data=unpaired accept.
    if o.desirable_weight == 0 and o.undesirable_weight == 0:
        p.append(Problem("objective.desirable_weight", o.desirable_weight, "objective.undesirable_weight is 0 too: "
                         "every record's loss is weighted 0, so the loss is 0 whatever the policy does and no step "
                         "learns anything", "objective.desirable_weight=1.0 objective.undesirable_weight=1.0 (the "
                         "defaults; with more records of one side, the other's weight higher)"))
    return p


def _describe(o) -> str:
    """The plan's words for it, and the side it does not learn where one weight is 0 (both 0 is refused)."""
    sides = (("desirable", o.desirable_weight, "undesirable"), ("undesirable", o.undesirable_weight, "desirable"))
    return (f"kto ({o.loss_type}, beta {o.beta:g}, weights {o.desirable_weight:g}/{o.undesirable_weight:g}"
            + "".join(f": the {side} records weigh 0, only the {other} ones are learned"
                      for side, weight, other in sides if weight == 0)
            + ") on unpaired records, reference online")


def _at_reference(o):
    """Its loss where the policy is its reference (every log-ratio and z 0: each record's 1 − σ(0) = 1/2, weighted):
    known where both weights are the same."""
    return 0.5 * o.desirable_weight if o.desirable_weight == o.undesirable_weight else None


register_objective("kto", ObjectiveSpec(
    config=KTOConfig,
    loss=lambda o: KTOLoss(o.beta, o.loss_type, o.desirable_weight, o.undesirable_weight),
    formats=("unpaired", "preference"),  # pairs read unpaired: the chosen desirable, the rejected not (TRL's way)
    mismatched=lambda o: o.loss_type == "kto",  # (apo_zero_unpaired has no z: no rows to score)
    row_inputs=(REFERENCE, LABEL),
    rules=_rules,
    describe=_describe,
    sweep_objectives={"eval_reward_margin": ("final_eval_rewards/margins", "maximize")},
    at_reference=_at_reference,
))
