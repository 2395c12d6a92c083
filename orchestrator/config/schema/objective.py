"""What the train stage minimises: the `objective` section (next-token cross-entropy, or a preference objective on
pairs against a reference model's log-probabilities)."""
from __future__ import annotations

from dataclasses import dataclass

from orchestrator.config.schema.keys import DPO, key

LOSS_TYPES = ("sigmoid", "ipo", "hinge")  # plugins/objectives/dpo.py's (the schema may not import plugins)


@dataclass
class ObjectiveConfig:
    name: str = key("sft", "sft: next-token cross-entropy on the learned tokens (pretraining, fine-tuning); dpo: "
                           "direct preference optimisation on data.format=preference pairs, each pair's chosen and "
                           "rejected completion against the reference model's log-probabilities (TRL's "
                           "DPOTrainer)", choices=("sft", "dpo"))
    beta: float = key(0.1, "the preference objective's beta: how far the policy may move from the reference "
                           "(rewards are beta times a completion's log-ratio; IPO's margin is 1/(2 beta))",
                      min=1e-6, max=1e6, read_when=DPO)
    loss_type: str = key("sigmoid", "sigmoid (DPO: -log sigmoid(beta x the pair's log-ratio margin)), ipo (IPO: the "
                                    "per-token margin's squared distance to 1/(2 beta)) or hinge (SLiC: max(0, 1 - "
                                    "beta x margin))", choices=LOSS_TYPES, read_when=DPO)
    label_smoothing: float = key(0.0, "conservative DPO (cDPO): the share of pairs assumed mislabelled, "
                                      "-(1-e) log sigmoid(beta m) - e log sigmoid(-beta m)", min=0.0, max=0.5,
                                 read_when=[DPO, ("objective.loss_type", ("sigmoid",))])
    reference: str = key("cached", "where the reference model's log-probabilities of the pairs come from: cached (the "
                                   "reference stage computes them once, before train, for every pair of both "
                                   "splits: its key is the reference model, the tokenized pairs and the code, so a "
                                   "sweep over beta, the learning rate or LoRA's rank computes them once) or online "
                                   "(the train step computes them for each batch with a frozen copy of the starting "
                                   "model beside the policy; with LoRA the policy with its adapters off)",
                         choices=("cached", "online"), read_when=DPO)
