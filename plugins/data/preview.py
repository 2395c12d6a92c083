"""What trains, before it trains: each source's first records as the model will see them, its tokens decoded with
the part that enters the loss marked, read by the same code as the tokenize stage (plugins/data/records.py).

The plan prints the first record of each source (a short excerpt of a text document); `data.preview=N` prints N and
stops. On a terminal the learned part is underlined in colour; in a file or a pipe it stands between LEARNED marks.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator, Optional

import numpy as np
from rich.text import Text

from plugins.data import shards
from plugins.data import tokenizer as tokenizers
from plugins.data.bad_records import skips
from plugins.data.corpus import corpus_layouts
from plugins.data.packing import whole_documents
from plugins.data.piece_records import BadRecord
from plugins.data.formats.spec import format_of
from plugins.objectives.spec import rows_per_example
from plugins.data.prompted_records import Prompted
from plugins.data.records import (Chat, Continued, chat_ids, chat_options, document_ids, encode_inputs,
                                  masks_loss_of, piece_documents)
from plugins.data.registry import get_source
from storage.fsio import read_json

LEARNED = ("⟦", "⟧")            # around the learned part where no style can show it
LEARNED_STYLE = "bold green underline"
PLAN_CHARS = 300                 # of a record shown by the plan (data.preview shows this many at each end)


def preview(cfg, records: int, styled: bool, chars: int = PLAN_CHARS) -> list:
    """Lines (rich Text) showing the first `records` records of each source of files; [] for a source that is tokens
    already (synthetic)."""
    d = cfg.data
    tok, shown_as = _tokenizer(d)
    lines: list = []
    first_ids = get_source(d.name).first_ids
    if first_ids is not None:  # token shards already (data=megatron): their first documents decoded
        for where, ids in first_ids(d, records):
            lines += [Text(f"data: {where} as the model sees it, all {len(ids):,} tokens learned:"),
                      _body(tok, ids, None, styled, chars)]
        return lines
    corpora = corpus_layouts(cfg)
    for i, (sub, lay) in enumerate(corpora):
        if lay is None:
            continue
        for where, ids, trained in _first_documents(sub.data, lay, tok, records):
            learned = (f"{int(np.count_nonzero(trained)):,} of {len(ids):,} tokens learned"
                       + ("" if styled else f" (between {LEARNED[0]} and {LEARNED[1]})") if trained is not None
                       else f"all {len(ids):,} tokens learned")
            head = (f"data: {f'source {i}: ' if len(corpora) > 1 else ''}{where} as the model sees it, {learned}"
                    + shown_as + ":")
            lines += [Text(head), _body(tok, ids, trained, styled, chars)]
    return lines


def _tokenizer(d) -> tuple[tokenizers.Tokenizer, str]:
    """The tokenizer the records are shown with: data.tokenizer's, or bytes where a BPE is still to be learned."""
    if d.tokenizer == "bpe":
        return tokenizers.make(_as_bytes(d)), " (in bytes: the BPE is learned by the tokenize stage)"
    return tokenizers.make(d), ""


def _as_bytes(d):
    from omegaconf import OmegaConf

    copy = OmegaConf.to_container(d, resolve=True)
    copy["tokenizer"] = "bytes"
    return OmegaConf.create(copy)


def _first_documents(d, lay, tok, records: int) -> Iterator[tuple[str, np.ndarray, Optional[np.ndarray]]]:
    masked, joint, shown, chatting = masks_loss_of(d), d.get("prompt_encoding") == "joint", 0, chat_options(d)
    why = ("auto: the template renders earlier turns otherwise once a later one follows, so each assistant turn is an "
           "example as at inference" if chatting["turns"] == "auto" else f"{chatting['turns']}: one per assistant turn")
    for piece in lay.pieces:
        for _, texts, closes in piece_documents(d, piece):
            if not texts or not any(texts):
                continue
            if isinstance(texts, Prompted):  # its documents, as the tokenize stage writes them
                made = texts.ids(tok)
            elif isinstance(texts, Chat):
                try:
                    made = chat_ids(tok, texts, masked, **chatting)
                except BadRecord:
                    if skips(d):  # left out as the tokenize stage leaves it out (the plan counts it)
                        continue
                    raise
            else:
                pieces = tok.encode(list(encode_inputs(texts, joint)))
                made = [document_ids(tok, pieces, closes, not isinstance(texts, Continued), masked, joint)]
            for turn, (ids, trained) in enumerate(made, 1):
                yield _where(texts, piece) + (f", its {texts.names[turn - 1]} completion"
                                              if isinstance(texts, Prompted) else
                                              f", example {turn} of {len(made)} (data.chat_turns={why})"
                                              if len(made) > 1 else ""), ids, trained
            shown += 1
            if shown >= records:
                return


