"""data=megatron, the registered source: corpora Megatron-LM / NeMo tokenized (plugins/data/indexed_dataset.py reads
their files), read where they are. The checks before launch are megatron_checks.py's (beside this file); the
tokenize stage writes an index that points at the .bin files (shards.read reads its "megatron" entries); the plan
says what is read, and how many documents are empty (skipped: no row of padding alone). The source carries text
documents only (data.format=text), and no records' fields."""
from __future__ import annotations

import hashlib

import numpy as np

from common.problem import InputFault
from plugins.data import tokenizer as tokenizers
from plugins.data.indexed_dataset import (INDEX_CHUNK, Indexed, files_of, held_out, prefix_of, read_index,
                                          tokens_of)
from plugins.data.sources.megatron_checks import check, id_problems
from plugins.data.registry import DataSource, register_source

SAMPLED = 100     # documents whose last token the plan reads (does the corpus end its documents in <eos>?)


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


def _describe(cfg) -> list[str]:
    ixs = [read_index(p) for p in _all_paths(cfg.data)]
    docs, tokens = sum(ix.n_documents for ix in ixs), sum(ix.n_tokens for ix in ixs)
    size = sum(ix.n_tokens * ix.dtype.itemsize for ix in ixs)
    lines = [f"data: {len(ixs)} Megatron indexed dataset(s), {docs:,} documents, {tokens:,} tokens "
             f"({size / 2**30:,.2f} GB of {', '.join(sorted({ix.dtype.name for ix in ixs}))}), read where they are: "
             "tokenize reads the indexes, and the ids once (each file's smallest and largest), no text"]
    empty = sum(ix.empty_documents() for ix in ixs)
    if empty:
        lines.append(f"data: {empty:,} of the {docs:,} documents are empty (no token; preprocess_data.py keeps an "
                     f"empty text as a document of none): skipped, {docs - empty:,} read")
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
    split, in documents (those with tokens: empty ones are skipped) and tokens; refused where an id is below 0 or
    past the tokenizer's vocabulary (checked before launch too: the ids are remembered, not read again)."""
    ixs = _indexes(cfg.data)
    for key, value, rule, fix in id_problems(cfg, ixs, tok.vocab_size)[:1]:
        raise InputFault(f"{key}: {rule}; fix: {fix}")
    entries, totals = [], {s: {"tokens": 0, "documents": 0} for s in ("train", "val")}
    for ix in ixs:
        cut = held_out(ix, cfg.data.val_fraction)
        at = ix.document_end(cut - 1) if cut else 0
        empty = {"train": ix.empty_documents(0, cut), "val": ix.empty_documents(cut)}
        entries.append({"prefix": str(ix.prefix.resolve()), "dtype": ix.dtype.name, "documents": ix.n_documents,
                        "held_out_from": cut, "tokens": ix.n_tokens, "empty_documents": sum(empty.values())})
        totals["train"]["tokens"] += at
        totals["train"]["documents"] += cut - empty["train"]
        totals["val"]["tokens"] += ix.n_tokens - at
        totals["val"]["documents"] += ix.n_documents - cut - empty["val"]
    return {"megatron": entries, **totals}


def _first_ids(cfg, n: int) -> list[tuple[str, np.ndarray]]:
    """The first n documents with tokens (of the first INDEX_CHUNK: empty ones are skipped, as training does)."""
    ix = read_index(_all_paths(cfg)[0])
    tokens, ends = tokens_of(ix), np.concatenate([[0], ix.document_ends(INDEX_CHUNK)])
    shown = np.flatnonzero(np.diff(ends) > 0)[:n]
    return [(f"{ix.prefix}.bin, document {i + 1} of {ix.n_documents:,}", np.asarray(tokens[ends[i]:ends[i + 1]]))
            for i in shown]


register_source("megatron", DataSource(_fingerprint, check=check, indexed=_indexed, describe=_describe,
                                       first_ids=_first_ids))
