"""A corpus into token shards, streamed: what each task of the tokenize stage does, and the in-memory corpus of
the same tokens (for tools and tests).

A file source's pieces (plugins/data/reading.py) are dealt to tasks in contiguous runs; each task reads its
pieces, encodes ENCODE_BYTES of documents at a time and appends the ids to its part of the shards
(plugins/data/shards.py). A task holds one batch of text and its ids, never its share of the corpus. A source
that yields documents (a third party's) runs as one task.
"""
from __future__ import annotations

import copy
import itertools
import resource
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

import numpy as np

from common.problem import InputFault
from plugins.data import shards
from plugins.data import tokenizer as tokenizers
from plugins.data.bad_records import Bad, BadRecords, refused, skips
from plugins.data.packing import longest_record, packed_stream
from plugins.data.piece_records import BadRecord
from plugins.data.reading import Layout, in_val, layout, partition
from plugins.data.formats.spec import format_of
from plugins.data.prompted_records import Prompted
from plugins.data.records import (Chat, Continued, chat_ids, chat_options, document_ids, encode_inputs,
                                  makes_documents, masks_loss, piece_documents)
from plugins.data.registry import Corpus, get_source, split_documents
from storage.fsio import atomic_write_json

ENCODE_BYTES = 4 << 20     # text encoded per call: enough to keep the tokenizer's threads busy, small beside memory
TOKENIZER_DIR, TOKENS_DIR = "tokenizer", "tokens"