def _where(texts, piece) -> str:
    where = getattr(texts, "where", None)
    return str(where) if where is not None else piece.path


def _body(tok, ids: np.ndarray, trained: Optional[np.ndarray], styled: bool, chars: int) -> Text:
    """The decoded tokens, indented, learned runs marked; over 2 x chars characters, its two ends."""
    flags = np.ones(len(ids), dtype=bool) if trained is None else trained
    runs, start = [], 0
    for k in range(1, len(ids) + 1):
        if k == len(ids) or flags[k] != flags[start]:
            runs.append((_decode(tok, ids[start:k]), bool(flags[start])))
            start = k
    total = sum(len(s) for s, _ in runs)
    if total > 2 * chars:
        runs = _slice(runs, 0, chars) + [(f" … ({total - 2 * chars:,} characters) … ", False)] + \
            _slice(runs, total - chars, total)
    text = Text("    ")
    for segment, learned in runs:
        segment = segment.replace("\n", "\n    ")
        if learned and trained is not None and styled:
            text.append(segment, style=LEARNED_STYLE)
        else:
            text.append(f"{LEARNED[0]}{segment}{LEARNED[1]}" if learned and trained is not None else segment)
    return text


def _slice(runs: list[tuple[str, bool]], start: int, end: int) -> list[tuple[str, bool]]:
    """Characters [start, end) of the runs' text, as runs."""
    kept, at = [], 0
    for segment, learned in runs:
        part = segment[max(0, start - at):max(0, end - at)]
        if part:
            kept.append((part, learned))
        at += len(segment)
    return kept


def _decode(tok, ids) -> str:
    return tok.with_offsets().decode([int(i) for i in ids], skip_special_tokens=False)


def passes_line(cfg, tokens: Path) -> list[str]:
    """How much of the training split the steps draw, in epochs of its examples (each drawn once an epoch:
    plugins/data/epochs.py), from the tokenize stage's counts (its index.json in `tokens`): 16 epochs of a small chat
    set overfits, and nothing else says so. A data.mix draws each row's source by weight: not said here, nor where
    an index holds no counts (an entry written before they were kept)."""
    path = Path(tokens) / shards.INDEX
    index = read_json(path) if not cfg.data.get("mix") and path.is_file() else {}
    if not isinstance(index.get("train"), dict) or not index["train"].get("tokens") or not cfg.train.steps:
        return []  # train.steps=0 draws nothing (the train stage says what it does instead)
    t, train = cfg.train, index["train"]
    about = ""
    fmt = format_of(cfg.data)
    if fmt.per_example > 1 and rows_per_example(cfg) == fmt.per_example:  # a pair is two rows, drawn together
        n = fmt.per_example
        drawn, pool, unit = t.steps * t.batch_size // n, train["documents"] // n, fmt.unit
    elif whole_documents(cfg.data):  # rows of whole documents: as many as their tokens fill, at least
        drawn, pool, about = t.steps * t.batch_size, -(-train["tokens"] // (t.seq_len + 1)), "about "
        unit = "rows of whole records"
    elif cfg.data.packing:  # windows of the stream, each one's last token the next one's first
        drawn, pool, unit = t.steps * t.batch_size, max((train["tokens"] - 1) // t.seq_len, 1), \
            f"windows of {t.seq_len:,} tokens"
    else:  # one record a row
        drawn, pool, unit = t.steps * t.batch_size, train["documents"], "records"
    epochs = drawn / max(pool, 1)
    share = "each drawn once an epoch" if epochs >= 1 else f"{epochs:.2%} of them, none twice"
    return [f"data: {t.steps:,} steps of {t.batch_size:,} rows = {about}{epochs:,.2f} epochs of the training "
            f"split's {about}{pool:,} {unit} ({share})"]
