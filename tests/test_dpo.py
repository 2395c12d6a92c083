"""Preference tuning's pieces against TRL's DPOTrainer (trl, a dev extra): on the walk-through's tiny chat Llama and
arithmetic pairs (the right sum chosen, a wrong one rejected), our label-sparse head's per-row log-probabilities give
TRL's precomputed reference log-probabilities, and after TRL's first step its loss, rewards and gradients for each
loss type, pairs in our order (chosen, rejected, rows 2k and 2k+1); and pairs in TRL's three forms (standard,
conversational, implicit prompt) tokenize to TRL's ids with the same learned positions."""
from __future__ import annotations

import importlib.util
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from plugins.data import tokenizer as tokenizers
from plugins.data.preference import pair_ids, split_prompt
from plugins.models.head_loss import IGNORED
from plugins.objectives.dpo import LOSS_TYPES, METRICS, pair_losses
from storage import hf
from tests.conftest import ROOT
from tests.test_hf import ours

BETA = 0.1
LR = 1e-4  # TRL's default is 1e-6: large enough to move the rewards, small enough not to magnify fp32 rounding


def _tiny_chat_model():
    """scripts/tiny_chat_model.py: the walk-through's model and data (scripts/ is no package)."""
    spec = importlib.util.spec_from_file_location("tiny_chat_model", ROOT / "scripts" / "tiny_chat_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TINY_CHAT_MODEL = _tiny_chat_model()


def pairs(n: int, seed: int = 0) -> list[dict]:
    """The walk-through's arithmetic pairs: the right sum chosen, a near miss rejected."""
    return TINY_CHAT_MODEL.preference_pairs(n, seed)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """TRL's trainer after one step from the tiny model (reference log-probabilities precomputed), and the batch."""
    import datasets
    import transformers
    from trl import DPOConfig, DPOTrainer

    folder = tmp_path_factory.mktemp("dpo") / "tiny-llama"
    chats = [[p["prompt"][0], p["chosen"][0]] for p in pairs(64, seed=1)]
    TINY_CHAT_MODEL.make(folder, chats)
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
    return trainer, batch, start, folder


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
    _, batch, start, _ = trained
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
    trainer, batch, _, _ = trained
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


def forms(tokenizer) -> dict[str, list[dict]]:
    """The same pairs in TRL's forms: conversational, standard (texts: the chat rendered, so that tokens merge
    across the boundary where they may), and each with an implicit prompt."""
    conversational = pairs(6, seed=2)
    conversational[0]["chosen"] = [{"role": "assistant", "content": "12 is the sum"}]  # a shared beginning
    conversational[0]["rejected"] = [{"role": "assistant", "content": "12 is not it"}]
    standard = [{"prompt": f"Q: {p['prompt'][0]['content']}\nA:", "chosen": " " + p["chosen"][0]["content"],
                 "rejected": " " + p["rejected"][0]["content"]} for p in conversational]
    standard[1]["chosen"] += tokenizer.eos_token  # closed already: no second <eos>
    standard[2] = {"prompt": "Sum: 4", "chosen": "2", "rejected": "3"}  # "42" may merge across the boundary
    implicit = [{"chosen": p["prompt"] + p["chosen"], "rejected": p["prompt"] + p["rejected"]} for p in standard]
    implicit_chat = [{"chosen": p["prompt"] + p["chosen"], "rejected": p["prompt"] + p["rejected"]}
                     for p in conversational]
    # UltraFeedback's: the prompt's text beside conversations that repeat it (TRL's maybe_extract_prompt reads the
    # messages they share, the text left unread)
    ultrafeedback = [{"prompt": p["prompt"][0]["content"], **c} for p, c in zip(conversational, implicit_chat)]
    return {"conversational": conversational, "standard": standard, "implicit": implicit,
            "implicit-conversational": implicit_chat, "ultrafeedback": ultrafeedback}


def test_every_pair_form_tokenizes_as_trl_tokenizes_it(trained):
    """ids and learned positions of chosen and rejected, read as the tokenize stage reads a record (Pair), equal
    TRL's prompt_ids + chosen_ids (completion_mask) after its maybe_extract_prompt."""
    import datasets
    from omegaconf import OmegaConf
    from trl import maybe_extract_prompt

    from plugins.data.prompted_records import Pair

    trainer, _, _, folder = trained
    tok = tokenizers.load_hf(folder)
    tok.chat_template = trainer.processing_class.chat_template
    d = OmegaConf.create({"prompt_field": "prompt", "chosen_field": "chosen", "rejected_field": "rejected"})
    for form, records in forms(trainer.processing_class).items():
        theirs = trainer._prepare_dataset(datasets.Dataset.from_list(records).map(maybe_extract_prompt),
                                          trainer.processing_class, trainer.args, form)
        for record, want in zip(records, theirs):
            pair = Pair(record.get("prompt"), record["chosen"], record["rejected"], "a record", d)
            got = pair_ids(tok, pair.prompt, pair.chosen, pair.rejected)
            for (ids, learned), completion in zip(got, ("chosen_ids", "rejected_ids")):
                whole = want["prompt_ids"] + want[completion]
                assert ids.tolist() == whole, (form, record)
                assert learned.tolist() == [i >= len(want["prompt_ids"]) for i in range(len(whole))], (form, record)


def test_an_implicit_prompt_is_what_chosen_and_rejected_share():
    messages = [{"role": "user", "content": "Hi"}]
    assert split_prompt(messages + [{"role": "assistant", "content": "a"}],
                        messages + [{"role": "assistant", "content": "b"}])[0] == messages
    assert split_prompt("Q: 2+2? A: 4", "Q: 2+2? A: 5") == ("Q: 2+2? A:", " 4", " 5")
    assert split_prompt("same", "same") == ("same", "", "")


def trl_policy(folder, adapters: bool):
    """The tiny model as TRL's trainers take it; adapters: with peft's adapters on every Linear of the blocks (rank
    4), from our initial A (drawn from its own name; B is zero in both), as the project's peft=lora starts."""
    import peft
    import transformers

    from plugins.models.lora import initial_A
    from storage.hf import LLAMA_NAMES

    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    if not adapters:
        return model
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if (m := re.search(r"\.layers\.(\d+)\.(.+)\.lora_A\.", name)):
                p.copy_(initial_A(f"layers.{m.group(1)}.{LLAMA_NAMES[m.group(2)]}.lora_A", tuple(p.shape), 1234))
    return model


@pytest.mark.parametrize("adapters", [False, True], ids=["full", "lora"])
def test_three_steps_in_the_train_loop_give_trls_losses_and_rewards(trained, tmp_path, adapters):
    """TRL's DPOTrainer from the tiny model (AdamW, constant lr, gradients clipped at 1, reference precomputed) and
    the project's train step (runtime/step.py) in one process, on a batch of the same four pairs every step: the
    loss and TRL's logged measures equal at every step; then the held-out loss and measures of the same pairs
    (runtime/evaluate.eval_loss) equal TRL's evaluation of them. LoRA: peft's adapters on every Linear of the blocks
    (rank 4) from our initial A, TRL's reference the model with its adapters disabled, ours the base's."""
    import datasets
    import transformers
    from trl import DPOConfig, DPOTrainer

    from plugins.data.batcher import Batch
    from plugins.models import get_model
    from plugins.objectives.dpo import DPOLoss
    from plugins.parallel.layout import build_layout
    from planning.partition import build_plan
    from runtime.evaluate import eval_loss
    from runtime.metrics import MemoryProbe, MetricsWindow, step_line
    from runtime.optim import build_optimizer
    from runtime.step import StepSettings, train_step
    from tests.conftest import make_cfg

    _, _, _, folder = trained
    args = DPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, max_steps=3, bf16=False,
                     learning_rate=LR, lr_scheduler_type="constant", beta=BETA, precompute_ref_log_probs=True,
                     report_to=[], save_strategy="no", use_cpu=True, seed=0, logging_steps=1, disable_tqdm=True,
                     max_grad_norm=1.0)
    model = trl_policy(folder, adapters)
    trainer = DPOTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(pairs(4)),
                         processing_class=transformers.AutoTokenizer.from_pretrained(folder))
    collated = next(iter(trainer.get_train_dataloader()))
    inputs, labels, reference = rows_of(collated)
    trainer.train()
    theirs = [entry for entry in trainer.state.log_history if "loss" in entry]
    trainer.model.eval()
    trainer._metrics["eval"].clear()
    with torch.no_grad():
        held_out = trainer.compute_loss(trainer.model, collated).item()
    held_out_measures = {k: v[-1] for k, v in trainer._metrics["eval"].items()}

    cfg = make_cfg("model=llama_tiny", "parallel=single", f"optimizer.lr={LR}", "optimizer.schedule=constant",
                   "optimizer.betas=[0.9,0.999]", "train.grad_clip=1.0", "tracking=none", "train.seed=1234",
                   *(["peft=lora", "peft.rank=4", "peft.alpha=8", f"train.init_from=hf:{folder}"] if adapters else []))
    layout = build_layout(cfg, build_plan(cfg.model, cfg.parallel, cfg.peft), get_model("llama"), torch.device("cpu"),
                          objective=DPOLoss(BETA, "sigmoid"))
    layout.parts[0].load_state_dict(hf.load_state(folder), strict=False)
    optimizer = build_optimizer(cfg.optimizer, layout.parts[0])
    batch = Batch(inputs, labels, 1.0, 1.0, row_inputs=reference)
    window, probe = MetricsWindow(layout), MemoryProbe(torch.device("cpu"))
    for step in range(3):
        window.add(train_step(layout, [optimizer], batch, step, LR, StepSettings.of(cfg), probe))
    ours = window.flush()
    assert len(theirs) == len(ours) == 3 and "| reward acc 1.00 margin " in step_line(ours[-1], 3)
    # a pair row's eval loss is the pairs' loss, named so: never read as the aggregate's next-token loss
    assert step_line({**ours[-1], "eval_loss": 0.5}, 3).endswith("| eval pair loss 0.5000")
    for step, (want, got) in enumerate(zip(theirs, ours)):
        assert got["loss"] == pytest.approx(want["loss"], abs=1e-5), (got, want)
        for name in METRICS[:2] + METRICS[3:] if step == 0 else METRICS:  # step 1's rewards are all 0: ties, which
            assert got[name] == pytest.approx(want[name], rel=1e-5, abs=1e-5), name  # a last bit decides: not compared
    assert ours[-1]["rewards/margins"] > ours[0]["rewards/margins"]
    measures: dict = {}
    held_out_batches = SimpleNamespace(eval_batch=lambda i: batch, eval_batches=lambda n: n)
    assert eval_loss(layout, held_out_batches, 1, measures=measures) == pytest.approx(held_out, abs=1e-5)
    assert measures == pytest.approx({k: held_out_measures[k] for k in METRICS}, rel=1e-5, abs=1e-5)


