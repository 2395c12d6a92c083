"""data=megatron's checks before launch, as far as the index allows and the tokens once (plugins/data/indexed_dataset.py
reads them): prefixes that are whole corpora (a folder is listed, not read), ids inside the tokenizer's vocabulary
and none below 0, and each split of each source holding a row (train.seq_len+1 tokens where rows are windows of a
stream, a document with tokens where rows hold documents). Problems are (key, value, rule, fix); a data.mix
source's are renamed to its own key by the data rules."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from plugins.data import tokenizer as tokenizers
from plugins.data.indexed_dataset import (Indexed, MegatronError, document_of, first_below, held_out, id_range,
                                          is_indexed, prefix_of, read_index)
from plugins.data.packing import packed_stream, whole_documents
from storage import file_hashes

PREFIX_FIX = "the prefix of a corpus megatron-core wrote (tools/preprocess_data.py's --output-prefix, with its " \
             "_text_document suffix)"


def check(cfg) -> list[tuple]:
    d = cfg.data
    if any(_looks_like_a_weight(p) for p in d.paths):  # Megatron's --data-path 0.3 web 0.7 code
        pairs = list(zip(d.paths[::2], d.paths[1::2]))
        entries = ",".join(f"{{paths:[{p}],weight:{w}}}" for w, p in pairs)
        return [("data.paths", list(d.paths), "a blend as Megatron spells it (weight, prefix, ...) is data.mix here: "
                 "each source its prefixes and its weight", f"data.paths=[] 'data.mix=[{entries}]'")]
    if not d.paths:
        return [("data.paths", [], "data=megatron reads the prefixes of Megatron indexed datasets (prefix.bin and "
                 "prefix.idx)", "data.paths=[/data/corpus_text_document]")]
    problems, indexes = [], []
    for path in d.paths:
        try:
            ix = read_index(path)
        except MegatronError as e:
            problems.append(_folder_problem(d, path) if Path(path).expanduser().is_dir() else
                            ("data.paths", list(d.paths), f"{e}", PREFIX_FIX))
            continue
        if ix.n_documents < 2:
            problems.append(("data.paths", list(d.paths), f"{ix.prefix} holds {ix.n_documents} document(s): one "
                             "is held out for evaluation, so at least two are needed", "a larger corpus"))
        indexes.append(ix)
    if problems:
        return problems
    if tokenizers.hf_folder(d.tokenizer) is None:
        return _negative_ids(cfg, indexes) + [
            ("data.tokenizer", d.tokenizer, "a Megatron corpus is token ids already: the tokenizer they were made "
             "with gives <eos>, the vocabulary and the preview", "data.tokenizer=hf:<the tokenizer folder "
             "preprocess_data.py used> (or train.init_from=hf:<the model's folder>, whose own it then is)")]
    try:
        vocab = tokenizers.vocab_needed(d)
    except (OSError, ValueError):  # said by the data rules (data.tokenizer)
        vocab = None
    return id_problems(cfg, indexes, vocab) + split_problems(cfg, indexes)


def _looks_like_a_weight(path: str) -> bool:
    try:
        float(path)
    except ValueError:
        return False
    return not Path(f"{path}.idx").exists()


def _folder_problem(d, path: str) -> tuple:
    """A folder named where a prefix goes. Refused, not read whole: Megatron's --data-path takes prefixes, and a
    folder often holds more than one corpus (preprocess_data.py run once per split writes a train and a valid
    prefix side by side): reading them all would train on the one meant for evaluation. The fix names them all."""
    folder = Path(path).expanduser()
    found = sorted(str(prefix_of(str(f))) for f in folder.glob("*.idx") if is_indexed(str(f)))
    if not found:
        return ("data.paths", list(d.paths), f"{path} is a folder, and holds no Megatron indexed dataset (a "
                "prefix.idx beside its prefix.bin)", PREFIX_FIX)
    given = [q for p in d.paths for q in (found if p == path else [p])]
    return ("data.paths", list(d.paths), f"{path} is a folder; data.paths names prefixes, as Megatron's --data-path "
            f"does (a folder may hold corpora meant apart, a valid split beside a train one); it holds {len(found)}: "
            f"{', '.join(Path(f).name for f in found[:8])}" + (", ..." if len(found) > 8 else ""),
            f"data.paths=[{','.join(given)}] (all of them: leave out any not meant for training)")


def ids(cfg, ix: Indexed) -> list[int]:
    """The .bin's smallest and largest ids, read once for each version of the file: remembered in the cache by its
    stamp (storage/file_hashes.py), so a plan, a sweep's points and the tokenize stage do not read a corpus of
    gigabytes again."""
    with file_hashes.remembering_in(cfg.cache_dir):
        return list(file_hashes.remembered(Path(f"{ix.prefix}.bin"), lambda _: id_range(ix), "ids"))


def _negative_ids(cfg, indexes: list[Indexed]) -> list[tuple]:
    for ix in indexes:
        lo = ids(cfg, ix)[0]
        if lo < 0:
            at = first_below(ix, 0)
            return [("data.paths", list(cfg.data.paths), f"{ix.prefix}.bin holds token id {lo:,} (the first below 0 "
                     f"in document {document_of(ix, at) + 1:,} of {ix.n_documents:,}, token {at:,}): an id is an "
                     "index into the vocabulary, never below 0 (a -1 is a padding or ignore index written into the "
                     "tokens)", "write the corpus again with tools/preprocess_data.py (its ids are the tokenizer's), "
                     "or leave this prefix out of data.paths")]
    return []


def id_problems(cfg, indexes: list[Indexed], vocab: Optional[int]) -> list[tuple]:
    """Ids below 0, or past the tokenizer's vocabulary (`vocab` tokens; None: not known): the corpus was made with
    another tokenizer, or its tokens are not ids."""
    problems = _negative_ids(cfg, indexes)
    for ix in indexes if vocab is not None else ():
        top = ids(cfg, ix)[1]
        if top >= vocab:
            return problems + [("data.tokenizer", cfg.data.tokenizer, f"{ix.prefix}.bin holds token id {top:,}, and "
                                f"data.tokenizer={cfg.data.tokenizer} has {vocab:,} tokens: it was made with another "
                                "tokenizer", "data.tokenizer=hf:<the folder preprocess_data.py used>")]
    return problems


def split_problems(cfg, indexes: list[Indexed]) -> list[tuple]:
    """Each split holds a row, counted from the index (each prefix's last data.val_fraction of documents held out, as
    Megatron splits): train.seq_len+1 tokens where rows are windows of a stream, else a document with tokens (rows
    hold documents; empty ones are skipped), none longer than a row where data.long_documents=refuse."""
    d, row = cfg.data, cfg.train.seq_len + 1
    stream = packed_stream(d)
    need, unit = (row, "tokens") if stream else (1, "documents with tokens")

    def amounts(fraction: float) -> dict[str, int]:
        held = {"train": 0, "val": 0}
        for ix in indexes:
            cut = held_out(ix, fraction)
            if stream:
                at = ix.document_end(cut - 1) if cut else 0
                held["train"], held["val"] = held["train"] + at, held["val"] + ix.n_tokens - at
            else:
                held["train"] += cut - ix.empty_documents(0, cut)
                held["val"] += ix.n_documents - cut - ix.empty_documents(cut)
        return held

    held = amounts(d.val_fraction)
    short = [s for s in ("val", "train") if held[s] < need]
    if short:
        split = short[0]
        fits = _fraction(lambda f: amounts(f)["val"] >= need, lambda f: amounts(f)["train"] >= need, split)
        fixes = ([f"data.val_fraction={fits}"] if fits is not None else []) \
            + ([f"train.seq_len={held[split] - 1}"] if stream and held[split] > 1 else []) + ["a larger corpus"]
        return [("data.paths", list(d.paths), f"the {'held-out' if split == 'val' else 'training'} split of "
                 f"{', '.join(ix.prefix.name for ix in indexes)} holds {held[split]:,} {unit} (the last "
                 f"data.val_fraction={d.val_fraction} of each prefix's documents are held out, one at least, as "
                 "Megatron splits); a row needs " + (f"train.seq_len+1 = {row:,} tokens" if stream else
                                                     "a document with tokens"), ", or ".join(fixes))]
    if whole_documents(d) == "refuse":
        longest = max(int(n.max(initial=0)) for ix in indexes for n in ix.document_lengths())
        if longest > row:
            return [("data.long_documents", d.long_documents, f"rows hold whole documents, and a document of "
                     f"{longest:,} tokens is longer than a row (train.seq_len+1={row:,})", "data.long_documents=split "
                     f"(pieces that overlap by one token), data.packing_strategy=wrapped, or train.seq_len="
                     f"{longest - 1} or more")]
    return []


def _fraction(val_holds: Callable[[float], bool], train_holds: Callable[[float], bool], short: str) -> Optional[str]:
    """A data.val_fraction (of the schema's 0.0001 to 0.5, four decimals) under which both splits hold a row: the
    smallest where the held-out one was short, the largest where the training one was (each grows with it, one
    up, one down); None where none does."""
    steps = range(1, 5001)  # val_fraction = step / 10000
    lo, hi = 0, len(steps)  # the first step at which the condition holds (len: none)
    holds = (lambda k: val_holds(steps[k] / 1e4)) if short == "val" else (lambda k: not train_holds(steps[k] / 1e4))
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if holds(mid) else (mid + 1, hi)
    k = lo if short == "val" else lo - 1
    if not 0 <= k < len(steps):
        return None
    fraction = steps[k] / 1e4
    return f"{fraction:g}" if val_holds(fraction) and train_holds(fraction) else None
