"""SimPO and ORPO (plugins/objectives/simpo.py, orpo.py: no reference model) against TRL's experimental CPOTrainer
(loss_type=simpo) and ORPOTrainer: from the walk-through's tiny chat Llama, on TRL's own collated batch of four
arithmetic pairs every step, the project's train step (runtime/step.py: AdamW, constant lr, gradients clipped at 1) in
one process gives TRL's logged loss and every measure TRL logs that the objective names, at each of three steps, with
the whole model trained and with LoRA (peft's adapters on every Linear of the blocks, from our initial A). ORPO's NLL
term is the chosen completion's (the paper's L_SFT of y_w given x, and what every objective here learns), where TRL's
takes the prompt's tokens too: the test gives TRL's trainer the completion's labels for that term alone."""
from __future__ import annotations

import pytest
import torch

from plugins.models.head_loss import IGNORED
from storage import hf
from tests.test_dpo import LR, pairs, trained, trl_policy  # noqa: F401  (trained: the tiny model, made once)

SETTINGS = {"simpo": {"beta": 2.0, "simpo_gamma": 0.5, "cpo_alpha": 0.5},  # CPO-SimPO: the NLL term computed too
            "orpo": {"beta": 0.1}}


def rows_of(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """CPO's and ORPO's collated batch (chosen_* and rejected_* tensors, right-padded) as our rows: each pair's chosen
    then rejected row, the inputs and their next tokens where TRL's labels keep them (the completion)."""
    width = max(batch["chosen_input_ids"].shape[1], batch["rejected_input_ids"].shape[1])
    ids, labels = [], []
    for side in ("chosen", "rejected"):
        pad = width - batch[f"{side}_input_ids"].shape[1]
        ids.append(torch.nn.functional.pad(batch[f"{side}_input_ids"], (0, pad)))
        labels.append(torch.nn.functional.pad(batch[f"{side}_labels"], (0, pad), value=IGNORED))
    n = len(ids[0])
    order = torch.stack([torch.arange(n), torch.arange(n) + n], 1).reshape(-1)
    ids, labels = torch.cat(ids)[order], torch.cat(labels)[order]
    return ids[:, :-1], labels[:, 1:]


def _trl_trainer(name: str, model, folder, tmp_path):
    import datasets
    import transformers

    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    common = dict(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, max_steps=3, bf16=False,
                  learning_rate=LR, lr_scheduler_type="constant", report_to=[], save_strategy="no", use_cpu=True,
                  seed=0, logging_steps=1, disable_tqdm=True, max_grad_norm=1.0)
    if name == "simpo":
        args = CPOConfig(loss_type="simpo", **SETTINGS[name], **common)
        trainer_class = CPOTrainer
    else:
        args, trainer_class = ORPOConfig(**SETTINGS[name], **common), ORPOTrainer
    trainer = trainer_class(model=model, args=args, train_dataset=datasets.Dataset.from_list(pairs(4)),
                            processing_class=transformers.AutoTokenizer.from_pretrained(folder))
    if name == "orpo":
        _completion_nll(trainer)
    return trainer


def _completion_nll(trainer) -> None:
    """ORPO's NLL term over the chosen completion, as ours (plugins/objectives/orpo.py): TRL's ORPOTrainer takes it
    over the prompt and the completion ("computed over the full prompt and response"); everything else, its odds-ratio
    term, rewards and measures, is TRL's own code."""
    import torch.nn.functional as F

    forward = trainer.concatenated_forward

    def completion_only(model, batch):
        chosen_logps, rejected_logps, chosen_logits, rejected_logits, *rest = forward(model, batch)
        labels = trainer.concatenated_inputs(batch, padding_value=trainer.padding_value)["concatenated_labels"]
        labels = labels[:len(chosen_logits), 1:].to(chosen_logits.device)
        nll = F.cross_entropy(chosen_logits.reshape(-1, chosen_logits.shape[-1]), labels.reshape(-1))
        return (chosen_logps, rejected_logps, chosen_logits, rejected_logits, nll, *rest[1:])

    trainer.concatenated_forward = completion_only


@pytest.mark.parametrize("adapters", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("name", ["simpo", "orpo"])
def test_three_steps_give_trls_losses_and_measures(trained, tmp_path, name, adapters):  # noqa: F811
    from omegaconf import OmegaConf

    from planning.partition import build_plan
    from plugins.data.batcher import Batch
    from plugins.models import get_model
    from plugins.objectives import get_objective
    from plugins.parallel.layout import build_layout
    from runtime.metrics import MemoryProbe, MetricsWindow
    from runtime.optim import build_optimizer
    from runtime.step import StepSettings, train_step
    from tests.conftest import make_cfg

    _, _, _, folder = trained
    trainer = _trl_trainer(name, trl_policy(folder, adapters), folder, tmp_path)
    inputs, labels = rows_of(next(iter(trainer.get_train_dataloader())))
    trainer.train()
    theirs = [entry for entry in trainer.state.log_history if "loss" in entry]

    spec = get_objective(name)
    objective = spec.loss(OmegaConf.merge(OmegaConf.structured(spec.config), SETTINGS[name]))
    cfg = make_cfg("model=llama_tiny", "parallel=single", f"optimizer.lr={LR}", "optimizer.schedule=constant",
                   "optimizer.betas=[0.9,0.999]", "train.grad_clip=1.0", "tracking=none", "train.seed=1234",
                   *(["peft=lora", "peft.rank=4", "peft.alpha=8", f"train.init_from=hf:{folder}"] if adapters else []))
    layout = build_layout(cfg, build_plan(cfg.model, cfg.parallel, cfg.peft), get_model("llama"), torch.device("cpu"),
                          objective=objective)
    layout.parts[0].load_state_dict(hf.load_state(folder), strict=False)
    optimizer = build_optimizer(cfg.optimizer, layout.parts[0])
    batch = Batch(inputs, labels, 1.0, 1.0)
    window, probe = MetricsWindow(layout), MemoryProbe(torch.device("cpu"))
    for step in range(3):
        window.add(train_step(layout, [optimizer], batch, step, LR, StepSettings.of(cfg), probe))
    ours = window.flush()
    assert len(theirs) == len(ours) == 3
    compared = [m for m in objective.names if m in theirs[0]]
    assert len(compared) == len(objective.names), set(objective.names) - set(compared)  # TRL logs each of ours
    for step, (want, got) in enumerate(zip(theirs, ours)):
        assert got["loss"] == pytest.approx(want["loss"], abs=1e-5), (step, got, want)
        for m in compared:
            assert got[m] == pytest.approx(want[m], rel=1e-5, abs=1e-5), (step, m)
    assert ours[-1]["rewards/margins"] > ours[0]["rewards/margins"]  # it learned to prefer the chosen


def test_an_empty_pair_counts_for_nothing_in_every_pair_objective():
    """A held-out batch's rows past the split's last are empty pairs (no token): every objective of pairs gives the
    same loss and measures with them as without, finite values and gradients (ORPO's odds of an empty row's mean
    log-probability 0 would be log(1 - e^0) = -inf)."""
    from omegaconf import OmegaConf

    from plugins.data.batcher import Batch
    from plugins.objectives import get_objective, objective_names
    from plugins.objectives.reference import REFERENCE
    from plugins.objectives.spec import PAIR

    rows = torch.tensor([[-5.0, 3], [-9, 4], [-4, 2], [-7, 3]])
    with_empty = torch.cat([rows, torch.zeros(2, 2)]).requires_grad_()
    reference = torch.tensor([-4.5, -9.5, -4.0, -6.0, 0.0, 0.0], dtype=torch.float64)
    labels = torch.tensor([[1, 2, 3, IGNORED]] * 4 + [[IGNORED] * 4] * 2)
    for name in objective_names():
        spec = get_objective(name)
        if spec.rows != PAIR:
            continue
        loss = spec.loss(OmegaConf.merge(OmegaConf.structured(spec.config), SETTINGS.get(name, {})))
        inputs = reference if REFERENCE in spec.row_inputs else None
        assert loss.count(Batch(labels, labels, 1.0, 1.0, examples=2)) == 2
        alone = loss(rows, None if inputs is None else inputs[:4])
        measures = loss.take()
        both = loss(with_empty, inputs)
        assert both.item() == pytest.approx(alone.item()) and torch.allclose(loss.take(), measures), name
        both.backward()
        assert torch.isfinite(with_empty.grad).all() and (with_empty.grad[4:] == 0).all(), name
