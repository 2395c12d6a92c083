"""The batcher: a corpus -> global training batches.

Batches are a pure function of (seed, step): every layout, every resume and every dp rank sees the same
global batch for the same step, with no loader state to save.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from plugins.data import shards
from plugins.data import tokenizer as tokenizers
from plugins.data.registry import Corpus, get_source, split_named


@dataclass
class Batch:
    inputs: torch.Tensor         # (B, T) token ids; <pad> where a short document ended
    labels: torch.Tensor         # (B, T) next token ids; -100 where there is nothing to predict
    input_density: float         # share of real (non-padding) input tokens
    label_density: float         # share of labels that enter the loss

    @property
    def n_labels(self) -> int:
        return int((self.labels != -100).sum())


class Batcher:
    """Global batches for a step (train) or an index (eval), the same on every rank and every resume."""

    def __init__(self, corpus: Corpus, batch_size: int, seq_len: int, seed: int):
        self.corpus, self.batch_size, self.seq_len, self.seed = corpus, batch_size, seq_len, seed
        for split in ("train", "val"):
            longest = max(len(d) for d in getattr(corpus, split))
            if corpus.packed and longest < seq_len + 1:
                raise ValueError(f"the {split} split holds {longest} tokens, fewer than train.seq_len+1="
                                 f"{seq_len + 1}: use more data or a shorter train.seq_len")

    def train_batch(self, step: int) -> Batch:
        return self._batch(self.corpus.train, (self.seed, 0, step))

    def eval_batch(self, index: int) -> Batch:
        return self._batch(self.corpus.val, (self.seed, 1, index))

    def _batch(self, docs: list[np.ndarray], key: tuple[int, ...]) -> Batch:
        rng = np.random.default_rng(key)
        T = self.seq_len
        rows = np.full((self.batch_size, T + 1), self.corpus.pad, dtype=np.int64)
        real = np.zeros((self.batch_size, T + 1), dtype=bool)
        for r in range(self.batch_size):
            doc = docs[rng.integers(len(docs))] if len(docs) > 1 else docs[0]
            if len(doc) >= T + 1:
                start = rng.integers(0, len(doc) - T)
                rows[r] = doc[start:start + T + 1]
                real[r] = True
            else:
                rows[r, :len(doc)] = doc
                real[r, :len(doc)] = True
        tokens = torch.from_numpy(rows)
        inputs, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
        labels[torch.from_numpy(~real[:, 1:])] = -100
        return Batch(inputs, labels, float(real[:, :-1].mean()), float(real[:, 1:].mean()))


def encoded(cfg) -> tuple[dict[str, list[np.ndarray]], int, int, Optional[tokenizers.Tokenizer]]:
    """The experiment's documents, split and tokenized with data.tokenizer (or the source's own tokens):
    ({"train": docs, "val": docs}, vocabulary, pad id, tokenizer). What the tokenize stage writes to shards."""
    source = get_source(cfg.data.name)
    if source.tokens is not None:
        corpus = source.tokens(cfg.data, cfg.model.vocab_size)
        return {"train": corpus.train, "val": corpus.val}, corpus.vocab_size, corpus.pad, None
    train, val = split_named(source.documents(cfg.data), cfg.data)
    tok = tokenizers.make(cfg.data, train)
    return {"train": tok.encode_documents(train), "val": tok.encode_documents(val)}, tok.vocab_size, tok.pad, tok


def tokenized(cfg) -> Corpus:
    """The corpus in memory (what the tokenize stage's shards hold), packed or per document as data.packing says."""
    splits, vocab, pad, _ = encoded(cfg)
    if cfg.data.packing:
        splits = {k: [np.concatenate(v)] for k, v in splits.items()}
    return Corpus(splits["train"], splits["val"], vocab, cfg.data.packing, pad)


def build_batcher(cfg, tokens: Optional[Path] = None) -> Batcher:
    """The batcher of an experiment: the tokenize stage's shards (memory-mapped) when given, else the corpus
    tokenized in memory; batch, sequence length and seed from cfg.train."""
    corpus = shards.read(tokens, cfg.data.packing) if tokens is not None else tokenized(cfg)
    return Batcher(corpus, cfg.train.batch_size, cfg.train.seq_len, cfg.train.seed)


def data_fingerprint(cfg) -> str:
    """Changes whenever the experiment's data changes (enters the cache keys of stages that read data)."""
    return get_source(cfg.data.name).fingerprint(cfg.data)
