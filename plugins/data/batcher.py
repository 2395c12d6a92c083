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
from plugins.data.corpus import tokenized
from plugins.data.registry import Corpus, get_source
from storage import file_hashes


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
        for split in ("train", "val") if corpus.packed else ():
            longest = max(len(d) for d in getattr(corpus, split))
            if longest < seq_len + 1:
                raise ValueError(f"the {split} split holds {longest} tokens, fewer than train.seq_len+1="
                                 f"{seq_len + 1}: use more data or a shorter train.seq_len")

    def train_batch(self, step: int) -> Batch:
        return self._batch(self.corpus.train, (self.seed, 0, step))

    def eval_batch(self, index: int) -> Batch:
        return self._batch(self.corpus.val, (self.seed, 1, index))

    def _batch(self, docs, key: tuple[int, ...]) -> Batch:
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


def build_batcher(cfg, tokens: Optional[Path] = None) -> Batcher:
    """The batcher of an experiment: the tokenize stage's shards (memory-mapped) when given, else the corpus
    tokenized in memory; batch, sequence length and seed from cfg.train."""
    corpus = shards.read(tokens, cfg.data.packing) if tokens is not None else tokenized(cfg)
    return Batcher(corpus, cfg.train.batch_size, cfg.train.seq_len, cfg.train.seed)


def data_fingerprint(cfg) -> str:
    """Changes whenever the experiment's data changes (enters the cache keys of stages that read data). Files are
    hashed again only when their stamps changed, remembered in the cache (storage/file_hashes.py)."""
    cache = Path(cfg.cache_dir).expanduser()
    if not cache.is_dir():  # nothing is written before the cache exists (a first dry run)
        return get_source(cfg.data.name).fingerprint(cfg.data)
    with file_hashes.remembering(cache / ".verified" / "files.json"):
        return get_source(cfg.data.name).fingerprint(cfg.data)
