"""Rows of whole documents (data.packing_strategy=bfd): which documents share a row, decided once per split.

A row holds train.seq_len+1 tokens (its inputs and, one to the right, its labels). Documents are placed whole, the
longest first, each into the open row it fills best (best-fit decreasing, TRL's `bfd`); a document longer than a
row is cut into pieces that overlap by one token, so every label is learned exactly once (data.long_documents=split),
or refused (refuse). In the model, attention stays within a document and positions restart at each
(plugins/models/transformer.document_view), and the label across a boundary is not learned: a packed row's tokens
get the losses they would get alone.

The plan depends on the documents' lengths only (no seed), so every rank, layout and resume builds the same one;
the batcher draws rows from it by (seed, step). It holds three int64 per piece (24 bytes a document).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Optional

import numpy as np

from common.problem import InputFault

PADDING = -1  # the document number of a row's padding (a run of its own: it attends only to itself)


class LongDocument(InputFault):
    """A document longer than a row, with data.long_documents=refuse."""


@dataclass
class RowPlan:
    doc: np.ndarray         # per piece, in row order: its document's index in the split
    start: np.ndarray       # where the piece begins in its document
    length: np.ndarray      # its tokens
    row_starts: np.ndarray  # row r's pieces are [row_starts[r], row_starts[r + 1])

    def __len__(self) -> int:
        return len(self.row_starts) - 1

    def row(self, r: int) -> range:
        return range(int(self.row_starts[r]), int(self.row_starts[r + 1]))


def document_lengths(docs) -> np.ndarray:
    """Each document's token count (from a memory-mapped split's end offsets when it has them: no token is read)."""
    ends = getattr(docs, "ends", None)
    if ends is not None:
        return np.diff(np.concatenate([[0], np.asarray(ends, dtype=np.int64)]))
    return np.array([len(d) for d in docs], dtype=np.int64)


def pieces(lengths: np.ndarray, capacity: int, split_long: bool, split: str) -> tuple[np.ndarray, ...]:
    """(doc, start, length) of every piece: a document that fits is one piece; a longer one, pieces of `capacity`
    tokens starting every capacity-1 tokens (the next piece's first input is the last piece's last label)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    long = np.flatnonzero(lengths > capacity)
    if len(long) and not split_long:
        i = int(long[0])
        raise LongDocument(f"data.long_documents=refuse: document {i} of the {split} split holds {lengths[i]:,} "
                           f"tokens, more than a row's train.seq_len+1={capacity:,} ({len(long):,} such document(s))"
                           f"; set data.long_documents=split (pieces that overlap by one token) or a larger "
                           f"train.seq_len")
    counts = np.where(lengths > capacity, -(-(lengths - 1) // (capacity - 1)), 1)
    doc = np.repeat(np.arange(len(lengths)), counts)
    k = np.arange(len(doc)) - np.repeat(np.cumsum(counts) - counts, counts)  # the piece's number in its document
    start = k * (capacity - 1)
    length = np.minimum(capacity, lengths[doc] - start)
    keep = length >= 2  # a piece of one token has no label to learn
    return doc[keep], start[keep], length[keep]


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """The row of each item: the longest first, each into the open row whose free space it fills best (the least
    space that still holds it), a new row when none does. Open rows are kept by free space, with a bit set per
    space that some row has (a Python int): the best fit is the lowest set bit at or above the item's length."""
    row_of = np.empty(len(lengths), dtype=np.int64)
    by_space: dict[int, list[int]] = defaultdict(list)
    spaces = 0
    rows = 0
    for i in np.argsort(-np.asarray(lengths), kind="stable").tolist():
        need = int(lengths[i])
        above = spaces >> need
        if above:
            space = need + (above & -above).bit_length() - 1
            stack = by_space[space]
            row = stack.pop()
            if not stack:
                spaces &= ~(1 << space)
        else:
            row, space = rows, capacity
            rows += 1
        row_of[i] = row
        left = space - need
        if left >= 2:  # a row with less room holds no document with a label
            by_space[left].append(row)
            spaces |= 1 << left
    return row_of


def plan_rows(docs, capacity: int, split_long: bool, split: str) -> RowPlan:
    """The rows of whole documents of one split."""
    doc, start, length = pieces(document_lengths(docs), capacity, split_long, split)
    row_of = best_fit_decreasing(length, capacity)
    order = np.argsort(row_of, kind="stable")  # pieces by row, each row's in document order
    row_starts = np.concatenate([[0], np.cumsum(np.bincount(row_of, minlength=int(row_of.max(initial=-1)) + 1))])
    return RowPlan(doc[order], start[order], length[order], row_starts)


def whole_documents(data) -> Optional[str]:
    """data.long_documents when rows hold whole documents (data.packing with the bfd strategy; auto: for records of
    prompt_completion or chat), else None."""
    if not data.packing:
        return None
    return data.get("long_documents", "split") if packing_strategy(data) == "bfd" else None


def packing_strategy(data) -> str:
    """data.packing_strategy, auto resolved: its record format's (bfd for records of prompt_completion or chat,
    wrapped for text)."""
    from plugins.data.formats.spec import format_of

    strategy = data.get("packing_strategy", "auto")
    return format_of(data).packing_strategy if strategy == "auto" else strategy


def longest_record(cfg) -> Optional[int]:
    """The most tokens a record may hold when a longer one is refused (data.long_documents=refuse, rows of whole
    records): a row's train.seq_len+1. The tokenize stage checks each record against it as it encodes it, naming
    its file and line (train.seq_len then enters that stage's key); None otherwise."""
    if whole_documents(cfg.data) != "refuse":
        return None
    return cfg.train.seq_len + 1


def packed_stream(data) -> bool:
    """Whether rows are windows of one stream per split (data.packing, wrapped): the corpus is read as a stream."""
    return bool(data.packing) and whole_documents(data) is None


def balances_ranks(data) -> bool:
    """Whether padded rows (data.packing=false) are dealt to the ranks by real tokens and packed by each rank
    (data.balance_ranks). runtime/step.py asks the same of the config (it may not import plugins)."""
    return not data.packing and bool(data.get("balance_ranks", True))


def document_rows(data) -> bool:
    """Whether a batch's rows come with each position's document (a mask keeps attention within it): rows of whole
    documents, or padded rows that their rank packs."""
    return whole_documents(data) is not None or balances_ranks(data)


def deal(real: np.ndarray, ranks: int) -> np.ndarray:
    """An order of a batch's rows that gives each of `ranks` equal slices (data-parallel ranks take consecutive
    rows) as equal a share of real tokens as the draw allows: the longest row first, each to the rank with the
    fewest tokens so far that has room (ONNX Runtime's LoadBalancingDistributedBatchSampler's idea). A function of
    the rows alone, so every rank computes the same order."""
    per_rank = len(real) // ranks
    loads, slots = np.zeros(ranks, dtype=np.int64), [[] for _ in range(ranks)]
    for row in np.argsort(-np.asarray(real), kind="stable").tolist():
        open_ranks = [r for r in range(ranks) if len(slots[r]) < per_rank]
        rank = min(open_ranks, key=lambda r: (loads[r], r))
        slots[rank].append(row)
        loads[rank] += real[row]
    return np.array([row for rank in slots for row in rank], dtype=np.int64)


def deal_pairs(real: np.ndarray, ranks: int) -> np.ndarray:
    """deal's order for rows that come in pairs (rows 2k and 2k+1: a preference pair's chosen and rejected): the
    pairs dealt whole by their real tokens, each pair's two rows kept next to each other."""
    real = np.asarray(real)
    pairs = deal(real[0::2] + real[1::2], ranks)
    return np.stack([2 * pairs, 2 * pairs + 1], axis=1).reshape(-1)


def trimmed_width(real, width: int, multiple: int) -> int:
    """The columns padded rows of one document each need: their longest real run rounded up to a multiple, at most
    `width` (the padding after a row's tokens changes no logit before it: attention is causal). Rows whose order
    and count must stay (preference pairs: a row is a completion) lose their padding so, where repack cannot."""
    longest = max((int(n) for n in real), default=1)
    return min(width, -(-max(longest, 1) // multiple) * multiple)


def rank_tokens(real: np.ndarray, ranks: int) -> np.ndarray:
    """The real tokens each data-parallel rank's slice of a batch holds."""
    return np.asarray(real).reshape(ranks, -1).sum(axis=1)


def repack(inputs, labels, real, multiple: int, groups: int = 1):
    """A rank's padded rows of one document each (inputs, labels (rows, T) torch; real: each row's real inputs)
    packed into as few rows as hold their real tokens (best-fit decreasing), each document numbered as in rows of
    whole documents and its (input, label) pairs kept; the rows cut after the fullest one's tokens, rounded up to a
    multiple, and as many rows as a multiple of `groups` (every rank then runs that many microbatches: their
    collectives pair up). With document_view's mask and positions every token gets the logits it gets in its padded
    row, and the rank computes about its real tokens instead of rows x train.seq_len. -> (inputs, labels,
    documents)."""
    import torch  # here: the rest of this module is read at plan time, before torch need be imported

    T = inputs.shape[1]
    real = [int(n) for n in real]
    row_of = best_fit_decreasing(np.maximum(real, 2), T)  # (a row of one real token takes 2: the plan's minimum)
    fill = np.zeros(-(-(int(row_of.max(initial=0)) + 1) // groups) * groups, dtype=np.int64)
    for r, n in enumerate(real):
        fill[row_of[r]] += n
    width = min(T, -(-max(int(fill.max()), 1) // multiple) * multiple)
    x = torch.zeros((len(fill), width), dtype=inputs.dtype)  # padding: its labels are -100, it attends to itself
    y = torch.full((len(fill), width), -100, dtype=labels.dtype)
    documents = torch.full((len(fill), width), PADDING, dtype=torch.int64)
    at = np.zeros(len(fill), dtype=np.int64)
    for r, n in enumerate(real):
        row, a = int(row_of[r]), int(at[row_of[r]])
        x[row, a:a + n], y[row, a:a + n], documents[row, a:a + n] = inputs[r, :n], labels[r, :n], r
        at[row] += n
    return x, y, documents
