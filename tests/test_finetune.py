"""Fine-tuning on prompt/completion records (data.format=prompt_completion), packed as whole records or one a row: only the completion's tokens (and the
<eos> after it) enter the loss, the prompt's labels are -100, as TRL's completion_only_loss; checked against the
records themselves and against a plain `transformers` loop on a tiny random GPT-2 and Llama."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from plugins.data.batcher import build_batcher
from plugins.data.corpus import tokenized
from tests.conftest import make_cfg, run_cli
from tests.test_chat import CHATML, hf_tokenizer  # noqa: F401 (a fixture: a tokenizer folder with a ChatML template)
from tests.test_hf import FAMILIES, saved

import transformers  # noqa: E402  (the [hf] extra, part of .[dev])

EOS, PAD = 256, 257  # data.tokenizer=bytes


def records(path: Path, n: int = 300, seed: int = 0) -> dict[bytes, int]:
    """Arithmetic questions and answers of varied lengths; returns each document's bytes -> its prompt's length."""
    rng = random.Random(seed)
    prompts = {}
    with open(path, "w") as f:
        for _ in range(n):
            a, b = rng.randint(0, 999), rng.randint(0, 99)
            prompt, completion = f"Q: what is {a} plus {b}?" + " please" * rng.randint(0, 3) + "\nA:", f" {a + b}."
            f.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
            prompts[(prompt + completion).encode()] = len(prompt.encode())
    return prompts


def args(path: Path, packing: bool, seq_len: int = 48) -> list[str]:
    """packing: rows of whole records (data.packing_strategy=auto picks bfd for records), else one record a row."""
    return ["data=text", f"data.paths=[{path}]", "data.format=prompt_completion", f"data.packing={packing}",
            f"train.seq_len={seq_len}", "train.batch_size=8"]


def runs(numbers: list[int]) -> list[tuple[int, int]]:
    """The [start, end) of each document's run in a row's document numbers (padding left out)."""
    bounds = [t for t in range(1, len(numbers)) if numbers[t] != numbers[t - 1]]
    return [(a, e) for a, e in zip([0, *bounds], [*bounds, len(numbers)]) if numbers[a] != -1]


@pytest.mark.parametrize("packing,mixed", [(False, False), (True, False), (True, True)],
                         ids=["padded", "packed", "packed-mix"])
def test_only_the_completions_and_their_eos_are_learned(tmp_path, packing, mixed):
    prompts = records(tmp_path / "qa.jsonl")
    data = args(tmp_path / "qa.jsonl", packing, seq_len=64 if packing else 48)
    if mixed:  # two sources of records mixed by weight (data.mix), each with its masks
        prompts |= records(tmp_path / "qb.jsonl", seed=1)
        data = [a for a in data if not a.startswith("data.paths")] + \
            [f"data.mix=[{{paths:[{tmp_path}/qa.jsonl],weight:0.5}},{{paths:[{tmp_path}/qb.jsonl],weight:0.5}}]"]
    cfg = make_cfg(*data, runs_dir=tmp_path)
    corpora = tokenized(cfg) if mixed else [tokenized(cfg)]
    stream = [(int(t), bool(m)) for corpus in corpora for doc, mask in zip(corpus.train, corpus.train_mask)
              for t, m in zip(doc, mask)]
    documents, current = 0, []
    for token, trained in stream:  # every document is a record: its prompt untrained, its completion and <eos> trained
        current.append((token, trained))
        if token == EOS:
            text = bytes(t for t, _ in current[:-1])
            assert [m for _, m in current] == [False] * prompts[text] + [True] * (len(current) - prompts[text])
            documents, current = documents + 1, []
    assert documents == sum(len(corpus.train) for corpus in corpora)

    batch = build_batcher(cfg).train_batch(0)
    assert not mixed or set(batch.sources.tolist()) == {0, 1}
    assert 0 < batch.label_density < 0.5  # the answers are short beside the questions
    checked = 0
    for r, (inputs, labels) in enumerate(zip(batch.inputs.tolist(), batch.labels.tolist())):
        if packing:  # whole records side by side (each shorter than a row), the label after each <eos> unlearned
            for a, e in runs(batch.documents[r].tolist()):
                doc = inputs[a:e] + ([] if inputs[e - 1] == EOS else [labels[e - 1]])
                prompt = prompts[bytes(doc[:-1])]
                assert doc[-1] == EOS and labels[a:a + len(doc) - 1] == \
                    [doc[t + 1] if t + 1 >= prompt else -100 for t in range(len(doc) - 1)]
                assert inputs[e - 1] != EOS or labels[e - 1] == -100
                checked += 1
            continue
        if EOS not in labels:
            continue  # a long record cut to the row
        doc = inputs[:labels.index(EOS) + 1] + [EOS]  # a whole record in the row, then padding
        prompt = prompts.get(bytes(doc[:-1]))
        if prompt is None:
            continue  # the end of a record longer than a row: a window of it
        assert labels == [doc[t + 1] if t + 1 >= prompt else -100 for t in range(len(doc) - 1)] + \
            [-100] * (len(labels) - len(doc) + 1)
        checked += 1
    assert checked >= (8 if packing else 4)


def hf_inputs(documents: torch.Tensor) -> dict:
    """What transformers takes for rows of whole documents: position_ids restarting at each document and a 4-D
    additive mask, causal within a document (padding, numbered -1, attends to itself)."""
    T = documents.shape[1]
    begins = torch.ones_like(documents, dtype=torch.bool)
    begins[:, 1:] = documents[:, 1:] != documents[:, :-1]
    at = torch.arange(T)
    allowed = (documents[:, :, None] == documents[:, None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    return {"position_ids": at - torch.where(begins, at, 0).cummax(1).values,
            "attention_mask": torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[:, None]}


def plain_loop(model, batcher, steps: int, lr: float) -> list[float]:
    """transformers' model trained by plain SGD on the batcher's rows of whole records (what requires a gradient),
    the prompts' labels -100, position_ids restarting per document, a block-diagonal causal mask: its losses."""
    model.train()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for step in range(steps):
        batch = batcher.train_batch(step)
        assert (batch.labels != -100).sum() < (batch.labels != PAD).sum() - (batch.inputs == PAD).sum()
        assert batch.documents.max() >= 1  # rows of several records
        logits = model(batch.inputs, **hf_inputs(batch.documents)).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.labels.reshape(-1), ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("family", list(FAMILIES))