def sources_of(cfg) -> list:
    """The corpora tokenized: the experiment's data, or each source of data.mix as a config of its own (its paths
    and text field; the BPE sample shared out between them)."""
    mix = cfg.data.get("mix") or []
    if not mix:
        return [cfg]
    subs = []
    for entry in mix:
        sub = copy.deepcopy(cfg)
        sub.data.paths, sub.data.mix = list(entry.paths), []
        sub.data.text_field = entry.text_field or cfg.data.text_field
        sub.data.bpe_sample_bytes = max(1, cfg.data.bpe_sample_bytes // len(mix))
        subs.append(sub)
    return subs


def source_dir(i: int) -> str:
    return f"source-{i:02d}"


def corpus_layouts(cfg) -> list[tuple[object, Optional[Layout]]]:
    """(config, pieces) of each corpus tokenized (one, or one per data.mix source)."""
    return [(sub, corpus_layout(sub)) for sub in sources_of(cfg)]


def corpus_layout(cfg) -> Optional[Layout]:
    """The pieces a file source is read in (None: the source yields documents or tokens itself)."""
    source = get_source(cfg.data.name)
    return layout(source.files(cfg.data), cfg.data.max_bytes, cfg.data.val_fraction) if source.files else None


# -- the tokenizer ---------------------------------------------------------------------------------------------

def bpe_sample(cfg, lay: Optional[Layout]) -> Iterator[bytes]:
    """The training split's texts a BPE learns from: all of it up to data.bpe_sample_bytes, else pieces spread
    evenly over the corpus (every k-th), so a corpus of any size gives a bounded, deterministic sample."""
    d = cfg.data
    if lay is None:
        yield from _bounded((text for split, text in _source_documents(cfg) if split == "train"), d.bpe_sample_bytes)
        return
    stride = max(1, -(-lay.read_bytes // d.bpe_sample_bytes))
    chosen = lay.pieces[::stride]
    yield from _bounded((text for piece in chosen for split, texts, _ in piece_documents(d, piece)
                         for text in texts if split == "train"), d.bpe_sample_bytes)


def _bounded(texts: Iterable[bytes], limit: int) -> Iterator[bytes]:
    taken = 0
    for text in texts:
        if taken >= limit:
            return
        yield text[:limit - taken]
        taken += len(text)


def build_tokenizer(cfg, corpora: list[tuple[object, Optional[Layout]]]) -> tokenizers.Tokenizer:
    """data.tokenizer; a BPE learns from every corpus's sample (a mixture's sources share data.bpe_sample_bytes)."""
    sample = itertools.chain.from_iterable(bpe_sample(sub, lay) for sub, lay in corpora)
    return tokenizers.make(cfg.data, sample if cfg.data.tokenizer == "bpe" else ())


# -- the documents of a task -----------------------------------------------------------------------------------

def _source_documents(cfg) -> Iterator[tuple[str, bytes]]:
    """(split, text) of a source that yields documents: a list is split as a whole (a lone document cut in two),
    an iterator document by document from its name."""
    docs = get_source(cfg.data.name).documents(cfg.data)
    if isinstance(docs, list):
        train, val = split_documents(docs, cfg.data.val_fraction)
        yield from itertools.chain((("train", t) for t in train), (("val", t) for t in val))
    else:
        for name, text in docs:
            yield ("val" if in_val(name, cfg.data.val_fraction) else "train"), text


def task_documents(cfg, lay: Optional[Layout], task: int, tasks: int,
                   keep_bad: Optional[bool] = None) -> Iterator[tuple[str, tuple[bytes, ...], bool, int]]:
    """(split, texts, closes its document, bytes read) of this task's share of the corpus: a document's texts are
    one, or a prompt and its completion (keep_bad: a bad record a Bad, as piece_documents yields it)."""
    if lay is None:
        for split, text in _source_documents(cfg):
            yield split, (text,), True, len(text)
        return
    for piece in partition(lay.pieces, tasks)[task]:
        size, first = piece.size, True
        for split, texts, closes in piece_documents(cfg.data, piece, keep_bad):
            yield split, texts, closes, size if first else 0
            first = False
        if first:  # a piece without a document (blank lines, empty records) still counts as read
            yield "train", (b"",), False, size


def write_part(cfg, lay: Optional[Layout], tok: tokenizers.Tokenizer, folder: Path, task: int, tasks: int,
               progress: Callable[[int, int], None] = lambda read, tokens: None, attempt: str = "") -> dict:
    """This task's documents, encoded ENCODE_BYTES at a time, appended to its part of the shards; a bad record
    refused, or with data.bad_records=skip left out, counted and the first named in the part's summary."""
    t0 = time.perf_counter()
    masked, longest, chatting = masks_loss(cfg), longest_record(cfg), chat_options(cfg.data)
    skipping, bad = skips(cfg.data), BadRecords()

    def left_out(fault: InputFault) -> None:
        if not skipping:
            raise refused(fault) from None
        bad.add(fault)

    joint = cfg.data.get("prompt_encoding") == "joint"
    writer = shards.PartWriter(Path(folder) / shards.part_name(task), tok.vocab_size, attempt, masked)
    batch: list[tuple[str, tuple[bytes, ...], bool]] = []
    held = read = unlearned = run = cut = 0

    def check_length(texts, ids, closes):
        nonlocal run
        run = (run if isinstance(texts, Continued) else 0) + len(ids)  # a text file's pieces: one document
        if longest is not None and run > longest:
            raise InputFault(f"{getattr(texts, 'where', 'a document of the source')}: a document of "
                             f"{run:,} tokens{'' if closes else ' and more'} is longer than a row "
                             f"(train.seq_len+1={longest:,}) and data.long_documents=refuse; fix: "
                             "data.long_documents=split (pieces that overlap by one token), "
                             + ("data.packing_strategy=wrapped (windows of the text, pretraining's way), "
                                if not format_of(cfg.data).records else "")
                             + f"train.seq_len={run - 1} or more, or a shorter document")

    def flush():
        nonlocal batch, held, unlearned, cut
        encoded = iter(tok.encode([text for _, texts, _ in batch if not isinstance(texts, (Chat, Prompted))
                                   for text in encode_inputs(texts, joint)]))
        for split, texts, closes in batch:
            try:
                if isinstance(texts, Prompted):  # a pair's chosen and rejected document, one after the other
                    made, longer = texts.documents(tok, cfg.train.seq_len + 1)
                    cut += longer
                elif isinstance(texts, Chat):
                    made = [(ids, trained) for ids, trained in chat_ids(tok, texts, masked, **chatting)
                            if not masked or trained[:-1].any()]  # else the template marks nothing as the assistant's
            except BadRecord as e:  # a conversation the template cannot render
                left_out(e)
                continue
            if isinstance(texts, Chat) and not made:
                unlearned += 1
                continue
            if not isinstance(texts, (Prompted, Chat)):
                pieces = [next(encoded) for _ in encode_inputs(texts, joint)]
                made = [document_ids(tok, pieces, closes, not isinstance(texts, Continued), masked, joint)]
            for ids, trained in made:
                check_length(texts, ids, closes)
                writer.append(split, ids, closes, trained if masked else None)
        progress(read, sum(writer.tokens.values()))
        batch, held = [], 0

    for split, texts, closes, size in task_documents(cfg, lay, task, tasks, keep_bad=True):
        read += size
        if isinstance(texts, Bad):
            left_out(texts.fault)
        elif not texts:
            unlearned += 1
        elif any(texts) or closes:
            batch.append((split, texts, closes))
            held += sum(len(t) for t in texts)
        if held >= ENCODE_BYTES:
            flush()
    flush()
    return writer.close(bytes_read=read, seconds=time.perf_counter() - t0, unlearned=unlearned,
                        peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                        **({"pairs_cut": cut} if makes_documents(cfg.data) else {}),
                        **({"bad_records": bad.entry()} if skipping else {}))


def source_tokens(cfg, folder: Path) -> dict:
    """A source that is tokens already (synthetic): its corpus as one part."""
    corpus = get_source(cfg.data.name).tokens(cfg.data, cfg.model.vocab_size)
    return shards.write(folder, {"train": corpus.train, "val": corpus.val}, corpus.vocab_size, corpus.pad,
                        corpus.pad, cfg.data.name)


def finish(folder: Path, parts: list[str], tok: tokenizers.Tokenizer, cfg, lay: Optional[Layout], **extra) -> dict:
    """The index of the parts; a split left empty by a small corpus borrows the other's last document (as a list
    of documents is split); a corpus too small for that is refused, naming what was read."""
    index = shards.write_index(folder, parts, tok.vocab_size, tok.eos, tok.pad, tok.kind, **extra)
    whole = format_of(cfg.data).per_example  # a pair's two documents move together
    for src, dst in (("train", "val"), ("val", "train")):
        if not index[dst]["documents"] and index[src]["documents"] > whole:
            index = shards.move_last_document(folder, index, src, dst, whole)
    if (left := BadRecords.of(index)).count and not index["train"]["documents"] + index["val"]["documents"]:
        raise InputFault(f"data.paths={list(cfg.data.paths)}: every record read is bad ({left.count:,} left out by "
                         f"data.bad_records=skip):{left.listing()}; fix: repair the records")
    if index.get("unlearned") and not index["train"]["documents"] + index["val"]["documents"]:
        raise InputFault(f"data.completion_field={cfg.data.completion_field}: every record's completion is empty "
                         f"({index['unlearned']:,} records): nothing would be learned; fix: the field that holds "
                         "the answers" if not format_of(cfg.data).always_rendered else
                         f"data.messages_field={cfg.data.messages_field}: no record has an assistant message "
                         f"({index['unlearned']:,} records): nothing would be learned; fix: records with the "
                         "assistant's answers, or data.loss_on=all")
    for split in shards.SPLITS:
        if not index[split]["tokens"]:
            read = f"{lay.read_bytes:,} bytes of {lay.files} file(s)" if lay else "the source's documents"
            raise InputFault(f"data.name={cfg.data.name}: the {'held-out' if split == 'val' else 'training'} split "
                             f"got no document from {read} (data.val_fraction={cfg.data.val_fraction}): too little "
                             "to hold part out for evaluation; fix: more data, or a larger data.val_fraction")
    return index


def source_index(cfg, folder: Path) -> dict:
    """A source that is token shards already (data=megatron): its tokenizer saved (folder/tokenizer) and the index
    that points at the shards (folder/tokens/index.json; a data.mix's, one a source), nothing copied."""
    tok = tokenizers.make(cfg.data)
    tok.save(Path(folder) / TOKENIZER_DIR)
    indexes = []
    for i, sub in enumerate(sources_of(cfg)):
        index = {"dtype": None, "vocab_size": tok.vocab_size, "eos": tok.eos, "pad": tok.pad, "tokenizer": tok.kind,
                 **get_source(cfg.data.name).indexed(sub, tok)}
        corpus_folder(Path(folder) / TOKENS_DIR, cfg, i).mkdir(parents=True, exist_ok=True)
        atomic_write_json(corpus_folder(Path(folder) / TOKENS_DIR, cfg, i) / shards.INDEX, index)
        indexes.append(index)
    if not cfg.data.get("mix"):
        return indexes[0]
    return shards.write_mix_index(Path(folder) / TOKENS_DIR, [source_dir(i) for i in range(len(indexes))], indexes)


def tokenize_into(cfg, folder: Path) -> dict:
    """The whole corpus into shards (folder/tokens) and its tokenizer (folder/tokenizer) by this one process."""
    folder = Path(folder)
    if get_source(cfg.data.name).tokens is not None:
        return source_tokens(cfg, folder / TOKENS_DIR)
    if get_source(cfg.data.name).indexed is not None:
        return source_index(cfg, folder)
    corpora = corpus_layouts(cfg)
    tok = build_tokenizer(cfg, corpora)
    tok.save(folder / TOKENIZER_DIR)
    for i, (sub, lay) in enumerate(corpora):
        write_part(sub, lay, tok, corpus_folder(folder / TOKENS_DIR, cfg, i), 0, 1)
    return finish_all(folder / TOKENS_DIR, 1, tok, cfg, corpora)


def corpus_folder(tokens: Path, cfg, i: int) -> Path:
    """Where corpus i's parts go: the tokens folder itself, or a folder per data.mix source."""
    return Path(tokens) / source_dir(i) if cfg.data.get("mix") else Path(tokens)


def finish_all(tokens: Path, tasks: int, tok: tokenizers.Tokenizer, cfg, corpora: list, **extra) -> dict:
    """Every corpus's index (finish), and for a mixture the index above them that names the sources."""
    parts = [shards.part_name(t) for t in range(tasks)]
    indexes = [finish(corpus_folder(tokens, cfg, i), parts, tok, sub, lay, **(extra if len(corpora) == 1 else {}))
               for i, (sub, lay) in enumerate(corpora)]
    if not cfg.data.get("mix"):
        return indexes[0]
    return shards.write_mix_index(tokens, [source_dir(i) for i in range(len(corpora))], indexes, **extra)


def tokenized(cfg):
    """The corpus in memory: what the tokenize stage's shards hold, one stream or per document (packed_stream) (a
    list of corpora for a data.mix)."""
    with tempfile.TemporaryDirectory(prefix="tokenized-") as tmp:
        tokenize_into(cfg, Path(tmp))
        corpora = [_in_memory(c) for c in shards.read_all(Path(tmp) / TOKENS_DIR, packed_stream(cfg.data))]
    return corpora if cfg.data.get("mix") else corpora[0]


def _in_memory(c: Corpus) -> Corpus:
    def copied(docs, dtype):
        return None if docs is None else [np.array(d, dtype) for d in docs]

    return Corpus(copied(c.train, np.int64), copied(c.val, np.int64), c.vocab_size, c.packed, c.pad,
                  copied(c.train_mask, np.uint8), copied(c.val_mask, np.uint8))  # (a mark: an unpaired label)


def wait_for(ready: Callable[[], bool], poll_s: float = 0.2) -> None:
    """Wait until another task has written what `ready` looks for (a task that fails ends the stage: the
    executor stops the others)."""
    while not ready():
        time.sleep(poll_s)
