"""data=megatron: corpora already tokenized for Megatron-LM / NeMo, read where they are (no copy, no tokenizing).

megatron-core's indexed dataset (`IndexedDataset`, written by its `IndexedDatasetBuilder` and Megatron-LM's
tools/preprocess_data.py) is a pair of files per prefix: `prefix.bin`, the tokens of every sequence back to back
in one dtype, and `prefix.idx`:

  b"MMIDIDX\\x00\\x00"  version (uint64, 1)  dtype code (uint8: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
  6 float64, 7 float32, 8 uint16)  sequence count S (uint64)  document count D+1 (uint64)
  int32[S] each sequence's length in tokens   int64[S] each sequence's byte offset in the .bin
  int64[D+1] the first sequence of each document, then S (a document is a run of sequences; one, unless the corpus
  was split into sentences)   (int8[S] sequence modes, multimodal corpora only: not read)

The tokenize stage reads only the .idx (and the .bin's largest id, once: the cache keeps the result) and writes an
index that points at the .bin (plugins/data/shards.py reads it by memory map); each prefix's last data.val_fraction
of documents is held out, as Megatron's split takes the last documents for validation. The tokenizer is the one the
corpus was made with: data.tokenizer=hf:<folder> (or train.init_from's, data.tokenizer=auto).
"""
from __future__ import annotations

import hashlib
import struct
from pathlib import Path
from typing import NamedTuple, Optional

import numpy as np

from common.problem import InputFault
from plugins.data import tokenizer as tokenizers
from plugins.data.registry import DataSource, register_source

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
          8: np.uint16}
HEADER = len(MAGIC) + 8 + 1 + 8 + 8
CHUNK = 64 << 20  # tokens of the .bin read at a time when its largest id is looked for
INDEX_CHUNK = 1 << 20  # sequences of the .idx checked at a time (its temporaries 8 MB, whatever the corpus)
SAMPLED = 100     # documents whose last token the plan reads (does the corpus end its documents in <eos>?)


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

    def document_ends(self, count: Optional[int] = None) -> np.ndarray:
        """Where each of the first `count` documents (all: None) ends, as document_end: an int64 a document read
        from the index, never an array of all its sequences."""
        last = np.asarray(self.documents[1:None if count is None else count + 1], dtype=np.int64) - 1
        at = np.maximum(last, 0)
        return np.where(last >= 0, self.pointers[at] // self.dtype.itemsize + self.lengths[at], 0).astype(np.int64)


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


def largest_id(ix: Indexed) -> int:
    """The .bin's largest token id, read CHUNK tokens at a time (its memory stays flat)."""
    tokens = tokens_of(ix)
    return max((int(tokens[i:i + CHUNK].max()) for i in range(0, len(tokens), CHUNK)), default=-1)


def held_out(ix: Indexed, val_fraction: float) -> int:
    """The first held-out document: the last val_fraction of them, at least one, never all."""
    n = ix.n_documents
    return n - min(max(round(n * val_fraction), 1), n - 1) if n > 1 else n


# -- the source -----------------------------------------------------------------------------------------------------

def _indexes(cfg) -> list[Indexed]:
    return [read_index(p) for p in cfg.paths]


def _all_paths(cfg) -> list[str]:
    """The prefixes read: data.paths, or every data.mix source's."""
    return [p for entry in cfg.mix for p in entry.paths] if cfg.get("mix") else list(cfg.paths)


def _fingerprint(cfg) -> str:
    """The files as they are (names, sizes, modification times): a corpus written again is read again."""
    stamps = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for p in _all_paths(cfg)
              for f in files_of(prefix_of(p)) if f.is_file()]
    return "megatron-v1:" + hashlib.sha256(repr(stamps).encode()).hexdigest()


def _looks_like_a_weight(path: str) -> bool:
    try:
        float(path)
    except ValueError:
        return False
    return not Path(f"{path}.idx").exists()


