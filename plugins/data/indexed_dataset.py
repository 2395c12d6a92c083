"""data=megatron: corpora already tokenized for Megatron-LM / NeMo, read where they are (no copy, no tokenizing).

megatron-core's indexed dataset (`IndexedDataset`, written by its `IndexedDatasetBuilder` and Megatron-LM's
tools/preprocess_data.py) is a pair of files per prefix: `prefix.bin`, the tokens of every sequence back to back
in one dtype, and `prefix.idx`:

  b"MMIDIDX\\x00\\x00"  version (uint64, 1)  dtype code (uint8: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
  6 float64, 7 float32, 8 uint16)  sequence count S (uint64)  document count D+1 (uint64)
  int32[S] each sequence's length in tokens   int64[S] each sequence's byte offset in the .bin
  int64[D+1] the first sequence of each document, then S (a document is a run of sequences; one, unless the corpus
  was split into sentences)   (int8[S] sequence modes, multimodal corpora only: not read)

This module reads and writes those files; the source is plugins/data/sources/megatron.py, its checks before launch
plugins/data/sources/megatron_checks.py. Only the .idx is read, and the .bin's ids once (its smallest and largest,
remembered by the file's stamp); each prefix's last data.val_fraction of documents is held out, as Megatron's split
takes the last documents for validation, and an empty document (no token) is skipped. The tokenizer is the one the
corpus was made with: data.tokenizer=hf:<folder> (or train.init_from's, data.tokenizer=auto).
"""
from __future__ import annotations

import struct
from pathlib import Path
from typing import Iterator, NamedTuple, Optional

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
          8: np.uint16}
HEADER = len(MAGIC) + 8 + 1 + 8 + 8
CHUNK = 64 << 20  # tokens of the .bin read at a time when its ids are looked through
INDEX_CHUNK = 1 << 20  # sequences (or documents) of the .idx read at a time (its temporaries 8 MB, whatever the corpus)


class MegatronError(ValueError):
    """A prefix that is not a whole, readable Megatron indexed dataset: the message names the file and why."""


