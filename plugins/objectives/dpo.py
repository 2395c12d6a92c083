"""Direct preference optimisation: a pair's loss from its chosen and rejected completions' summed log-probabilities
under the policy and under a frozen reference model (Rafailov et al. 2023), as TRL's DPOTrainer computes it.

With Δ = (π_c − ref_c) − (π_r − ref_r):
  sigmoid  −(1 − ε)·log σ(βΔ) − ε·log σ(−βΔ)   (DPO; ε = label_smoothing: conservative DPO, 0 by default: TRL
                                               1.16's sigmoid loss has no smoothing, its earlier ones this one)
  hinge    max(0, 1 − βΔ)                      (SLiC)
  ipo      ((π_c − ref_c)/n_c − (π_r − ref_r)/n_r − 1/(2β))²   (n: the completion's tokens, TRL's normalisation)
The rewards are β times each completion's log-ratio; a pair is accurate when its chosen reward is strictly the
larger (TRL's `>`). The reference's log-probabilities come from the "reference" provider (plugins/objectives/
reference.py: cached by the reference stage, or online).
"""
from __future__ import annotations

from dataclasses import dataclass

from common.keys import key
from plugins.objectives.pairs import METRICS, SWEEP_OBJECTIVES, PairLoss, PairTerms, per_token
from plugins.objectives.reference import REFERENCE, reference_key
from plugins.objectives.spec import NAME_HELP, PAIR, ObjectiveConfig, ObjectiveSpec, register_objective

LOSS_TYPES = ("sigmoid", "ipo", "hinge")
__all__ = ["DPOConfig", "DPOLoss", "LOSS_TYPES", "METRICS", "pair_losses"]


@dataclass
class DPOConfig(ObjectiveConfig):
    name: str = key("dpo", NAME_HELP)
    beta: float = key(0.1, "how far the policy may move from the reference (rewards are beta times a completion's "
                           "log-ratio; IPO's margin is 1/(2 beta))", min=1e-6, max=1e6)
    loss_type: str = key("sigmoid", "sigmoid (DPO: -log sigmoid(beta x the pair's log-ratio margin)), ipo (IPO: the "
                                    "per-token margin's squared distance to 1/(2 beta)) or hinge (SLiC: max(0, 1 - "
                                    "beta x margin))", choices=LOSS_TYPES)
    label_smoothing: float = key(0.0, "conservative DPO (cDPO): the share of pairs assumed mislabelled, "
                                      "-(1-e) log sigmoid(beta m) - e log sigmoid(-beta m)", min=0.0, max=0.5,
                                 read_when=("objective.loss_type", ("sigmoid",)))
    reference: str = reference_key()


class DPOLoss(PairLoss):
    def __init__(self, beta: float, loss_type: str, label_smoothing: float = 0.0):
        super().__init__()
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"objective.loss_type={loss_type!r}: one of {', '.join(LOSS_TYPES)}")
        self.beta, self.loss_type, self.label_smoothing = beta, loss_type, label_smoothing

    def terms(self, logps, tokens, reference) -> PairTerms:
        import torch
        import torch.nn.functional as F

        ratios = logps - reference.to(logps.dtype)
        chosen, rejected = ratios[0::2], ratios[1::2]
        beta, smoothing = self.beta, self.label_smoothing
        if self.loss_type == "sigmoid":
            delta = chosen - rejected
            losses = -(1 - smoothing) * F.logsigmoid(beta * delta) - smoothing * F.logsigmoid(-beta * delta)
        elif self.loss_type == "hinge":
            losses = torch.relu(1 - beta * (chosen - rejected))
        else:  # ipo: TRL's per-token normalisation of each log-ratio
            normalised = per_token(ratios, tokens)
            losses = (normalised[0::2] - normalised[1::2] - 1 / (2 * beta)) ** 2
        return PairTerms(losses, beta * chosen, beta * rejected, logps[0::2], logps[1::2])


def pair_losses(rows, reference, beta: float, loss_type: str, label_smoothing: float = 0.0):
    """rows (2P, 2): each row's summed log-probability under the policy and its count of completion tokens, chosen
    then rejected for each pair; reference (2P,): the reference model's of the same rows. Returns the pairs' summed
    loss (the caller divides by the global count of pairs) and the sums of METRICS over them."""
    loss = DPOLoss(beta, loss_type, label_smoothing)
    return loss(rows, reference), loss.take()


def _at_reference(o) -> float:
    """The loss of a pair whose log-ratios are both 0 (the policy is its reference): sigmoid's log 2 (with or without
    smoothing), hinge's 1, IPO's (1/(2 beta))^2."""
    import math

    return {"sigmoid": math.log(2), "hinge": 1.0, "ipo": (1 / (2 * o.beta)) ** 2}[o.loss_type]


def _describe(o) -> str:
    smoothing = f", label smoothing {o.label_smoothing:g}" if o.loss_type == "sigmoid" and o.label_smoothing else ""
    return f"dpo ({o.loss_type}, beta {o.beta:g}{smoothing}) on preference pairs"


register_objective("dpo", ObjectiveSpec(
    config=DPOConfig,
    loss=lambda o: DPOLoss(o.beta, o.loss_type, o.label_smoothing),
    rows=PAIR,
    formats=("preference",),
    row_inputs=(REFERENCE,),
    describe=_describe,
    sweep_objectives=SWEEP_OBJECTIVES,
    at_reference=_at_reference,
))
