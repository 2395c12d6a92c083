"""Token shards on disk, Megatron's indexed-dataset shape: the tokenize stage's tasks each append one part, and an
index names the parts, which are read back by memory map as one corpus (no copy, no corpus in RAM).

  part-00000/train.bin  val.bin   the documents' tokens, each document ending in <eos>, back to back (uint16 when
                                  the vocabulary fits, else uint32; raw, no header: what memory-map readers expect)
  part-00000/train.idx  val.idx   Megatron's index (plugins/data/indexed_dataset.py): each document that ends in
                                  this part one sequence, from where the one before ends (a document may begin in
                                  the part before: a big text file read by two tasks); so each part's split is a
                                  Megatron indexed dataset megatron-core reads (prefix part-00000/train), masks aside
  part-00000/train.mask val.mask  uint8, one per token: 1 where its label enters the loss (written only when the
                                  records say which tokens the model learns, data.format=prompt_completion or
                                  chat)
  part-00000/train.ends val.ends  int64, where each document ends, while the part is written (made the .idx at close)
  part-00000/part.json            the part's token and document counts (written last: the part is complete)
  index.json                      dtype, counts, vocabulary, <eos>/<pad> ids, tokenizer kind, the parts in order
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from plugins.data import bad_records
from plugins.data.indexed_dataset import read_corpus, read_index, write_index_of_ends
from plugins.data.registry import Corpus
from storage.fsio import atomic_write_json, read_json

INDEX = "index.json"
PART = "part.json"
SPLITS = ("train", "val")


def dtype_for(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def part_name(task: int) -> str:
    return f"part-{task:05d}"


class PartWriter:
    """Appends documents to one part as they are tokenized: what it holds is a batch, never the corpus."""

    def __init__(self, folder: Path, vocab_size: int, attempt: str = "", masked: bool = False):
        self.folder, self.attempt, self.masked = Path(folder), attempt, masked
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / PART).unlink(missing_ok=True)
        self.dtype = dtype_for(vocab_size)
        self.files = {s: open(self.folder / f"{s}.bin", "wb") for s in SPLITS}
        self.ends = {s: open(self.folder / f"{s}.ends", "wb") for s in SPLITS}
        self.masks = {s: open(self.folder / f"{s}.mask", "wb") for s in SPLITS} if masked else {}
        self.tokens = dict.fromkeys(SPLITS, 0)
        self.documents = dict.fromkeys(SPLITS, 0)

    def append(self, split: str, ids: np.ndarray, closes: bool, trained: Optional[np.ndarray] = None) -> None:
        """A document's tokens (or a piece of it); closes: it ends here (its <eos> is in ids); trained (a masked
        part): which of them the model learns."""
        self.files[split].write(np.asarray(ids, dtype=self.dtype).tobytes())
        if self.masked:
            learned = trained if trained is not None else np.ones(len(ids))
            self.masks[split].write(np.asarray(learned, np.uint8).tobytes())
        self.tokens[split] += len(ids)
        if closes:
            self.ends[split].write(np.int64(self.tokens[split]).tobytes())
            self.documents[split] += 1

    def close(self, **extra) -> dict:
        for f in (*self.files.values(), *self.ends.values(), *self.masks.values()):
            f.close()
        for split in SPLITS:  # the documents' ends as Megatron's index
            ends = self.folder / f"{split}.ends"
            write_index_of_ends(str(self.folder / split), self.dtype, _memmap(ends, np.dtype(np.int64)))
            ends.unlink()
        summary = {"attempt": self.attempt, "masked": self.masked, **extra,
                   **{s: {"tokens": self.tokens[s], "documents": self.documents[s]} for s in SPLITS}}
        atomic_write_json(self.folder / PART, summary)  # last: a part with part.json is complete
        return summary


def write_index(folder: Path, parts: list[str], vocab_size: int, eos: int, pad: int, kind: str, **extra) -> dict:
    folder = Path(folder)
    summaries = [read_json(folder / p / PART) for p in parts]
    index = {"dtype": dtype_for(vocab_size).name, "vocab_size": vocab_size, "eos": eos, "pad": pad, "tokenizer": kind,
             "parts": parts, "masked": any(s.get("masked") for s in summaries),
             "unlearned": sum(s.get("unlearned", 0) for s in summaries), **extra}  # records with nothing to learn
    if any("pairs_cut" in s for s in summaries):  # preference pairs longer than a row (cut at its end)
        index["pairs_cut"] = sum(s.get("pairs_cut", 0) for s in summaries)
    index.update(bad_records.summed(summaries))  # data.bad_records=skip: how many were left out, the first named
    index.update(_totals(summaries))
    atomic_write_json(folder / INDEX, index)
    return index


def _totals(counts: list[dict]) -> dict:
    """Each split's tokens and documents summed over parts (or over a mixture's sources)."""
    return {s: {k: sum(c[s][k] for c in counts) for k in ("tokens", "documents")} for s in SPLITS}


def move_last_document(folder: Path, index: dict, src: str, dst: str, count: int = 1) -> dict:
    """A corpus too small for its split rule (a few records, none drawn for the held-out split): the last document
    of `src` (the last `count`: a preference pair's two, which one task writes together) moves to the end of `dst`,
    the same one whatever the number of parts. Returns the new index."""
    folder = Path(folder)
    part = next(p for p in reversed(index["parts"]) if read_json(folder / p / PART)[src]["documents"])
    dtype = np.dtype(index["dtype"])
    ends = {split: ends_of(folder / part / split) for split in (src, dst)}
    start, end = (int(ends[src][-count - 1]) if len(ends[src]) > count else 0), int(ends[src][-1])
    tokens = np.array(_memmap(folder / part / f"{src}.bin", dtype)[start:end])
    summary = read_json(folder / part / PART)
    with open(folder / part / f"{dst}.bin", "ab") as f:
        f.write(tokens.tobytes())
    if index.get("masked"):  # the mask moves with its tokens
        trained = np.array(_memmap(folder / part / f"{src}.mask", np.dtype(np.uint8))[start:end])
        with open(folder / part / f"{dst}.mask", "ab") as f:
            f.write(trained.tobytes())
        os.truncate(folder / part / f"{src}.mask", start)
    os.truncate(folder / part / f"{src}.bin", start * dtype.itemsize)
    moved = np.asarray(ends[src][-count:], dtype=np.int64) - start + summary[dst]["tokens"]
    write_index_of_ends(str(folder / part / dst), dtype, np.append(ends[dst], moved))
    write_index_of_ends(str(folder / part / src), dtype, ends[src][:-count])
    index = {**index}
    for counts in (summary, index):  # the part's and the corpus's counts move alike
        for split, sign in ((src, -1), (dst, 1)):
            counts[split] = {"tokens": counts[split]["tokens"] + sign * len(tokens),
                             "documents": counts[split]["documents"] + sign * count}
    atomic_write_json(folder / part / PART, summary)
    atomic_write_json(folder / INDEX, index)
    return index


def ends_of(prefix: Path) -> np.ndarray:
    """Where each document of a part's split ends (in tokens from the part's start), from its Megatron index."""
    return read_index(str(prefix)).document_ends()


def write_mix_index(folder: Path, sources: list[str], indexes: list[dict], **extra) -> dict:
    """The index of a mixture: its sources' folders (each a corpus with an index of its own), in data.mix's order."""
    first = indexes[0]
    index = {k: first[k] for k in ("dtype", "vocab_size", "eos", "pad", "tokenizer")} | {"mix": sources, **extra}
    index.update(bad_records.summed(indexes))
    index.update(_totals(indexes))
    atomic_write_json(Path(folder) / INDEX, index)
    return index


def read_all(folder: Path, packed: bool) -> list[Corpus]:
    """The corpora of a shard folder: one, or a mixture's sources in order."""
    folder = Path(folder)
    index = read_json(folder / INDEX)
    return [read(folder / s, packed) for s in index["mix"]] if "mix" in index else [read(folder, packed, index)]


