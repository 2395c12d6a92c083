"""Rows of whole documents (data.packing_strategy=bfd): what a row holds, and what the model makes of it. A packed
row's tokens get the losses they get alone: attention stays within a document, positions restart at each, and the
label across a boundary is not learned. (Across layouts: tests/test_layouts.py's Llama runs train on such rows; against
transformers: tests/test_finetune.py.)"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from plugins.data.batcher import Batcher
from plugins.data.packing import PADDING, LongDocument, plan_rows, rank_tokens, repack
from plugins.data.registry import Corpus
from plugins.models.registry import get_model
from plugins.models.transformer import init_weights, set_attention
from tests.conftest import make_cfg
from tests.test_hf import FAMILIES


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("kernel", ["sdpa", "flex", "math"])  # flex: forward only on a CPU (gpu_tests trains it)
def test_a_row_of_three_documents_gives_each_token_the_loss_it_has_alone(family, kernel):
    cfg = make_cfg(*FAMILIES[family][0])
    model = get_model(cfg.model.name).build(cfg.model)
    init_weights(model, cfg.model, seed=0)
    set_attention(model.eval(), kernel)
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 256, (n,), generator=g) for n in (7, 12, 9)]
    row = torch.cat(docs)[None]
    numbers = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])[None]
    with torch.no_grad():
        packed = F.log_softmax(model(row, documents=numbers), -1)
        alone = torch.cat([F.log_softmax(model(d[None]), -1) for d in docs], 1)
        crossed = F.log_softmax(model(row), -1)  # the same row without boundaries: later documents differ
    assert (packed - alone).abs().max() <= 1e-5
    assert (crossed - alone)[:, 7:].abs().max() > 1e-2


def corpus_of(lengths: list[int]) -> Corpus:
    """Documents whose tokens are all different (a label names the token before it): 0, 1, 2, ... in order."""
    ends = np.cumsum(lengths)
    docs = [np.arange(e - n, e) for e, n in zip(ends, lengths)]
    return Corpus(docs, docs[:2], int(ends[-1]) + 1, packed=False, pad=-5)


def test_rows_hold_whole_documents_and_every_label_is_learned_once():
    rng = np.random.default_rng(0)
    lengths = [int(n) for n in rng.lognormal(2.5, 0.8, 300).clip(2, 200)]  # some longer than a row: cut in pieces
    corpus, capacity = corpus_of(lengths), 33
    plan = plan_rows(corpus.train, capacity, split_long=True, split="train")
    learned = []
    for r in range(len(plan)):
        pieces = list(plan.row(r))
        assert sum(int(plan.length[p]) for p in pieces) <= capacity
        for p in pieces:
            d, s, n = int(plan.doc[p]), int(plan.start[p]), int(plan.length[p])
            learned += list(zip(corpus.train[d][s:s + n - 1], corpus.train[d][s + 1:s + n]))
    everything = [pair for doc in corpus.train for pair in zip(doc[:-1], doc[1:])]
    assert sorted(learned) == sorted(everything)  # each label once: pieces overlap by one token, no more
    assert sum(lengths) / (len(plan) * capacity) > 0.95  # best-fit decreasing leaves little room unused

    batch = Batcher(corpus, 16, capacity - 1, seed=3, whole_documents="split").train_batch(0)
    for inputs, labels, numbers in zip(batch.inputs.tolist(), batch.labels.tolist(), batch.documents.tolist()):
        for t, (x, y) in enumerate(zip(inputs, labels)):
            if y != -100:  # a learned label is the next token of the same document
                assert y == x + 1 and numbers[t] != PADDING
            elif numbers[t] != PADDING and t + 1 < len(inputs) and numbers[t + 1] == numbers[t]:
                raise AssertionError(f"a label inside a document is not learned: {inputs[t:t + 2]}")


def test_a_document_longer_than_a_row_is_refused_when_splitting_is_off(tmp_path):
    """A record by the tokenize stage, naming its file and line (train.seq_len then enters that stage's key); any
    document, the files of plain text included, by the train stage before its first step, naming its number."""
    import json

    from plugins.data.corpus import tokenized
    from stages.tokenize import STAGE as TOKENIZE

    records = tmp_path / "sums.jsonl"
    lines = [{"prompt": f"{i}+{i}=", "completion": str(2 * i)} for i in range(40)]
    lines[2]["completion"] = "a long answer " * 4
    records.write_text("".join(json.dumps(r) + "\n" for r in lines))
    data = ["data=text", f"data.paths=[{records}]", "data.format=prompt_completion", "data.long_documents=refuse"]
    with pytest.raises(ValueError) as e:
        tokenized(make_cfg(*data, "train.seq_len=32", runs_dir=tmp_path))
    assert f"{records}: line 3: a document of 61 tokens is longer than a row (train.seq_len+1=33)" in str(e.value)
    assert "fix: data.long_documents=split" in str(e.value) and "train.seq_len=60 or more" in str(e.value)
    assert tokenized(make_cfg(*data, "train.seq_len=60", runs_dir=tmp_path))
    keys = {TOKENIZE.fingerprint(make_cfg(*data, f"train.seq_len={n}", runs_dir=tmp_path)) for n in (32, 60)}
    splitting = {TOKENIZE.fingerprint(make_cfg(*data, "data.long_documents=split", f"train.seq_len={n}",
                                               runs_dir=tmp_path)) for n in (32, 60)}
    assert len(keys) == 2 and len(splitting) == 1

    big = tmp_path / "big.txt"  # a text file read in three pieces, each shorter than a row, the whole longer
    big.write_bytes(b"a line of text\n" * 170_000)
    with pytest.raises(ValueError, match=f"{big}: a document of 2,097,1[0-9]{{2}} tokens and more is longer than"):
        tokenized(make_cfg("data=text", f"data.paths=[{big}]", "data.packing_strategy=bfd",
                           "data.long_documents=refuse", "train.seq_len=1500000", runs_dir=tmp_path))

    with pytest.raises(LongDocument) as e:
        Batcher(corpus_of([10, 40, 5, 50]), 2, 32, seed=0, whole_documents="refuse")
    assert "document 1 of the train split holds 40 tokens" in str(e.value)
    assert "data.long_documents=split" in str(e.value) and "2 such document(s)" in str(e.value)


@pytest.mark.parametrize("ranks", [2, 4])
def test_padded_rows_are_dealt_so_that_ranks_hold_equal_real_tokens(ranks):
    """One document a row (data.packing=false) of long-tailed lengths: the same rows as the plain draw, ordered so
    that each data-parallel rank's slice holds about the same real tokens (max/mean <= 1.1 over 20 steps)."""
    rng = np.random.default_rng(1)
    corpus = corpus_of([int(n) for n in rng.lognormal(4.0, 1.0, 2000).clip(4, 500)])
    plain, balanced = (Batcher(corpus, 32, 256, seed=0, ranks=ranks, balance_ranks=b) for b in (False, True))
    spread = {False: [], True: []}
    for step in range(20):
        a, b = plain.train_batch(step), balanced.train_batch(step)
        assert sorted(a.inputs.tolist()) == sorted(b.inputs.tolist())
        assert sorted(zip(a.inputs.tolist(), a.labels.tolist())) == sorted(zip(b.inputs.tolist(), b.labels.tolist()))
        for was, batch in ((False, a), (True, b)):
            tokens = rank_tokens(batch.real, ranks)
            spread[was].append(tokens.max() / tokens.mean())
    assert np.mean(spread[True]) <= 1.1 < np.mean(spread[False])


def test_a_ranks_padded_rows_packed_give_every_token_its_logits():
    """data.balance_ranks: a rank's rows of one document each, padded, packed into fewer rows with a document mask
    (plugins/data/packing.repack): the same logits for every learned label, in fewer, narrower rows."""
    cfg = make_cfg(*FAMILIES["llama"][0])
    model = get_model(cfg.model.name).build(cfg.model)
    init_weights(model.eval(), cfg.model, seed=0)
    rng = np.random.default_rng(2)
    corpus = corpus_of([int(n) for n in rng.lognormal(2.5, 0.8, 200).clip(2, 100)])
    corpus.train, corpus.pad = [d % 256 for d in corpus.train], 0
    batch = Batcher(corpus, 8, 48, seed=0).train_batch(0)
    inputs, labels, documents = repack(batch.inputs, batch.labels, batch.real, multiple=8, groups=2)
    assert inputs.shape[0] % 2 == 0 and inputs.numel() < batch.inputs.numel()
    assert sorted(labels[labels != -100].tolist()) == sorted(batch.labels[batch.labels != -100].tolist())
    with torch.no_grad():
        padded, packed = model(batch.inputs), model(inputs, documents=documents)
    at = {}
    for row in range(len(documents)):  # where each source row's tokens went
        for t, d in enumerate(documents[row].tolist()):
            if d != PADDING:
                at.setdefault(d, []).append((row, t))
    for d, places in at.items():
        got = torch.stack([packed[row, t] for row, t in places])
        assert (got - padded[d, :len(places)]).abs().max() <= 1e-5