def test_ten_steps_of_packed_records_equal_a_transformers_loop(tmp_path, family):
    """The whole pipeline (tokenize, train from the Hugging Face weights, in this process) on rows of whole records
    against transformers' own model trained by a plain loop on the same rows, with the prompts' labels -100,
    position_ids restarting per document and a block-diagonal causal mask: the per-step losses agree to 1e-5."""
    records(tmp_path / "qa.jsonl")
    folder = saved(family, tmp_path / "hf")
    steps, lr = 10, 0.05
    overrides = [*FAMILIES[family][0], *args(tmp_path / "qa.jsonl", packing=True, seq_len=96),
                 f"train.init_from=hf:{folder}",
                 f"train.steps={steps}", "train.eval_every=0", "train.checkpoint_every=0", "train.grad_clip=0",
                 "optimizer=sgd", f"optimizer.lr={lr}", "optimizer.momentum=0", "optimizer.schedule=constant",
                 "optimizer.weight_decay=0", "optimizer.warmup_steps=0", "cluster=debug", "tracking=none", "dry_run=false"]
    work = tmp_path / "work"
    work.mkdir()
    result = run_cli(overrides, work, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (metrics,) = (work / "runs" / "cache" / "train").glob("*/metrics.jsonl")
    ours = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]

    batcher = build_batcher(make_cfg(*overrides, runs_dir=tmp_path / "plain"))
    theirs = plain_loop(transformers.AutoModelForCausalLM.from_pretrained(folder), batcher, steps, lr)
    assert len(ours) == steps
    assert max(abs(a - b) for a, b in zip(ours, theirs)) <= 1e-5, (ours, theirs)
    assert theirs[-1] < theirs[0]


@pytest.mark.parametrize("turns_end_with_eos", [True, False])
def test_chat_records_learn_what_apply_chat_template_marks_as_the_assistants(tmp_path, hf_tokenizer,
                                                                             turns_end_with_eos):
    """data.format=chat with an HF tokenizer folder's ChatML template: each document is the rendered chat's ids as
    transformers' apply_chat_template gives them; what is learned is its assistant mask. ChatML ends each turn with
    the tokenizer's eos (<|im_end|>), which the mask holds after an answer: nothing is appended. A template whose
    turns end otherwise gets an <eos> after the chat, learned after an answer."""
    hf, folder = hf_tokenizer
    template = CHATML if turns_end_with_eos else CHATML.replace("<|im_end|>", "\n\n")
    (tmp_path / "turns.jinja").write_text(template)
    rng = random.Random(0)
    chats = [[{"role": "user", "content": f"Add {a} and {b}."}, {"role": "assistant", "content": f"{a + b}."}]
             for a, b in ((rng.randint(0, 99), rng.randint(0, 99)) for _ in range(200))]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    expected = {}
    for chat in chats:
        theirs = hf.apply_chat_template(chat, chat_template=template, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
        ids, mask = list(theirs["input_ids"]), list(theirs["assistant_masks"])
        assert ids.count(hf.eos_token_id) == (2 if turns_end_with_eos else 0)
        expected[tuple(ids if turns_end_with_eos else ids + [hf.eos_token_id])] = mask if turns_end_with_eos \
            else mask + [1]
    cfg = make_cfg("data=text", f"data.paths=[{tmp_path}/chats.jsonl]", "data.format=chat",
                   f"data.tokenizer=hf:{folder}", f"data.chat_template={tmp_path}/turns.jinja", "data.packing=false", "train.seq_len=32", "train.batch_size=4",
                   runs_dir=tmp_path)
    corpus = tokenized(cfg)
    documents = list(zip(corpus.train, corpus.train_mask)) + list(zip(corpus.val, corpus.val_mask))
    assert len(documents) == len(chats)
    for ids, trained in documents:
        assert trained.astype(int).tolist() == expected[tuple(ids.tolist())]