def test_a_beta_sweep_scores_its_pairs_once_with_transformers_numbers_and_starts_at_log_2(trained, tmp_path):
    """`-m objective.beta=0.1,0.5` on conversational pairs, data-parallel: the reference stage runs for the first
    point only (the second's is a cache hit: its key is the model and the pairs, not beta); its log-probability of
    every document of both splits equals transformers' of the same ids, as the rows hold them (train.seq_len+1 tokens:
    a long pair is cut at the end, as TRL's max_length); each point's first step starts from the reference, so its
    loss is log 2 and its rewards 0, which holds only if every row met its own reference value; the aggregate's check
    of the whole model (its held-out next-token loss against the train stage's) passes. The first point again with
    objective.reference=online (a frozen copy in the train stage, no reference stage) gives the same losses."""
    import json
    import math

    import transformers

    from plugins.data import shards
    from tests.conftest import run_cli

    _, _, _, folder = trained
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in pairs(48, seed=3)))
    seq_len = 26  # shorter than some pairs: they are cut
    args = ["-m", "objective=dpo", "objective.beta=0.1,0.5", "data=preference", f"data.paths=[{data}]",
            "model=llama_tiny", f"train.init_from=hf:{folder}", "parallel=ddp2", "train.steps=2", "train.batch_size=8",
            f"train.seq_len={seq_len}", "train.eval_every=0", "train.eval_batches=1", "train.log_every=1",
            "tracking=none", "aggregate.onnx=false", "sweep.objective=eval_reward_accuracy"]
    result = run_cli(args, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("[reference] reference log-probabilities of ") == 1, result.stdout
    assert "pair(s) longer than a row" in result.stdout and "best eval_reward_accuracy first" in result.stdout
    (entry,) = (tmp_path / "runs" / "cache" / "reference").iterdir()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    (tokens,) = (tmp_path / "runs" / "cache" / "tokenize").iterdir()
    corpus = shards.read_all(tokens / "tokens", False)[0]
    for split in ("train", "val"):
        ours = np.load(entry / f"{split}.npy")
        docs, masks = getattr(corpus, split), getattr(corpus, f"{split}_mask")
        assert len(ours) == len(docs) and len(docs) % 2 == 0
        for doc, mask, value in zip(docs, masks, ours):
            ids = torch.as_tensor(np.asarray(doc[:seq_len + 1], dtype=np.int64))[None]
            with torch.no_grad():
                logps = torch.log_softmax(model(ids[:, :-1]).logits.double(), -1)
            learned = torch.as_tensor(np.asarray(mask[1:seq_len + 1], dtype=bool))
            theirs = logps[0].gather(-1, ids[0, 1:, None])[:, 0][learned].sum().item()
            assert value == pytest.approx(theirs, abs=1e-4), split
    # the same point with the reference computed in the train step by a frozen copy: the same losses
    online = run_cli([a for a in args if a not in ("-m", "objective.beta=0.1,0.5")] +
                     ["objective.beta=0.1", "objective.reference=online"], tmp_path)
    assert online.returncode == 0 and "reference model online: the Hugging Face weights" in online.stdout, \
        online.stdout[-3000:]
    assert not re.search(r"reference\s+│ (ran|cached)", online.stdout)  # no stage
    assert "eval next-token loss " in online.stdout  # the aggregate's: not the train stage's pair loss
    (online_metrics,) = (tmp_path / "runs" / "outputs").rglob("train/output/metrics.jsonl")
    for beta in (0.1, 0.5):
        (metrics,) = [p for p in (tmp_path / "runs" / "multirun").rglob("train/output/metrics.jsonl")
                      if f"objective.beta={beta}" in (p.parents[3] / "config.yaml").read_text()
                      or f"beta: {beta}" in (p.parents[3] / "config.yaml").read_text()]
        lines = metrics.read_text().splitlines()
        if beta == 0.1:
            assert [json.loads(line)["loss"] for line in online_metrics.read_text().splitlines()] == \
                pytest.approx([json.loads(line)["loss"] for line in lines], abs=1e-6)
        first, last = json.loads(lines[0]), json.loads(lines[-1])
        assert first["loss"] == pytest.approx(math.log(2), abs=1e-6) and 0 <= last["eval_rewards/accuracies"] <= 1
        assert json.loads((metrics.parent / "summary.json").read_text())["final_eval_rewards/accuracies"] == \
            last["eval_rewards/accuracies"]
        assert first["rewards/margins"] == pytest.approx(0, abs=1e-6) and first["rewards/accuracies"] == 0
    # continued from the online run's checkpoint, DPO compares with the reference that run started from (its
    # manifest's), not with the checkpoint's own weights (which would give a first step of margins exactly 0)
    checkpoint = online_metrics.parent / "checkpoint"
    assert json.loads((checkpoint / "manifest.json").read_text())["reference"] == {"init_from": f"hf:{folder}"}
    assert (checkpoint / "tokenizer" / "tokenizer.json").is_file()  # carried: data.tokenizer=auto reads it
    kept = [a for a in args if a not in ("-m", "objective.beta=0.1,0.5") and not a.startswith(("train.init_from",
                                                                                                "train.steps"))]
    again = run_cli(kept + ["objective.beta=0.1", "objective.reference=online", "train.steps=3",
                            f"train.init_from={checkpoint}"], tmp_path)
    assert again.returncode == 0 and "reference model online: the Hugging Face weights" in again.stdout, \
        again.stdout[-3000:]
    (continued,) = [p for p in (tmp_path / "runs" / "outputs").rglob("train/output/metrics.jsonl")
                    if p != online_metrics]
    assert json.loads(continued.read_text().splitlines()[0])["step"] == 3  # (steps 1-2 are the checkpoint's)
    assert abs(json.loads(continued.read_text().splitlines()[0])["rewards/margins"]) > 1e-9


def test_a_lora_policy_with_its_adapters_off_scores_as_its_base(tmp_path):
    """objective.reference=online with peft=lora: the policy's own forward with every adapter scaled by 0 (no second
    model) gives each row the log-probability the base model alone gives it, with trained (non-zero) adapters."""
    from planning.partition import build_plan, without_adapters
    from plugins.data.batcher import Batch
    from plugins.models import get_model
    from plugins.models.lora import adapters_off
    from plugins.objectives.dpo import DPOLoss
    from plugins.objectives.reference import ReferenceRows
    from plugins.parallel.layout import build_layout
    from runtime.evaluate import objective_set, row_logps
    from tests.conftest import make_cfg

    cfg = make_cfg("peft=lora", "train.init_from=null", "tracking=none")
    spec, cpu = get_model(cfg.model.name), torch.device("cpu")
    policy = build_layout(cfg, build_plan(cfg.model, cfg.parallel, cfg.peft), spec, cpu,
                          objective=DPOLoss(BETA, "sigmoid"))
    base = build_layout(*without_adapters(cfg), spec, cpu, objective=ReferenceRows())
    base.parts[0].load_state_dict({k: v for k, v in policy.parts[0].state_dict().items() if "lora_" not in k})
    with torch.no_grad():
        for name, p in policy.parts[0].named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0, 0.5)  # trained adapters: the policy differs from its base
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (4, 17), generator=g)
    labels = tokens[:, 1:].clone()
    labels[:, :8] = IGNORED
    batch = Batch(tokens[:, :-1], labels, 1.0, 0.5)
    with adapters_off(policy.parts), objective_set(policy, ReferenceRows()):
        off = row_logps(policy, batch)
    with objective_set(policy, ReferenceRows()):
        on = row_logps(policy, batch)
    assert torch.equal(off, row_logps(base, batch)) and not torch.allclose(on, off)