class Indexed(NamedTuple):
    prefix: Path
    dtype: np.dtype
    lengths: np.ndarray    # int32, tokens of each sequence
    pointers: np.ndarray   # int64, byte offset of each sequence in the .bin
    documents: np.ndarray  # int64, the first sequence of each document, then the sequence count

    @property
    def n_documents(self) -> int:
        return len(self.documents) - 1

    @property
    def n_tokens(self) -> int:
        return self.document_end(self.n_documents - 1) if self.n_documents else 0

    def document_end(self, d: int) -> int:
        """Where document d ends, in tokens from the .bin's start: its last sequence's end (read_index checked that
        the sequences are back to back), or where the one before ends for a document of none."""
        last = int(self.documents[d + 1]) - 1
        return int(self.pointers[last]) // self.dtype.itemsize + int(self.lengths[last]) if last >= 0 else 0

    def document_ends(self, stop: Optional[int] = None, start: int = 0) -> np.ndarray:
        """Where documents start..stop-1 (all: None) end, as document_end: an int64 a document read from the index,
        never an array of all its sequences."""
        last = np.asarray(self.documents[start + 1:None if stop is None else stop + 1], dtype=np.int64) - 1
        at = np.maximum(last, 0)
        return np.where(last >= 0, self.pointers[at] // self.dtype.itemsize + self.lengths[at], 0).astype(np.int64)

    def document_lengths(self, start: int = 0, stop: Optional[int] = None) -> Iterator[np.ndarray]:
        """The tokens of documents start..stop-1 (all: None), INDEX_CHUNK documents at a time (from the index alone:
        its temporaries stay bounded whatever the corpus)."""
        stop = self.n_documents if stop is None else stop
        for a in range(start, stop, INDEX_CHUNK):
            yield np.diff(self.document_ends(min(a + INDEX_CHUNK, stop), a), prepend=self.document_end(a - 1) if a
                          else 0)

    def empty_documents(self, start: int = 0, stop: Optional[int] = None) -> int:
        """How many of documents start..stop-1 hold no token: preprocess_data.py writes an empty text as a document
        of no sequence (it appends <eod> to a document that has tokens only). They are skipped (read_corpus)."""
        return sum(int(np.count_nonzero(n == 0)) for n in self.document_lengths(start, stop))


def prefix_of(path: str) -> Path:
    """A prefix as Megatron names it, given it or either of its files."""
    p = Path(path).expanduser()
    return p.with_suffix("") if p.suffix in (".bin", ".idx") else p


def is_indexed(path: str) -> bool:
    """Whether `path` names a Megatron indexed dataset (its .idx opens with Megatron's magic)."""
    idx = prefix_of(path).with_name(prefix_of(path).name + ".idx")
    try:
        with open(idx, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def files_of(prefix: Path) -> tuple[Path, Path]:
    return prefix.with_name(prefix.name + ".idx"), prefix.with_name(prefix.name + ".bin")


def read_index(path: str) -> Indexed:
    """The .idx of a prefix, checked against itself and its .bin (MegatronError naming the file otherwise); the
    arrays are memory-mapped."""
    prefix = prefix_of(path)
    idx, bin_ = files_of(prefix)
    for f in (idx, bin_):
        if not f.is_file():
            raise MegatronError(f"{f} does not exist (a Megatron indexed dataset is prefix.bin and prefix.idx)")
    size = idx.stat().st_size
    with open(idx, "rb") as f:
        head = f.read(HEADER)
    if len(head) < HEADER or head[:len(MAGIC)] != MAGIC:
        raise MegatronError(f"{idx} does not start with Megatron's magic {MAGIC!r} (it is not an indexed dataset's "
                            "index, or is cut short)")
    version, code, sequences, documents = struct.unpack("<QBQQ", head[len(MAGIC):])
    if version != VERSION:
        raise MegatronError(f"{idx} is of version {version}; megatron-core writes version {VERSION}")
    if code not in DTYPES or not np.issubdtype(DTYPES[code], np.integer):
        raise MegatronError(f"{idx} declares dtype code {code}, which is not a token type (integer codes: "
                            f"{', '.join(f'{c} {np.dtype(t).name}' for c, t in DTYPES.items() if c <= 5 or c == 8)})")
    need = HEADER + sequences * (4 + 8) + documents * 8
    if documents < 1 or size < need:
        raise MegatronError(f"{idx} is {size:,} bytes; its counts ({sequences:,} sequences, {documents - 1:,} "
                            f"documents) need {need:,}: it is cut short")
    raw = np.memmap(idx, dtype=np.uint8, mode="r")
    lengths = raw[HEADER:HEADER + 4 * sequences].view(np.int32)
    pointers = raw[HEADER + 4 * sequences:HEADER + 12 * sequences].view(np.int64)
    firsts = raw[HEADER + 12 * sequences:need].view(np.int64)
    dtype = np.dtype(DTYPES[code])
    if firsts[0] != 0 or firsts[-1] != sequences or (len(firsts) > 1 and np.any(np.diff(firsts) < 0)):
        raise MegatronError(f"{idx}'s document indices do not run from 0 to its {sequences:,} sequences in order")
    tokens = 0  # where the sequences so far end
    for i in range(0, sequences, INDEX_CHUNK):
        run = np.asarray(lengths[i:i + INDEX_CHUNK], dtype=np.int64)
        starts = tokens + np.cumsum(run) - run
        if np.any(run < 0) or np.any(pointers[i:i + INDEX_CHUNK] != starts * dtype.itemsize):
            raise MegatronError(f"{idx}'s sequences are not back to back in {bin_.name} (as megatron-core's builder "
                                "writes them)")
        tokens += int(run.sum())
    end = tokens * dtype.itemsize
    if end > bin_.stat().st_size:
        raise MegatronError(f"{idx}'s sequences end at byte {end:,}, past the end of {bin_} "
                            f"({bin_.stat().st_size:,} bytes): the .bin is cut short or another corpus's")
    return Indexed(prefix, dtype, lengths, pointers, firsts)


def write_index(path: str, dtype, document_lengths) -> Path:
    """prefix.idx for prefix.bin holding documents of these lengths back to back (write_index_of_ends)."""
    return write_index_of_ends(path, dtype, np.cumsum(np.asarray(document_lengths, dtype=np.int64)))


def write_index_of_ends(path: str, dtype, ends: np.ndarray, chunk: int = 1 << 20) -> Path:
    """prefix.idx for prefix.bin holding documents (tokens of `dtype`) back to back, each ending at `ends` (int64
    token offsets, e.g. a memory map: read `chunk` at a time, so that the memory stays flat), one sequence each, as
    megatron-core's IndexedDatasetBuilder writes it (its IndexedDataset reads it: tests/test_megatron.py). uint32
    tokens are declared int32, which Megatron reads (it has no uint32; ids stay below 2**31). Written beside, then
    renamed: a reader never sees half an index."""
    prefix, dtype = prefix_of(path), np.dtype(dtype)
    declared = np.dtype(np.int32) if dtype == np.uint32 else dtype
    code = next(c for c, t in DTYPES.items() if np.dtype(t) == declared)
    n = len(ends)
    idx = files_of(prefix)[0]
    part = idx.with_name(idx.name + ".part")
    with open(part, "wb") as f:
        f.write(MAGIC + struct.pack("<QBQQ", VERSION, code, n, n + 1))
        for i in range(0, n, chunk):  # each sequence's length
            before = np.int64(ends[i - 1]) if i else np.int64(0)
            f.write(np.diff(np.asarray(ends[i:i + chunk], dtype=np.int64), prepend=before).astype(np.int32)
                    .tobytes())
        for i in range(0, n, chunk):  # its byte offset: where the one before ends
            starts = np.concatenate([[ends[i - 1] if i else 0], ends[i:min(i + chunk, n) - 1]]).astype(np.int64)
            f.write((starts * declared.itemsize).tobytes())
        for i in range(0, n + 1, chunk):  # one sequence a document
            f.write(np.arange(i, min(i + chunk, n + 1), dtype=np.int64).tobytes())
    part.replace(idx)
    return idx


def tokens_of(ix: Indexed) -> np.ndarray:
    """The .bin's tokens, memory-mapped."""
    n = ix.n_tokens
    return np.memmap(files_of(ix.prefix)[1], dtype=ix.dtype, mode="r", shape=(n,)) if n else np.zeros(0, ix.dtype)


def id_range(ix: Indexed) -> list[int]:
    """The .bin's smallest and largest token ids ([0, -1] for no token), read CHUNK tokens at a time (its memory
    stays flat); an unsigned dtype's smallest is not looked for (it cannot be below 0)."""
    tokens, signed = tokens_of(ix), np.issubdtype(ix.dtype, np.signedinteger)
    lo, hi = 0, -1
    for i in range(0, len(tokens), CHUNK):
        chunk = tokens[i:i + CHUNK]
        hi = max(hi, int(chunk.max()))
        lo = min(lo, int(chunk.min())) if signed else lo
    return [lo, hi]


def document_of(ix: Indexed, token: int) -> int:
    """The document that holds the .bin's token at this offset: two binary searches of the memory-mapped index
    (the last sequence that starts at or before it; a sequence or document of none shares its start with the next)."""
    sequence = int(np.searchsorted(ix.pointers, token * ix.dtype.itemsize, side="right")) - 1
    return int(np.searchsorted(ix.documents, sequence, side="right")) - 1


def first_below(ix: Indexed, least: int) -> int:
    """The offset of the .bin's first token below `least` (-1: none), read CHUNK tokens at a time."""
    tokens = tokens_of(ix)
    for i in range(0, len(tokens), CHUNK):
        below = np.flatnonzero(tokens[i:i + CHUNK] < least)
        if len(below):
            return i + int(below[0])
    return -1


def held_out(ix: Indexed, val_fraction: float) -> int:
    """The first held-out document: the last val_fraction of them, at least one, never all."""
    n = ix.n_documents
    return n - min(max(round(n * val_fraction), 1), n - 1) if n > 1 else n


def read_corpus(entry: dict, packed: bool) -> dict:
    """A "megatron" index entry's splits as shards.read lays them out: ("train"|"val") -> (tokens, document ends
    relative to the split's start; None when packed, which needs none); the tokens are views of the memory-mapped
    .bin."""
    ix = read_index(entry["prefix"])
    tokens, cut = tokens_of(ix), entry["held_out_from"]
    at = ix.document_end(cut - 1) if cut else 0
    if packed:
        return {"train": (tokens[:at], None), "val": (tokens[at:], None)}
    ends = ix.document_ends()
    kept = np.diff(ends, prepend=0) > 0  # an empty document is skipped (the plan counts them): no row of padding
    return {"train": (tokens[:at], ends[:cut][kept[:cut]]), "val": (tokens[at:], ends[cut:][kept[cut:]] - at)}