def write(folder: Path, splits: dict[str, list[np.ndarray]], vocab_size: int, eos: int, pad: int, kind: str) -> dict:
    """Whole documents in memory as one part (sources that are tokens already, e.g. synthetic)."""
    writer = PartWriter(Path(folder) / part_name(0), vocab_size)
    for split, docs in splits.items():
        for doc in docs:
            writer.append(split, doc, True)
    writer.close()
    return write_index(folder, [part_name(0)], vocab_size, eos, pad, kind)


class TokenStream:
    """Several token arrays read as one: len() and slices (a slice across two parts is copied, others are views)."""

    def __init__(self, arrays: Sequence[np.ndarray]):
        self.arrays = [a for a in arrays if len(a)]
        self.starts = np.cumsum([0] + [len(a) for a in self.arrays])
        self.dtype = self.arrays[0].dtype if self.arrays else np.dtype(np.int64)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, key):
        if not isinstance(key, slice):
            return self[key:key + 1][0]
        start, stop, _ = key.indices(len(self))
        if stop <= start:
            return np.zeros(0, self.dtype)
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        last = int(np.searchsorted(self.starts, stop, side="left")) - 1
        pieces = [self.arrays[i][max(start - self.starts[i], 0):stop - self.starts[i]] for i in range(first, last + 1)]
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def __array__(self, dtype=None, copy=None):
        whole = self[:]
        return whole.astype(dtype) if dtype is not None else np.asarray(whole)


