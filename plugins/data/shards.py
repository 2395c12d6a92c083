"""Token shards on disk, the nanoGPT / Megatron format: a flat binary file of token ids per split (uint16 when the
vocabulary fits, else uint32) plus the offsets where documents start, read back by memory map (no corpus in RAM).

  train.bin  val.bin          the documents' tokens, each document ending in <eos>, back to back
  train.idx.npy  val.idx.npy  int64 offsets: document i is tokens[idx[i]:idx[i+1]]
  index.json                  dtype, token and document counts, vocabulary, <eos>/<pad> ids, tokenizer kind
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from plugins.data.registry import Corpus
from storage.fsio import atomic_write_json, read_json

INDEX = "index.json"


def dtype_for(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def write(folder: Path, splits: dict[str, list[np.ndarray]], vocab_size: int, eos: int, pad: int, kind: str) -> dict:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dtype = dtype_for(vocab_size)
    index = {"dtype": dtype.name, "vocab_size": vocab_size, "eos": eos, "pad": pad, "tokenizer": kind}
    for split, docs in splits.items():
        lengths = np.array([len(d) for d in docs], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        with open(folder / f"{split}.bin", "wb") as f:  # raw tokens, no header: what memory-map readers expect
            for doc in docs:
                f.write(np.asarray(doc, dtype=dtype).tobytes())
        np.save(folder / f"{split}.idx.npy", offsets)
        index[split] = {"tokens": int(offsets[-1]), "documents": len(docs)}
    atomic_write_json(folder / INDEX, index)
    return index


def read(folder: Path, packed: bool) -> Corpus:
    """The corpus of a shard folder, memory-mapped: packed, one stream per split; else one view per document."""
    folder = Path(folder)
    index = read_json(folder / INDEX)
    splits = {}
    for split in ("train", "val"):
        tokens = np.memmap(folder / f"{split}.bin", dtype=np.dtype(index["dtype"]), mode="r")
        if packed:
            splits[split] = [tokens]
        else:
            offsets = np.load(folder / f"{split}.idx.npy")
            splits[split] = [tokens[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
    return Corpus(splits["train"], splits["val"], index["vocab_size"], packed, index["pad"])
