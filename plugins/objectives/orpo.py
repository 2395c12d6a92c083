"""ORPO: odds-ratio preference optimisation, SFT and preference in one loss without a reference model (Hong et al.
2024), as TRL's experimental ORPOTrainer computes it.

With c̄, r̄ the chosen and rejected completions' mean log-probabilities per token, the log odds ratio is
(c̄ − r̄) − (log(1 − e^c̄) − log(1 − e^r̄)), and the loss is the chosen completions' NLL (their mean over the batch's
chosen tokens) minus β times the pairs' mean log σ(log odds ratio) (β: the paper's λ). The rewards TRL logs are β
times each completion's mean log-probability.
"""
from __future__ import annotations

from dataclasses import dataclass

from common.keys import key
from plugins.objectives.pairs import SWEEP_OBJECTIVES, PairLoss, PairTerms, per_token
from plugins.objectives.spec import NAME_HELP, PAIR, ObjectiveConfig, ObjectiveSpec, register_objective


@dataclass
class ORPOConfig(ObjectiveConfig):
    name: str = key("orpo", NAME_HELP)
    beta: float = key(0.1, "the odds-ratio term's weight (the paper's lambda; 0 would leave SFT on the chosen "
                           "completions: objective=sft for that)", min=1e-6, max=1e6)


def log1mexp(x):
    """log(1 − e^x) for x < 0, stable on both sides of −ln 2 (TRL's)."""
    import torch

    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


class ORPOLoss(PairLoss):
    extra = ("nll_loss", "log_odds_ratio", "log_odds_chosen")

    def __init__(self, beta: float):
        super().__init__()
        self.beta = beta

    def terms(self, logps, tokens, row_inputs=None) -> PairTerms:
        import torch.nn.functional as F

        mean = per_token(logps, tokens)
        chosen, rejected = mean[0::2], mean[1::2]
        log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
        ratio = F.logsigmoid(log_odds)
        nll = self.token_mean(-logps[0::2])  # each pair's share of the chosen tokens' mean NLL
        return PairTerms(nll - self.beta * ratio, self.beta * chosen, self.beta * rejected, chosen, rejected,
                         (nll.detach(), ratio.detach(), log_odds.detach()))


register_objective("orpo", ObjectiveSpec(
    config=ORPOConfig,
    loss=lambda o: ORPOLoss(o.beta),
    rows=PAIR,
    formats=("preference",),
    describe=lambda o: f"orpo (beta {o.beta:g}) on preference pairs: chosen NLL + odds ratio, no reference",
    sweep_objectives=SWEEP_OBJECTIVES,
))
