"""Data sources (registry) and the batcher that turns their documents into training batches.

A source yields documents as bytes (byte-level tokenized with <eos> and <pad> specials) or, for
`synthetic`, a token stream directly. Batches are a pure function of (seed, step): every layout, every
resume and every dp rank sees the same global batch for the same step, with no loader state to save.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Callable, Optional

import numpy as np
import torch

from plugins.data.tokenizer import EOS, PAD, VOCAB_SIZE as BYTE_VOCAB_SIZE, encode_documents


@dataclass
class Corpus:
    """Token streams of the train and held-out splits (packed), or lists of per-document token arrays."""
    train: list[np.ndarray]
    val: list[np.ndarray]
    vocab_size: int          # tokens ids are < vocab_size
    packed: bool


@dataclass(frozen=True)
class DataSource:
    load: Callable[[object, int], Corpus]
    """(cfg.data, model vocab size) -> Corpus."""
    fingerprint: Callable[[object], str]
    """cfg.data -> a string that changes whenever the underlying data changes (enters cache keys)."""
    vocab_size: Optional[int]
    """vocabulary the source needs from the model, None when it adapts to the model's."""


_SOURCES: dict[str, DataSource] = {}
_plugins_loaded = False


def register_source(name: str, source: DataSource) -> None:
    _SOURCES[name] = source


def get_source(name: str) -> DataSource:
    global _plugins_loaded
    if not _plugins_loaded:
        _plugins_loaded = True
        for ep in entry_points(group="orchestrator.data"):
            ep.load()()
    if name not in _SOURCES:
        raise KeyError(f"data.name={name!r} is not registered; known: {', '.join(sorted(_SOURCES))}")
    return _SOURCES[name]


def split_documents(named_docs: list[tuple[str, bytes]], val_fraction: float):
    """Deterministic held-out split by a hash of each document's name (stable as the corpus grows)."""
    train, val = [], []
    for name, doc in named_docs:
        (val if zlib.crc32(name.encode()) % 10_000 < val_fraction * 10_000 else train).append(doc)
    if not val and len(train) > 1:
        val.append(train.pop())
    return train, val


def corpus_from_documents(named_docs: list[tuple[str, bytes]], cfg) -> Corpus:
    train, val = split_documents(named_docs, cfg.val_fraction)
    if not train or not val:
        raise ValueError(f"data.name={cfg.name}: found {len(named_docs)} document(s); need at least 2 "
                         "(one to train on, one held out)")
    enc_train, enc_val = encode_documents(train), encode_documents(val)
    if cfg.packing:
        enc_train, enc_val = [np.concatenate(enc_train)], [np.concatenate(enc_val)]
    return Corpus(enc_train, enc_val, BYTE_VOCAB_SIZE, cfg.packing)


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
        rows = np.full((self.batch_size, T + 1), PAD, dtype=np.int64)
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


def build_batcher(cfg) -> Batcher:
    """The batcher of an experiment: its data source, the model's vocabulary, train batch/sequence/seed."""
    corpus = get_source(cfg.data.name).load(cfg.data, cfg.model.vocab_size)
    return Batcher(corpus, cfg.train.batch_size, cfg.train.seq_len, cfg.train.seed)


def data_fingerprint(cfg) -> str:
    """Changes whenever the experiment's data changes (enters the cache keys of stages that read data)."""
    return get_source(cfg.data.name).fingerprint(cfg.data)


from plugins.data import sources as _sources  # noqa: E402,F401  (registers the built-in sources)

__all__ = ["Batch", "Batcher", "build_batcher", "data_fingerprint", "Corpus", "DataSource", "EOS", "PAD", "get_source", "register_source"]
