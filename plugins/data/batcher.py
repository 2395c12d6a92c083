"""The batcher: a corpus -> global training batches.

Batches are a pure function of (seed, step): every layout, every resume and every dp rank sees the same
global batch for the same step, with no loader state to save. Training draws its examples in epochs, each a
permutation seeded by (seed, epoch) (plugins/data/epochs.py): every example once an epoch. The held-out evaluation
takes the held-out split's examples in one seeded order, each once (Batcher.eval_batches).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from common.problem import InputFault
from plugins.data import shards
from plugins.data.corpus import sources_of, tokenized
from plugins.data.epochs import drawn as epoch_order
from plugins.data.epochs import permuted
from plugins.data.packing import (PADDING, balances_ranks, deal, deal_pairs, packed_stream, plan_rows,
                                  whole_documents)
from plugins.data.registry import get_source
from storage import file_hashes


@dataclass
class Batch:
    inputs: torch.Tensor         # (B, T) token ids; <pad> where a short document ended
    labels: torch.Tensor         # (B, T) next token ids; -100 where there is nothing to predict
    input_density: float         # share of real (non-padding) input tokens
    label_density: float         # share of labels that enter the loss
    sources: Optional[np.ndarray] = None   # a mixture's source of each row (data.mix)
    documents: Optional[torch.Tensor] = None  # (B, T) each input's document in rows of whole documents (bfd)
    real: Optional[np.ndarray] = None      # (B,) each row's real (non-padding) input tokens
    drawn: Optional[np.ndarray] = None     # (B,) each row's document in its split (rows of one document each)
    row_inputs: Optional[torch.Tensor] = None  # (B,) float64: each row's input the objective asked for (its
    #                                            provider's: the reference model's log-probability of the row)
    examples: Optional[int] = None         # the examples it holds (rows, or pairs), fewer than its rows where a
    #                                        held-out pass ran past the split's last (empty rows); None: every row's
    marks: Optional[np.ndarray] = None     # (B,) each row's mark, its tokens' largest mask value (an unpaired
    #                                        record's label: 1 desirable, 2 undesirable; 0: an empty row)
    mismatched: Optional["Batch"] = None   # each example's prompt with the previous example's completion (KTO's
    #                                        KL rows: scored, not learned), in the order drawn

    def example_count(self, per: int) -> int:
        """Its examples, each `per` rows (a preference pair: 2)."""
        return self.examples if self.examples is not None else self.inputs.shape[0] // per

    @property
    def n_labels(self) -> int:
        return int((self.labels != -100).sum())


class Batcher:
    """Global batches for a step (train) or an index (eval), the same on every rank and every resume. A mixture
    (several corpora and their weights) draws each row's source by weight first, from the same generator.
    whole_documents ("split" or "refuse", data.long_documents): rows hold whole documents (plugins/data/packing.py)
    instead of a window of a packed stream or one document each. balance_ranks: the rows are ordered so that each
    of `ranks` data-parallel ranks' slices holds about the same real tokens (data.balance_ranks: one document a row,
    padded, whose lengths vary). pairs: the corpus holds preference pairs (documents 2k and 2k+1: chosen and
    rejected, plugins/data/preference.py): a batch draws batch_size/2 of them, each pair's rows next to each other
    (rows 2r and 2r+1) and dealt to ranks whole. row_inputs: what the objective takes with each row, per split a
    value a document (the reference stage's log-probabilities), given with the rows that hold it, or a function
    that computes a batch's (an online reference)."""

    def __init__(self, corpus, batch_size: int, seq_len: int, seed: int, weights: Optional[list[float]] = None,
                 whole_documents: Optional[str] = None, ranks: int = 1, balance_ranks: bool = False,
                 pairs: bool = False, row_inputs=None, mismatched: bool = False):
        if pairs and (batch_size % 2 or weights is not None or whole_documents):
            raise ValueError("preference pairs take an even batch of rows, one corpus and rows of one document each")
        if mismatched and (pairs or weights is not None or whole_documents):
            raise ValueError("mismatched rows pair one corpus's records of one document a row")
        self.pairs, self.row_inputs, self.mismatched = pairs, row_inputs, mismatched
        self.corpus, self.batch_size, self.seq_len, self.seed = corpus, batch_size, seq_len, seed
        self.ranks = ranks if balance_ranks and batch_size % ranks == 0 else 1
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
                    raise InputFault(f"{where}{split} split holds {longest} tokens, fewer than train.seq_len+1="
                                     f"{seq_len + 1}: use more data or a shorter train.seq_len")
        self.pad = corpora[0].pad
        self.rows = [{split: plan_rows(getattr(c, split), seq_len + 1, whole_documents == "split", split)
                      for split in ("train", "val")} for c in corpora] if whole_documents else None
        for i in range(len(corpora)):
            for split in ("train", "val"):
                if not self.examples(i, split):  # (the tokenize stage keeps one document in each: not reached)
                    raise InputFault(f"the {split} split of {f'source {i}' if mixture else 'the corpus'} holds no "
                                     f"example to draw: use more data or another data.val_fraction")

    def train_batch(self, step: int) -> Batch:
        return self._draw("train", (self.seed, 0, step), step)

    def eval_batch(self, index: int, with_inputs: bool = True) -> Batch:
        """Held-out batch `index`: the held-out examples at positions index*units ... of one seeded order (rows past
        the split's last are empty). with_inputs=False: without the objective's per-row inputs (a pass that does not
        take them: the held-out next-token loss), which an online provider would compute for nothing."""
        return self._draw("val", (self.seed, 1, index), index, with_inputs=with_inputs)

    def eval_batches(self, limit: int) -> int:
        """The held-out batches an evaluation of at most `limit` batches takes: as many as score each held-out
        example once, or `limit` where that is fewer (a mixture, whose rows draw their source by weight: `limit`)."""
        if isinstance(self.corpus, list):
            return limit
        return min(limit, -(-self.examples(0, "val") // self.units()))

    def examples(self, source: int, split: str) -> int:
        """The examples of a corpus's split that rows draw: its pairs, its rows of whole documents, its packed
        stream's windows of train.seq_len tokens (each window's last token the next one's first), or its documents."""
        corpus = self.corpus[source] if isinstance(self.corpus, list) else self.corpus
        pool = getattr(corpus, split)
        if self.rows is not None:
            return len(self.rows[source][split])
        if self.pairs:
            return len(pool) // 2
        if corpus.packed:
            return max((len(pool[0]) - 1) // self.seq_len, 1)
        return len(pool)

    def units(self) -> int:
        """The examples a batch holds: its rows, or its pairs."""
        return self.batch_size // 2 if self.pairs else self.batch_size

    def pairs_in_order(self, split: str, first: int) -> Batch:
        """Pairs first, first+1, ... of a split (the first ones again past its last, to fill the batch), as a drawn
        batch holds them: a reference pass over every pair (stages/reference.py)."""
        pairs = (first + np.arange(self.batch_size // 2)) % self.pair_count(split)
        return self._draw(split, (self.seed, 2, first), picks=pairs)

    def pair_count(self, split: str) -> int:
        return len(getattr(self.corpus, split)) // 2

    def _draw(self, split: str, key: tuple[int, ...], index: int = 0, picks: Optional[np.ndarray] = None,
              with_inputs: bool = True) -> Batch:
        rng = np.random.default_rng(key)
        sources = rng.choice(len(self.weights), size=self.batch_size, p=self.weights) if self.weights is not None \
            else None
        if picks is None:  # each unit's example (a row's, or a pair's): batch `index`'s
            picks = self._picks(split, index, sources)
        batch = self._batch(sources if sources is not None else [0] * self.batch_size, split, rng, picks)
        batch.sources = sources
        if self.ranks > 1:
            order = (deal_pairs if self.pairs else deal)(batch.real, self.ranks)
            pick = torch.from_numpy(order)
            batch.inputs, batch.labels, batch.real = batch.inputs[pick], batch.labels[pick], batch.real[order]
            batch.sources = sources[order] if sources is not None else None
            batch.drawn = batch.drawn[order] if batch.drawn is not None else None
            batch.marks = batch.marks[order]
        if with_inputs and callable(self.row_inputs):  # computed for each batch (objective.reference=online)
            batch.row_inputs = self.row_inputs(batch)
            if batch.mismatched is not None:
                batch.mismatched.row_inputs = self.row_inputs(batch.mismatched)
        elif with_inputs and self.row_inputs is not None:
            held = batch.drawn >= 0  # (an empty row past a held-out split's last: nothing to compare)
            values = np.zeros(len(batch.drawn), dtype=np.float64)
            values[held] = self.row_inputs[split][batch.drawn[held]]
            batch.row_inputs = torch.from_numpy(values)
        return batch

    def _picks(self, split: str, index: int, sources: Optional[np.ndarray]) -> np.ndarray:
        """Each unit's example (a row's, or a pair's) in batch `index` of a split: training's in epochs of the
        split's examples, the held-out split's in one seeded order, -1 past its last; a mixture's row at its
        position among all rows in its own source's order (no example twice within as many rows as the source
        holds; its source drawn by weight)."""
        units = self.units()
        rows = index * units + np.arange(units)
        if sources is not None:
            picks = np.empty(units, dtype=np.int64)
            for s in np.unique(sources).tolist():
                here = sources == s
                picks[here] = epoch_order(rows[here], self.examples(s, split), self.seed, int(split == "val"))
            return picks
        n = self.examples(0, split)
        if split == "train":
            return epoch_order(rows, n, self.seed)
        return np.where(rows < n, permuted(np.minimum(rows, n - 1), n, self.seed, 0, stream=1), -1)

    def _batch(self, sources, split: str, rng: np.random.Generator, picks: np.ndarray) -> Batch:
        """Rows drawn from each row's corpus's split, each unit's example its pick (-1: an empty row): a window of a
        document (a packed stream's pick-th window), padded when short, or a row of whole documents. A label enters
        the loss where its token is real, in a masked corpus trained (the completion), and in a row of documents of
        the same document as its input. Each row's mark is its tokens' largest mask value (an unpaired record's
        label); with mismatched rows, those of the examples in the order drawn."""
        T = self.seq_len
        rows = np.full((self.batch_size, T + 1), self.pad, dtype=np.int64)
        real = np.zeros((self.batch_size, T + 1), dtype=bool)
        trained = np.ones((self.batch_size, T + 1), dtype=bool)
        documents = np.full((self.batch_size, T + 1), PADDING, dtype=np.int64) if self.rows is not None else None
        corpora = self.corpus if isinstance(self.corpus, list) else [self.corpus]
        drawn = np.zeros(self.batch_size, dtype=np.int64)
        marks = np.zeros(self.batch_size, dtype=np.int64)
        examples = 0
        for r, s in enumerate(sources):
            pool, masks = getattr(corpora[s], split), getattr(corpora[s], f"{split}_mask")
            pick = int(picks[r // 2] if self.pairs else picks[r])
            if pick < 0:  # past the held-out split's last example: an empty row
                drawn[r] = -1
                continue
            examples += 1 if not self.pairs or r % 2 == 0 else 0
            if self.rows is not None:
                plan = self.rows[s][split]
                at = 0
                for n, p in enumerate(plan.row(pick)):
                    i, start, length = int(plan.doc[p]), int(plan.start[p]), int(plan.length[p])
                    self._place(r, at, pool[i], masks[i] if masks is not None else None, start, length, rows, real,
                                trained)
                    documents[r, at:at + length] = n
                    at += length
                continue
            if self.pairs:  # a pair's chosen in the even row, its rejected in the odd one after it, from their start
                i = 2 * pick if r % 2 == 0 else drawn[r - 1] + 1
            else:
                i = 0 if corpora[s].packed else pick
            doc, drawn[r] = pool[i], i
            if corpora[s].packed:  # the pick-th window of the stream
                start = pick * T
            else:  # a document longer than a row: a window of it at random
                start = rng.integers(0, len(doc) - T) if len(doc) >= T + 1 and not (self.pairs or self.mismatched) \
                    else 0  # (a record's row keeps its start: TRL's max_length truncation)
            length = min(T + 1, len(doc) - start)
            self._place(r, 0, doc, masks[i] if masks is not None else None, start, length, rows, real, trained)
            if masks is not None and length:
                marks[r] = int(np.max(masks[i][start:start + length]))
        mismatched = self._mismatched(getattr(corpora[0], split), getattr(corpora[0], f"{split}_mask"), drawn) \
            if self.mismatched else None
        batch = self._rows_batch(rows, real, trained, documents, drawn, examples)
        if mismatched is not None:  # (each the row of its example: its record's label)
            mismatched.marks = marks.copy()
        batch.marks, batch.mismatched = marks, mismatched
        return batch

    def _rows_batch(self, rows, real, trained, documents, drawn, examples) -> Batch:
        """Placed rows of T+1 tokens as a Batch: inputs, and labels where a token is real and learned."""
        tokens = torch.from_numpy(rows)
        inputs, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
        learned = real[:, 1:] & trained[:, 1:]
        if documents is not None:  # the label after a document's last token is the next document's first
            learned &= documents[:, 1:] == documents[:, :-1]
        labels[torch.from_numpy(~learned)] = -100
        return Batch(inputs, labels, float(real[:, :-1].mean()), float(learned.mean()),
                     documents=None if documents is None else torch.from_numpy(documents[:, :-1].copy()),
                     real=real[:, :-1].sum(axis=1), drawn=None if self.rows is not None else drawn,
                     examples=examples)

    def _mismatched(self, pool, masks, drawn) -> Batch:
        """Each held example's prompt with the whole completion of the held example drawn before it (the last one's
        for the first), cut at the row: TRL's KL completions, rotated by one within the batch (KTOTrainer's
        KL_completion_ids, truncated to max_length after they are joined). Empty rows stay empty."""
        T = self.seq_len
        held = np.flatnonzero(drawn >= 0)
        rows = np.full((len(drawn), T + 1), self.pad, dtype=np.int64)
        real, trained = np.zeros(rows.shape, dtype=bool), np.zeros(rows.shape, dtype=bool)
        for r, q in zip(held, np.roll(held, 1)):
            own, other = drawn[r], drawn[q]
            prompt = pool[own][:_first_learned(masks[own])]
            ids = np.concatenate([prompt, pool[other][_first_learned(masks[other]):]])[:T + 1]
            rows[r, :len(ids)], real[r, :len(ids)], trained[r, len(prompt):len(ids)] = ids, True, True
        return self._rows_batch(rows, real, trained, None, drawn.copy(), len(held))

    @staticmethod
    def _place(r, at, doc, mask, start, length, rows, real, trained) -> None:
        """Tokens [start, start+length) of a document (and of its mask) into row r from column `at`."""
        rows[r, at:at + length] = doc[start:start + length]
        real[r, at:at + length] = True
        if mask is not None:
            trained[r, at:at + length] = mask[start:start + length]


def _first_learned(mask) -> int:
    """Where a document's completion starts: its first learned token (its length when none is)."""
    learned = np.flatnonzero(np.asarray(mask))
    return int(learned[0]) if len(learned) else len(mask)


def build_batcher(cfg, tokens: Optional[Path] = None, row_inputs=None) -> Batcher:
    """The batcher of an experiment: the tokenize stage's shards (memory-mapped) when given, else the corpus
    tokenized in memory; batch, sequence length and seed from cfg.train; a data.mix's weights; rows grouped as the
    objective says (plugins/objectives/spec.py: pairs drawn whole, mismatched rows beside each batch); the objective's
    per-row inputs where given."""
    from plugins.objectives.spec import PAIR, objective_of

    spec = objective_of(cfg)
    corpus = shards.read_all(tokens, packed_stream(cfg.data)) if tokens is not None else tokenized(cfg)
    mix = cfg.data.get("mix") or []
    if not mix:
        corpus = corpus[0] if isinstance(corpus, list) else corpus
    return Batcher(corpus, cfg.train.batch_size, cfg.train.seq_len, cfg.train.seed,
                   [float(m.weight) for m in mix] if mix else None, whole_documents(cfg.data), cfg.parallel.dp,
                   balances_ranks(cfg.data), spec.rows == PAIR, row_inputs, spec.mismatched(cfg.objective))


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
