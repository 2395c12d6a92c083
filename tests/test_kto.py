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
from plugins.objectives.kto import METRICS
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
    assert set(METRICS) <= set(theirs[0]) and all(set(METRICS) <= set(row) for row in ours)  # TRL logs each of ours
    for step, (want, got) in enumerate(zip(theirs, ours)):
        assert got["loss"] == pytest.approx(want["loss"], abs=1e-5), (step, got, want)
        for m in METRICS:  # kl: the difference of two sums of ~40 nats, each rounded in fp32 (~1e-5)
            assert got[m] == pytest.approx(want[m], rel=1e-5, abs=1e-4 if m == "kl" else 1e-5), (step, m)
    assert ours[-1]["kl"] > 0  # the estimate moved off 0 (the policy left its reference), and was used
    assert ours[-1]["rewards/margins"] > ours[0]["rewards/margins"]  # it learned which completions are desirable


def _pairs_unpaired_as_trl(trainer, tok) -> None:
    """Preference pairs under kto (data=preference): each pair's documents, as the tokenize stage writes them
    (Pair: the chosen marked desirable, the rejected undesirable), are the records TRL's KTOTrainer makes of the same
    pairs (unpair_preference_dataset, then its tokenization)."""
    import datasets
    from omegaconf import OmegaConf
    from trl import KTOTrainer

    from plugins.data.prompted_records import Pair

    d = OmegaConf.create({"prompt_field": "prompt", "chosen_field": "chosen", "rejected_field": "rejected"})
    unpaired = KTOTrainer(model=trainer.model, ref_model=trainer.ref_model, args=trainer.args,
                          processing_class=trainer.processing_class,
                          train_dataset=datasets.Dataset.from_list(pairs(4))).train_dataset
    theirs = sorted((r["prompt_ids"] + r["completion_ids"], [0] * len(r["prompt_ids"]) + [
        1 if r["label"] else 2] * len(r["completion_ids"])) for r in unpaired)
    ours = sorted((ids.tolist(), marks.tolist()) for p in pairs(4)
                  for ids, marks in Pair(p["prompt"], p["chosen"], p["rejected"], "a pair", d).ids(tok))
    assert ours == theirs and len(ours) == 8


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
    _pairs_unpaired_as_trl(trainer, tok)
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


def test_drawn_records_keep_their_labels_and_mismatched_rows_when_dealt_to_ranks():
    """Rows of unpaired records dealt to two data-parallel ranks by their real tokens: each row's mark (its label)
    moves with it; the mismatched rows are made in the order drawn, each record's prompt with the completion of the
    record drawn before it, whatever the dealing; a held-out batch's empty rows stay empty in both."""
    from plugins.data.batcher import Batcher
    from plugins.data.prompted_records import UNDESIRABLE
    from plugins.data.registry import Corpus

    rng = np.random.default_rng(0)
    docs, masks = [], []
    for i in range(40):
        prompt, completion = rng.integers(3, 12), rng.integers(2, 20)  # some longer than a row: cut there
        docs.append(np.arange(1000 * i, 1000 * i + prompt + completion))
        masks.append(np.r_[np.zeros(prompt, np.uint8), np.full(completion, 1 if i % 3 else UNDESIRABLE, np.uint8)])
    corpus = Corpus(docs, docs[:3], 64000, packed=False, pad=-5, train_mask=masks, val_mask=masks[:3])
    dealt = Batcher(corpus, 8, 24, seed=1, ranks=2, balance_ranks=True, mismatched=True)
    plain = Batcher(corpus, 8, 24, seed=1, mismatched=True)
    reordered = 0
    for step in range(5):
        batch, drawn = dealt.train_batch(step), plain.train_batch(step)
        assert batch.marks.tolist() == [1 if d % 3 else UNDESIRABLE for d in batch.drawn]
        assert sorted(batch.drawn) == sorted(drawn.drawn)
        reordered += batch.drawn.tolist() != drawn.drawn.tolist()
        assert batch.mismatched.inputs.tolist() == drawn.mismatched.inputs.tolist()  # made before the dealing
        for r, d in enumerate(drawn.drawn):
            before = drawn.drawn[r - 1]
            prompt = docs[d][masks[d] == 0]
            want = np.r_[prompt, docs[before][masks[before] > 0]][:25].tolist()
            assert drawn.mismatched.inputs[r, :len(want) - 1].tolist() == want[:-1]
            learned = drawn.mismatched.labels[r] != IGNORED
            assert learned.sum() == len(want) - len(prompt) and not learned[:len(prompt) - 1].any()
    assert reordered  # the dealing moved rows: their marks went with them
    held_out = Batcher(corpus, 8, 24, seed=1, mismatched=True).eval_batch(0)
    assert (held_out.drawn < 0).sum() == 5 and (held_out.marks[held_out.drawn < 0] == 0).all()
    assert (held_out.mismatched.labels[held_out.drawn < 0] == IGNORED).all()


def test_each_sides_mean_is_over_its_own_records_across_held_out_batches():
    """Two held-out batches, the first all desirable: the logged means of each side are over that side's records of
    both (not each batch's side means weighted by its size), and a side with no record is left out, as TRL does."""
    from plugins.data.batcher import Batch
    from plugins.objectives.kto import KTOLoss

    loss = KTOLoss(beta=1.0, loss_type="apo_zero_unpaired", desirable_weight=1.0, undesirable_weight=1.0)
    logps = {"a": [-1.0, -2.0, -3.0, -4.0], "b": [-5.0, -6.0, -7.0, -8.0]}
    labels = {"a": [1.0, 1.0, 1.0, 1.0], "b": [1.0, 1.0, 0.0, 0.0]}
    count = 0
    for name in ("a", "b"):
        inputs = torch.tensor([[0.0, lab] for lab in labels[name]], dtype=torch.float64)  # reference 0
        count += loss.count(Batch(inputs, inputs, 1.0, 1.0, row_inputs=inputs), None)
        loss(torch.tensor([[v, 3.0] for v in logps[name]]), inputs)
    got = loss.means((loss.take() / count).tolist())
    assert got["logps/chosen"] == pytest.approx((-1 - 2 - 3 - 4 - 5 - 6) / 6)
    assert got["logps/rejected"] == pytest.approx((-7 - 8) / 2) == got["rewards/rejected"]
    assert got["rewards/margins"] == pytest.approx(got["rewards/chosen"] - got["rewards/rejected"])
    loss.count(Batch(inputs, inputs, 1.0, 1.0, row_inputs=torch.ones(4, 2)), None)
    loss(torch.tensor([[-1.0, 3.0]] * 4), torch.ones(4, 2))
    alone = loss.means((loss.take() / 4).tolist())
    assert "rewards/rejected" not in alone and "rewards/margins" not in alone and "rewards/chosen" in alone
