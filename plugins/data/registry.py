"""The data-source registry: a source yields documents (named bytes), which the tokenizer (plugins/data/tokenizer)
turns into a Corpus, the token streams of a train and a held-out split; or, like `synthetic`, tokens directly.

Source files import this module and register themselves (plugins/data/sources/, one module each); `plugins.data`
imports the built-in ones. Third-party packages add theirs through the `orchestrator.data` entry-point group. A
source declares what the generic rules and the plan ask of it (the record formats it carries, whether records'
fields pick its documents, the memory its tokens take): nothing outside a source tests its name.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

import numpy as np

from common.registry import Registry
from plugins.data.reading import assign
from plugins.data.tokenizer import PAD


@dataclass
class Corpus:
    """Token streams of the train and held-out splits (packed), or lists of per-document token arrays."""
    train: list[np.ndarray]
    val: list[np.ndarray]
    vocab_size: int          # tokens ids are < vocab_size
    packed: bool
    pad: int = PAD           # the id that fills the inputs after a short document (unpacked)
    train_mask: Optional[list] = None   # per token, whether its label enters the loss (as train / val are laid
    val_mask: Optional[list] = None     # out); None: every token's does


def _nothing_drawn(data_cfg) -> int:
    return 0


@dataclass(frozen=True)
class DataSource:
    fingerprint: Callable[[object], str]
    """cfg.data -> a string that changes whenever the underlying data changes (enters cache keys)."""
    documents: Optional[Callable[[object], Iterable[tuple[str, bytes]]]] = None
    """cfg.data -> the corpus's (name, text) documents, tokenized with data.tokenizer: a list (split as a whole:
    a lone document is cut in two), or an iterator, streamed (each document's split from a hash of its name)."""
    tokens: Optional[Callable[[object, int], Corpus]] = None
    """(cfg.data, model vocab size) -> Corpus, for sources that are tokens already (no tokenizer)."""
    check: Optional[Callable[[object], list[tuple]]] = None
    """the whole cfg -> problems found before launch, each (config key, value, rule, fix): files missing,
    unreadable, binary or not UTF-8, too little text for one batch and the held-out split. A common.problem.Found
    hands on the bad records among the first records it read (the files source's), which the plan names under
    data.bad_records=skip."""
    files: Optional[Callable[[object], list[tuple[str, Path]]]] = None
    """cfg.data -> the corpus's files ((name, path), in order): text, JSON Lines, Parquet. Such a source is read in
    pieces (plugins/data/reading.py), by as many tokenize tasks as data.tasks says."""
    indexed: Optional[Callable[[object, object], dict]] = None
    """(the whole cfg, its tokenizer) -> what the tokenize stage's index.json holds, for sources that are token
    shards already, read where they are (plugins/data/sources/megatron.py: the "megatron" entry shards.read reads)."""
    describe: Optional[Callable[[object], list[str]]] = None
    """the whole cfg -> the plan's lines on what the source reads, where it is not files to tokenize."""
    first_ids: Optional[Callable[[object, int], list[tuple[str, np.ndarray]]]] = None
    """(cfg.data, n) -> its first n documents as token ids, each with where it is (data.preview of token shards)."""
    formats: Optional[tuple[str, ...]] = ("text",)
    """the record formats (data.format) it carries: text documents alone, by default; None, every one (a source of
    records files, whose fields hold any format's parts: the files source)."""
    fields: bool = False
    """whether its documents are fields of records, picked by data.text_field (and the format's other *_field
    keys); a source without fields would ignore them."""
    drawn_bytes: Callable[[object], int] = _nothing_drawn
    """cfg.data -> the bytes its tokens take in memory while they are drawn (synthetic: 16 a token), which the plan
    holds against what a stage may use; 0 where they are read from files."""

    def carries(self, fmt: str) -> bool:
        """Whether records of data.format=fmt can come from this source."""
        return self.formats is None or fmt in self.formats


SOURCES: Registry[DataSource] = Registry("data.name", "orchestrator.data")
register_source, source_names, get_source = SOURCES.register, SOURCES.names, SOURCES.get


def _cut(doc: bytes, val_fraction: float) -> tuple[bytes, bytes]:
    """A lone document: its last val_fraction is held out, cut at a line break."""
    cut = int(len(doc) * (1 - val_fraction))
    newline = doc.find(b"\n", cut)
    if 0 <= newline < len(doc) - 1:
        cut = newline + 1
    return doc[:cut], doc[cut:]


def split_documents(named_docs: list[tuple[str, bytes]], val_fraction: float) -> tuple[list[bytes], list[bytes]]:
    """Deterministic train / held-out split of the documents (one document is cut in two)."""
    if len(named_docs) == 1:
        head, tail = _cut(named_docs[0][1], val_fraction)
        return [head] if head else [], [tail] if tail else []
    train, val = assign([n for n, _ in named_docs], val_fraction)
    return [named_docs[i][1] for i in train], [named_docs[i][1] for i in val]


def split_named(named_docs: list[tuple[str, bytes]], data_cfg) -> tuple[list[bytes], list[bytes]]:
    train, val = split_documents(named_docs, data_cfg.val_fraction)
    if not train or not val:
        raise ValueError(f"data.name={data_cfg.name}: found {len(named_docs)} document(s) with "
                         f"{sum(len(d) for _, d in named_docs)} bytes: too little to hold part out for evaluation")
    return train, val