def _check(cfg) -> list[tuple]:
    d = cfg.data
    if any(_looks_like_a_weight(p) for p in d.paths):  # Megatron's --data-path 0.3 web 0.7 code
        pairs = list(zip(d.paths[::2], d.paths[1::2]))
        entries = ",".join(f"{{paths:[{p}],weight:{w}}}" for w, p in pairs)
        return [("data.paths", list(d.paths), "a blend as Megatron spells it (weight, prefix, ...) is data.mix here: "
                 "each source its prefixes and its weight", f"data.paths=[] 'data.mix=[{entries}]'")]
    if not d.paths:
        return [("data.paths", [], "data=megatron reads the prefixes of Megatron indexed datasets (prefix.bin and "
                 "prefix.idx)", "data.paths=[/data/corpus_text_document]")]
    problems = []
    for path in d.paths:
        try:
            ix = read_index(path)
        except MegatronError as e:
            problems.append(("data.paths", list(d.paths), f"{e}", "the prefix of a corpus megatron-core wrote "
                             "(tools/preprocess_data.py's --output-prefix, with its _text_document suffix)"))
            continue
        if ix.n_documents < 2:
            problems.append(("data.paths", list(d.paths), f"{ix.prefix} holds {ix.n_documents} document(s): one "
                             "is held out for evaluation, so at least two are needed", "a larger corpus"))
    if problems:
        return problems
    if tokenizers.hf_folder(d.tokenizer) is None:
        return [("data.tokenizer", d.tokenizer, "a Megatron corpus is token ids already: the tokenizer they were made "
                 "with gives <eos>, the vocabulary and the preview", "data.tokenizer=hf:<the tokenizer folder "
                 "preprocess_data.py used> (or train.init_from=hf:<the model's folder>, whose own it then is)")]
    return []


def _describe(cfg) -> list[str]:
    ixs = [read_index(p) for p in _all_paths(cfg.data)]
    docs, tokens = sum(ix.n_documents for ix in ixs), sum(ix.n_tokens for ix in ixs)
    size = sum(ix.n_tokens * ix.dtype.itemsize for ix in ixs)
    lines = [f"data: {len(ixs)} Megatron indexed dataset(s), {docs:,} documents, {tokens:,} tokens "
             f"({size / 2**30:,.2f} GB of {', '.join(sorted({ix.dtype.name for ix in ixs}))}), read where they are: "
             "tokenize reads the indexes and the largest id, no text"]
    eos = tokenizers.make(cfg.data).eos
    for ix in ixs:
        ends, tokens = ix.document_ends(SAMPLED), tokens_of(ix)
        if len(ends) and not any(int(tokens[e - 1]) == eos for e in ends if e):
            lines.append(f"data: the first documents of {ix.prefix} do not end in <eos> (id {eos}): made without "
                         "preprocess_data.py's --append-eod, they run into each other in a packed row, as Megatron "
                         "trains them")
    return lines


def _indexed(cfg, tok: tokenizers.Tokenizer) -> dict:
    """The index.json that points at the corpora (shards.read's "megatron" entry): each prefix, its dtype and its
    split, in documents and tokens; refused where an id is past the tokenizer's vocabulary."""
    entries, totals = [], {s: {"tokens": 0, "documents": 0} for s in ("train", "val")}
    for ix in _indexes(cfg.data):
        top = largest_id(ix)
        if top >= tok.vocab_size:
            raise InputFault(f"data.paths: {ix.prefix}.bin holds token id {top:,}, and data.tokenizer="
                             f"{cfg.data.tokenizer} has {tok.vocab_size:,} tokens: it was made with another "
                             "tokenizer; fix: data.tokenizer=hf:<the folder preprocess_data.py used>")
        cut = held_out(ix, cfg.data.val_fraction)
        at = ix.document_end(cut - 1) if cut else 0
        entries.append({"prefix": str(ix.prefix.resolve()), "dtype": ix.dtype.name, "documents": ix.n_documents,
                        "held_out_from": cut, "tokens": ix.n_tokens})
        totals["train"]["tokens"] += at
        totals["train"]["documents"] += cut
        totals["val"]["tokens"] += ix.n_tokens - at
        totals["val"]["documents"] += ix.n_documents - cut
    return {"megatron": entries, **totals}


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
    return {"train": (tokens[:at], ends[:cut]), "val": (tokens[at:], ends[cut:] - at)}


def _first_ids(cfg, n: int) -> list[tuple[str, np.ndarray]]:
    ix = read_index(_all_paths(cfg)[0])
    tokens, ends = tokens_of(ix), np.concatenate([[0], ix.document_ends(n)])
    return [(f"{ix.prefix}.bin, document {i + 1} of {ix.n_documents:,}", np.asarray(tokens[ends[i]:ends[i + 1]]))
            for i in range(min(n, ix.n_documents))]


register_source("megatron", DataSource(_fingerprint, check=_check, indexed=_indexed, describe=_describe,
                                       first_ids=_first_ids))
