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
from plugins.data.corpus import sources_of, tokenized
from plugins.data.registry import Corpus, get_source
from storage import file_hashes


@dataclass
class Batch:
    inputs: torch.Tensor         # (B, T) token ids; <pad> where a short document ended
    labels: torch.Tensor         # (B, T) next token ids; -100 where there is nothing to predict
    input_density: float         # share of real (non-padding) input tokens
    label_density: float         # share of labels that enter the loss
    sources: Optional[np.ndarray] = None   # a mixture's source of each row (data.mix)

    @property
    def n_labels(self) -> int:
        return int((self.labels != -100).sum())


class Batcher:
    """Global batches for a step (train) or an index (eval), the same on every rank and every resume. A mixture
    (several corpora and their weights) draws each row's source by weight first, from the same generator."""

    def __init__(self, corpus, batch_size: int, seq_len: int, seed: int, weights: Optional[list[float]] = None):
        self.corpus, self.batch_size, self.seq_len, self.seed = corpus, batch_size, seq_len, seed
        mixture = isinstance(corpus, list)
        corpora = corpus if mixture else [corpus]
        if mixture != (weights is not None) or (mixture and len(weights) != len(corpora)):
            raise ValueError(f"a mixture of corpora needs one weight per corpus, a single corpus none ({len(corpora)} "
                             f"corpora, weights {weights})")
        self.weights = np.asarray(weights, dtype=np.float64) / sum(weights) if mixture else None
        for i, c in enumerate(corpora):
            for split in ("train", "val") if c.packed else ():
                longest = max(len(d) for d in getattr(c, split))
                if longest < seq_len + 1:
                    where = f"source {i}'s " if self.weights is not None else "the "
                    raise ValueError(f"{where}{split} split holds {longest} tokens, fewer than train.seq_len+1="
                                     f"{seq_len + 1}: use more data or a shorter train.seq_len")
        self.pad = corpora[0].pad

    def train_batch(self, step: int) -> Batch:
        return self._draw("train", (self.seed, 0, step))

    def eval_batch(self, index: int) -> Batch:
        return self._draw("val", (self.seed, 1, index))

    def _draw(self, split: str, key: tuple[int, ...]) -> Batch:
        rng = np.random.default_rng(key)
        if self.weights is None:
            return self._batch([self.corpus] * self.batch_size, split, rng)
        sources = rng.choice(len(self.weights), size=self.batch_size, p=self.weights)
        batch = self._batch([self.corpus[s] for s in sources], split, rng)
        batch.sources = sources
        return batch

    def _batch(self, corpora: list[Corpus], split: str, rng: np.random.Generator) -> Batch:
        """Rows drawn from each row's corpus's split: a window of a document (a packed stream is one), padded when
        short. A label enters the loss where its token is real and, in a masked corpus, trained (the completion)."""
        T = self.seq_len
        rows = np.full((self.batch_size, T + 1), self.pad, dtype=np.int64)
        real = np.zeros((self.batch_size, T + 1), dtype=bool)
        trained = np.ones((self.batch_size, T + 1), dtype=bool)
        for r, corpus in enumerate(corpora):
            pool, masks = getattr(corpus, split), getattr(corpus, f"{split}_mask")
            i = rng.integers(len(pool)) if len(pool) > 1 else 0
            doc = pool[i]
            start = rng.integers(0, len(doc) - T) if len(doc) >= T + 1 else 0
            window = doc[start:start + T + 1]
            rows[r, :len(window)] = window
            real[r, :len(window)] = True
            if masks is not None:
                trained[r, :len(window)] = masks[i][start:start + T + 1]
        tokens = torch.from_numpy(rows)
        inputs, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
        learned = real[:, 1:] & trained[:, 1:]
        labels[torch.from_numpy(~learned)] = -100
        return Batch(inputs, labels, float(real[:, :-1].mean()), float(learned.mean()))


def build_batcher(cfg, tokens: Optional[Path] = None) -> Batcher:
    """The batcher of an experiment: the tokenize stage's shards (memory-mapped) when given, else the corpus
    tokenized in memory; batch, sequence length and seed from cfg.train; a data.mix's weights."""
    corpus = shards.read_all(tokens, cfg.data.packing) if tokens is not None else tokenized(cfg)
    mix = cfg.data.get("mix") or []
    if not mix:
        corpus = corpus[0] if isinstance(corpus, list) else corpus
    return Batcher(corpus, cfg.train.batch_size, cfg.train.seq_len, cfg.train.seed,
                   [float(m.weight) for m in mix] if mix else None)


def data_fingerprint(cfg) -> str:
    """Changes whenever the experiment's data changes (enters the cache keys of stages that read data): each
    corpus's (a data.mix has several). Files are hashed again only when their stamps changed, remembered in the
    cache (storage/file_hashes.py)."""
    source = get_source(cfg.data.name)

    def prints() -> str:
        return "+".join(source.fingerprint(sub.data) for sub in sources_of(cfg))

    cache = Path(cfg.cache_dir).expanduser()
    if not cache.is_dir():  # nothing is written before the cache exists (a first dry run)
        return prints()
    with file_hashes.remembering(cache / ".verified" / "files.json"):
        return prints()
