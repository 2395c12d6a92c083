"""Supervised fine-tuning and pretraining: next-token cross-entropy of the learned tokens, averaged over them (the
label-sparse head's own loss: plugins/models/head_loss.py). The default objective: no per-row loss, no row inputs;
any record format whose rows are single examples (text, prompt_completion, chat)."""
from __future__ import annotations

from dataclasses import dataclass

from common.keys import key
from plugins.objectives.spec import NAME_HELP, SINGLE, ObjectiveConfig, ObjectiveSpec, register_objective


@dataclass
class SFTConfig(ObjectiveConfig):
    name: str = key("sft", NAME_HELP)


register_objective("sft", ObjectiveSpec(
    config=SFTConfig,
    rows=SINGLE,
    describe=lambda o: "sft (next-token cross-entropy of the learned tokens)",
))
