"""SimPO: simple preference optimisation without a reference model (Meng et al. 2024), as TRL's experimental
CPOTrainer computes it with loss_type=simpo.

Each completion's reward is β times its mean log-probability per token (length-normalised, no reference), and a
pair's loss is −(1 − ε)·log σ(β(c̄ − r̄) − γ) − ε·log σ(−(β(c̄ − r̄) − γ)), γ = simpo_gamma the target margin;
cpo_alpha > 0 adds CPO's behaviour-cloning term, α times the chosen completions' NLL (their mean over the batch's
chosen tokens: CPO-SimPO). TRL's CPOConfig defaults to cpo_alpha=1.0; SimPO proper, and this option's default, is 0.
"""
from __future__ import annotations

from dataclasses import dataclass

from common.keys import key
from plugins.objectives.pairs import SWEEP_OBJECTIVES, PairLoss, PairTerms, per_token
from plugins.objectives.spec import NAME_HELP, PAIR, ObjectiveConfig, ObjectiveSpec, register_objective


@dataclass
class SimPOConfig(ObjectiveConfig):
    name: str = key("simpo", NAME_HELP)
    beta: float = key(2.0, "the reward's scale: a completion's reward is beta times its mean log-probability per "
                           "token (SimPO's paper: 2.0 to 2.5; TRL's CPOConfig default 0.1)", min=1e-6, max=1e6)
    simpo_gamma: float = key(0.5, "the target reward margin gamma between chosen and rejected", min=0.0, max=1e6)
    label_smoothing: float = key(0.0, "the share of pairs assumed mislabelled (cDPO's smoothing of the sigmoid "
                                      "loss)", min=0.0, max=0.5)
    cpo_alpha: float = key(0.0, "weight of the chosen completions' NLL added to the loss (CPO-SimPO; 0: SimPO "
                                "proper)", min=0.0, max=1e6)


class SimPOLoss(PairLoss):
    extra = ("nll_loss",)

    def __init__(self, beta: float, gamma: float, label_smoothing: float = 0.0, alpha: float = 0.0):
        super().__init__()
        self.beta, self.gamma, self.label_smoothing, self.alpha = beta, gamma, label_smoothing, alpha

    def terms(self, logps, tokens, row_inputs=None) -> PairTerms:
        import torch.nn.functional as F

        mean = per_token(logps, tokens)
        chosen, rejected = mean[0::2], mean[1::2]
        margin = self.beta * (chosen - rejected) - self.gamma
        losses = -(1 - self.label_smoothing) * F.logsigmoid(margin) - self.label_smoothing * F.logsigmoid(-margin)
        nll = self.token_mean(-logps[0::2])  # each pair's share of the chosen tokens' mean NLL
        logged = nll.detach() if self.alpha else nll.detach() * 0  # TRL logs nll_loss 0 where it computes none
        return PairTerms(losses + self.alpha * nll, self.beta * chosen, self.beta * rejected, chosen, rejected,
                         (logged,))


register_objective("simpo", ObjectiveSpec(
    config=SimPOConfig,
    loss=lambda o: SimPOLoss(o.beta, o.simpo_gamma, o.label_smoothing, o.cpo_alpha),
    rows=PAIR,
    formats=("preference",),
    describe=lambda o: f"simpo (beta {o.beta:g}, gamma {o.simpo_gamma:g}" +
                       (f", cpo_alpha {o.cpo_alpha:g}" if o.cpo_alpha else "") + ") on preference pairs, no reference",
    sweep_objectives=SWEEP_OBJECTIVES,
))
