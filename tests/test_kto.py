"""KTO (plugins/objectives/kto.py) against TRL's KTOTrainer: from the walk-through's tiny chat Llama, on TRL's own
collated batch of four unpaired arithmetic records every step (two desirable, two not; TRL's KL rows beside them), the
project's train step (runtime/step.py: AdamW, constant lr, gradients clipped at 1) in one process gives TRL's logged
loss and every measure TRL logs that KTO names, at each of three steps, with the whole model trained and with LoRA.
The reference is online in both (TRL's copy of the starting model, or the policy with its adapters off; ours the base
model's rows). The records tokenize as TRL tokenizes them, and the batcher's mismatched rows are TRL's KL rows."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from plugins.data import tokenizer as tokenizers
from plugins.models.head_loss import IGNORED
from storage import hf
from tests.test_dpo import LR, pairs, row_logps, trained, trl_policy  # noqa: F401  (trained: the tiny model, made once)

SETTINGS = {"beta": 0.1, "desirable_weight": 1.2, "undesirable_weight": 0.8}


def records(n: int) -> list[dict]:
    """The walk-through's pairs unpaired: the right sum (desirable) for even records, the near miss for odd ones."""
    return [{"prompt": p["prompt"], "completion": p["chosen"] if i % 2 == 0 else p["rejected"], "label": i % 2 == 0}
            for i, p in enumerate(pairs(n))]


def rows(ids: torch.Tensor, completion: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's sequences as our rows: the inputs and their next tokens where TRL's completion_mask keeps them."""
    return ids[:, :-1], ids[:, 1:].masked_fill(completion[:, 1:] == 0, IGNORED)


@pytest.mark.parametrize("adapters", [False, True], ids=["full", "lora"])
def test_three_steps_give_trls_losses_and_measures(trained, tmp_path, adapters):  # noqa: F811
    import datasets
    import transformers
    from omegaconf import OmegaConf
    from trl import KTOConfig, KTOTrainer

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
    args = KTOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, max_steps=3, bf16=False,
                     learning_rate=LR, lr_scheduler_type="constant", report_to=[], save_strategy="no", use_cpu=True,
                     seed=0, logging_steps=1, disable_tqdm=True, max_grad_norm=1.0, **SETTINGS)
    trainer = KTOTrainer(model=trl_policy(folder, adapters), args=args, processing_class=
                         transformers.AutoTokenizer.from_pretrained(folder),
                         train_dataset=datasets.Dataset.from_list(records(4)))
    collated = next(iter(trainer.get_train_dataloader()))
    if not adapters:
        _tokenized_and_mismatched_as_trl(trainer, collated, folder)
    trainer.train()
    theirs = [entry for entry in trainer.state.log_history if "loss" in entry]

    start = hf.load_state(folder)
    inputs, labels = rows(collated["input_ids"], collated["completion_mask"])
    kl_inputs, kl_labels = rows(collated["KL_input_ids"], collated["KL_completion_mask"])
    with torch.no_grad():
        reference, kl_reference = (row_logps(start, x, y)[:, 0].double() for x, y in ((inputs, labels),
                                                                                       (kl_inputs, kl_labels)))
    label = collated["label"].double()
    drawn = np.arange(len(inputs))
    batch = Batch(inputs, labels, 1.0, 1.0, drawn=drawn, row_inputs=torch.stack([reference, label], 1),
                  mismatched=Batch(kl_inputs, kl_labels, 1.0, 1.0, drawn=drawn,
                                   row_inputs=torch.stack([kl_reference, label], 1)))
    spec = get_objective("kto")
    objective = spec.loss(OmegaConf.merge(OmegaConf.structured(spec.config), SETTINGS))
    cfg = make_cfg("model=llama_tiny", "parallel=single", f"optimizer.lr={LR}", "optimizer.schedule=constant",
                   "optimizer.betas=[0.9,0.999]", "train.grad_clip=1.0", "tracking=none", "train.seed=1234",
                   *(["peft=lora", "peft.rank=4", "peft.alpha=8", f"train.init_from=hf:{folder}"] if adapters else []))
    layout = build_layout(cfg, build_plan(cfg.model, cfg.parallel, cfg.peft), get_model("llama"), torch.device("cpu"),
                          objective=objective)
    layout.parts[0].load_state_dict(start, strict=False)
    optimizer = build_optimizer(cfg.optimizer, layout.parts[0])
    window, probe = MetricsWindow(layout), MemoryProbe(torch.device("cpu"))
    for step in range(3):
        window.add(train_step(layout, [optimizer], batch, step, LR, StepSettings.of(cfg), probe))
    ours = window.flush()
    assert len(theirs) == len(ours) == 3
    assert set(objective.names) <= set(theirs[0])  # TRL logs each of ours
    for step, (want, got) in enumerate(zip(theirs, ours)):
        assert got["loss"] == pytest.approx(want["loss"], abs=1e-5), (step, got, want)
        for m in objective.names:  # kl: the difference of two sums of ~40 nats, each rounded in fp32 (~1e-5)
            assert got[m] == pytest.approx(want[m], rel=1e-5, abs=1e-4 if m == "kl" else 1e-5), (step, m)
    assert ours[-1]["kl"] > 0  # the estimate moved off 0 (the policy left its reference), and was used
    assert ours[-1]["rewards/margins"] > ours[0]["rewards/margins"]  # it learned which completions are desirable


def _tokenized_and_mismatched_as_trl(trainer, collated, folder) -> None:
    """Each record's document, read as the tokenize stage reads it (Unpaired: its ids, its completion marked 1 or 2 by
    its label), is TRL's prompt_ids + completion_ids; the batcher's mismatched rows of those rows (each prompt with
    the completion of the record before it) are TRL's KL rows."""
    from omegaconf import OmegaConf

    from plugins.data.batcher import Batcher
    from plugins.data.prompted_records import UNDESIRABLE, Unpaired
    from plugins.data.registry import Corpus

    tok = tokenizers.load_hf(folder)
    tok.chat_template = trainer.processing_class.chat_template
    d = OmegaConf.create({"prompt_field": "prompt", "completion_field": "completion", "label_field": "label"})
    made = []
    for record, want in zip(records(4), trainer.train_dataset):
        ((ids, marks),) = Unpaired(record["prompt"], record["completion"], record["label"], "a record", d).ids(tok)
        assert ids.tolist() == want["prompt_ids"] + want["completion_ids"]
        assert marks.tolist() == [0] * len(want["prompt_ids"]) + [1 if record["label"] else UNDESIRABLE] * \
            len(want["completion_ids"])
        made.append((ids, marks))
    width = collated["KL_input_ids"].shape[1] + 8
    batcher = Batcher(Corpus([ids for ids, _ in made], [made[0][0]], 512, packed=False, pad=0,
                             train_mask=[m for _, m in made], val_mask=[made[0][1]]), 4, width - 1, seed=0,
                      mismatched=True)
    ours = batcher._batch([0] * 4, "train", np.random.default_rng(0), np.arange(4))
    assert ours.marks.tolist() == [1 if r["label"] else UNDESIRABLE for r in records(4)]
    kl_inputs, kl_labels = rows(collated["KL_input_ids"], collated["KL_completion_mask"])
    n = kl_inputs.shape[1]
    assert ours.mismatched.inputs[:, :n].tolist() == kl_inputs.masked_fill(
        collated["KL_attention_mask"][:, :-1] == 0, 0).tolist()
    assert ours.mismatched.labels[:, :n].tolist() == kl_labels.tolist()
    assert (ours.mismatched.labels[:, n:] == IGNORED).all()