class Documents:
    """The documents of a token stream, from the offsets where each ends: len() and [i] (a view when it can)."""

    def __init__(self, stream: TokenStream, ends: np.ndarray):
        self.stream, self.ends = stream, ends

    def __len__(self) -> int:
        return len(self.ends)

    def __getitem__(self, i: int):
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        return self.stream[int(self.ends[i - 1]) if i else 0:int(self.ends[i])]

    def __iter__(self):
        return (self[i] for i in range(len(self)))


def _megatron_corpus(index: dict, packed: bool) -> Corpus:
    """The corpus of Megatron indexed datasets (plugins/data/indexed_dataset.py's index entries), one after another."""
    read = [read_corpus(entry, packed) for entry in index["megatron"]]
    splits = {}
    for split in SPLITS:
        stream = TokenStream([r[split][0] for r in read])
        bases = np.cumsum([0] + [len(r[split][0]) for r in read])
        splits[split] = [stream] if packed else Documents(stream, np.concatenate(
            [r[split][1] + base for r, base in zip(read, bases)]))
    return Corpus(splits["train"], splits["val"], index["vocab_size"], packed, index["pad"])


def _memmap(path: Path, dtype: np.dtype) -> np.ndarray:
    return np.memmap(path, dtype=dtype, mode="r") if path.stat().st_size else np.zeros(0, dtype)


def read(folder: Path, packed: bool, index: Optional[dict] = None) -> Corpus:
    """The corpus of a shard folder, memory-mapped: packed, one stream per split; else its documents."""
    folder = Path(folder)
    index = index or read_json(folder / INDEX)
    if "megatron" in index:  # corpora of Megatron's, read where they are
        return _megatron_corpus(index, packed)
    dtype = np.dtype(index["dtype"])
    splits, masks = {}, {}
    for split in SPLITS:
        tokens = [_memmap(folder / part / f"{split}.bin", dtype) for part in index["parts"]]
        trained = [_memmap(folder / part / f"{split}.mask", np.dtype(np.uint8)) for part in index["parts"]] \
            if index.get("masked") else None
        bases = np.cumsum([0] + [len(t) for t in tokens])  # a part's ends are offsets into it
        ends = None if packed else np.concatenate([ends_of(folder / part / split) + base
                                                   for part, base in zip(index["parts"], bases)])
        splits[split] = [TokenStream(tokens)] if packed else Documents(TokenStream(tokens), ends)
        if trained is not None:  # the same documents (or stream) of masks, token for token
            masks[split] = [TokenStream(trained)] if packed else Documents(TokenStream(trained), ends)
    return Corpus(splits["train"], splits["val"], index["vocab_size"], packed, index["pad"],
                  masks.get("train"), masks.get("val"))
