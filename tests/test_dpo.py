"""Preference tuning's pieces against TRL's DPOTrainer (trl, a dev extra): on the walk-through's tiny chat Llama and
arithmetic pairs (the right sum chosen, a wrong one rejected), our label-sparse head's per-row log-probabilities give
TRL's precomputed reference log-probabilities, and after TRL's first step its loss, rewards and gradients for each
loss type, pairs in our order (chosen, rejected, rows 2k and 2k+1)."""
from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from plugins.models.head_loss import IGNORED
from plugins.objectives.dpo import LOSS_TYPES, METRICS, pair_losses
from storage import hf
from tests.conftest import ROOT
from tests.test_hf import ours

BETA = 0.1


def pairs(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        wrong = a + b + rng.choice([-10, -1, 1, 10])
        out.append({"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
                    "chosen": [{"role": "assistant", "content": f"{a + b}."}],
                    "rejected": [{"role": "assistant", "content": f"{wrong}."}]})
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """TRL's trainer after one step from the tiny model (reference log-probabilities precomputed), and the batch."""
    import datasets
    import transformers
    from trl import DPOConfig, DPOTrainer

    spec = importlib.util.spec_from_file_location("tiny_chat_model", ROOT / "scripts" / "tiny_chat_model.py")
    tiny_chat_model = importlib.util.module_from_spec(spec)  # the walk-through's model (scripts/)
    spec.loader.exec_module(tiny_chat_model)
    folder = tmp_path_factory.mktemp("dpo") / "tiny-llama"
    chats = [[p["prompt"][0], p["chosen"][0]] for p in pairs(64, seed=1)]
    tiny_chat_model.make(folder, chats)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    args = DPOConfig(output_dir=str(folder.parent / "trl"), per_device_train_batch_size=4, max_steps=1, bf16=False,
                     learning_rate=1e-3, lr_scheduler_type="constant", beta=BETA, precompute_ref_log_probs=True,
                     report_to=[], save_strategy="no", use_cpu=True, seed=0, dataloader_drop_last=True,
                     disable_tqdm=True)
    trainer = DPOTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(pairs(4)),
                         processing_class=tokenizer)
    batch = next(iter(trainer.get_train_dataloader()))
    start = hf.load_state(folder)
    trainer.train()
    return trainer, batch, start


def rows_of(batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL's batch ([chosen..., rejected...]) as our rows (chosen, rejected of each pair in turn): inputs, labels
    (the next token where it is a completion token), and the reference log-probabilities in the same order."""
    ids, completion = batch["input_ids"], batch["completion_mask"]
    order = torch.stack([torch.arange(len(ids) // 2), torch.arange(len(ids) // 2) + len(ids) // 2], 1).reshape(-1)
    labels = ids[:, 1:].masked_fill(completion[:, 1:] == 0, IGNORED)
    reference = torch.cat([batch["ref_chosen_logps"], batch["ref_rejected_logps"]])
    return ids[order, :-1], labels[order], reference[order]


def row_logps(state: dict, inputs, labels) -> torch.Tensor:
    model = ours("llama", state)
    model.per_row = True
    return model(inputs, labels=labels)


def test_the_heads_row_logprobs_are_trls_reference_logprobs(trained):
    _, batch, start = trained
    inputs, labels, reference = rows_of(batch)
    with torch.no_grad():
        rows = row_logps(start, inputs, labels)
    assert rows[:, 1].tolist() == (labels != IGNORED).sum(1).tolist()
    assert (rows[:, 0] - reference).abs().max().item() <= 1e-5


def as_ours(model, tensors: dict, folder) -> dict:
    """Tensors named as transformers names `model`'s parameters, named as ours (through a saved folder: the
    project's own import)."""
    import copy

    saved = copy.deepcopy(model)
    saved.load_state_dict(tensors, strict=False)
    saved.save_pretrained(folder)
    return hf.load_state(folder)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_each_loss_type_gives_trls_loss_rewards_and_gradients(trained, loss_type, tmp_path):
    trainer, batch, _ = trained
    model = trainer.model.train()
    trainer.loss_types, trainer._metrics["train"] = [loss_type], type(trainer._metrics["train"])(list)
    model.zero_grad()
    want = trainer.compute_loss(model, batch)
    want.backward()
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    want_grads = as_ours(model, {n: p.grad for n, p in model.named_parameters()}, tmp_path / "grads")

    inputs, labels, reference = rows_of(batch)
    policy = ours("llama", as_ours(model, model.state_dict(), tmp_path / "weights")).train()
    policy.per_row = True
    loss, sums = pair_losses(policy(inputs, labels=labels), reference, BETA, loss_type)
    count = len(inputs) // 2  # pairs: the loss is their mean
    (loss / count).backward()
    assert (loss / count).item() == pytest.approx(want.item(), abs=1e-5)
    for name, total in zip(METRICS, sums.tolist()):
        assert total / count == pytest.approx(logged[name], abs=1e-5), name
    for name, p in policy.named_parameters():
        want_grad = want_grads[name]
        assert (p.grad - want_grad).abs().max().item() <= 1e-5 * max(1.0, want_grad.abs().max().item()), name
