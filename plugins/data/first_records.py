"""The check before launch of a file's first records, read as the tokenize stage reads them (plugins/data/records.py):
each record's own faults gathered (plugins/data/bad_records.py), a setting's fault returned, so that a format mistake
is refused before any stage starts (plugins/data/sources.py asks it of each file)."""
from __future__ import annotations

import itertools
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

from common.problem import InputFault
from plugins.data import tokenizer as tokenizers
from plugins.data.bad_records import Bad, BadRecords
from plugins.data.bad_records import refusal as bad_records_refusal
from plugins.data.no_effect import no_effect_problems
from plugins.data.packing import longest_record
from plugins.data.compressed import suffix_of
from plugins.data.piece_records import BadRecord
from plugins.data.reading import RECORDS, layout
from plugins.data.prompted_records import Prompted
from plugins.data.formats.spec import format_of
from plugins.data.records import (CHECKED_RECORDS, Chat, Unanswered, chat_options, chat_spans, makes_documents,
                                  masks_loss_of, piece_documents, render_problem)


def _longer_than_a_row(texts, template: Optional[str], variables: dict, tokens: int, widest: int) -> str:
    """Why a record is longer than a row of `tokens` whatever its tokens ('' when it may fit): its text (a chat
    rendered by its template) over the most bytes one token covers."""
    if isinstance(texts, Unanswered) or (isinstance(texts, Chat) and not template):
        return ""
    size = len(chat_spans(template, texts, False, **variables)[0][0].encode()) if isinstance(texts, Chat) \
        else sum(map(len, texts))
    least = -(-size // widest)
    if least <= tokens:
        return ""
    return (f"{texts.where}: a record of {size:,} bytes, {least:,} tokens at least, is longer than a row "
            f"(train.seq_len+1={tokens:,}) and data.long_documents=refuse; fix: data.long_documents=split (pieces "
            f"that overlap by one token), train.seq_len={least - 1} or more, or shorter records")


SCANNED_RECORDS = 4096  # of each file's first piece read before launch for their own faults: fields, types, pairs
                        # (cheap); the first CHECKED_RECORDS of the good ones rendered and measured too


def first_records_problem(d, piece, template: Optional[str], variables: dict, row: Optional[tuple[int, int]] = None,
                          pairs: Optional[tuple] = None,
                          bad: Optional[BadRecords] = None) -> tuple[Optional[tuple[str, str]], int, bool]:
    """((key, why) or None, documents with something to learn, whether the piece was read to its end) of a file's
    first piece, read as the tokenize stage reads it: its first SCANNED_RECORDS records' fields and types, and of
    the first CHECKED_RECORDS good ones the messages, their roles, the template's rendering (_record_check). A bad
    record (its own fault, plugins/data/bad_records.py) goes to `bad`, every one, to be listed together; a setting's
    fault is the problem returned, as is a piece none of whose records has a token to learn."""
    bad = BadRecords() if bad is None else bad
    learned = seen = read = 0
    try:
        for _, texts, _ in itertools.islice(piece_documents(d, piece, keep_bad=True), SCANNED_RECORDS):
            read += 1
            if isinstance(texts, Bad):
                bad.add(texts.fault)
                continue
            if seen >= CHECKED_RECORDS:
                continue
            seen += 1
            try:
                found, learns = _record_check(d, texts, template, variables, row, pairs)
            except BadRecord as e:
                bad.add(e)
                continue
            if found:
                return found, learned, False
            learned += learns
    except ValueError as e:
        return ("data.paths", str(e)), learned, False
    except Exception as e:  # OSError, pyarrow's ArrowInvalid: a corrupt or truncated file
        return ("data.paths", f"{piece.path}: cannot be read ({type(e).__name__}: {e})"), learned, False
    finally:
        bad.read += read
    if seen and not learned and masks_loss_of(d):
        return ("data.loss_on", f"{piece.path}: none of its first {seen} record(s) has a token to learn ("
                                + format_of(d).nothing_learned + ")"), 0, False
    return None, learned, seen < CHECKED_RECORDS and read < SCANNED_RECORDS


def _record_check(d, texts, template: Optional[str], variables: dict, row: Optional[tuple[int, int]],
                  pairs: Optional[tuple]) -> tuple[Optional[tuple[str, str]], bool]:
    """(a setting's fault, (key, why), or None; whether the record has a token to learn) of one record read before
    launch: longer than a row whatever the tokenizer makes of it (row: the tokens a row holds and the most bytes a
    token covers, where a longer record is refused), no chat template for a conversation, a pair's completion past
    the row (pairs: the tokenizer and a row's tokens, where pairs are tokenized now); BadRecord for its own fault
    (roles, tool calls, reasoning, a rendering that fails)."""
    if row and (why := _longer_than_a_row(texts, template, variables, *row)):
        return ("data.long_documents", why), False
    if isinstance(texts, Unanswered) and template and (why := render_problem(texts.chat, template)):
        raise BadRecord(why)
    if isinstance(texts, Prompted) and texts.conversational and not template:
        return ("data.chat_template", f"{texts.where}: the {texts.kind} is made of conversations, which are "
                                      "rendered with a chat template, and there is none"), False
    if isinstance(texts, Prompted) and texts.conversational and (why := texts.render_problem(template)):
        raise BadRecord(why)
    if isinstance(texts, Prompted) and pairs is not None:
        try:  # (its rendering is checked above: what is left is the row)
            texts.documents(*pairs)
        except BadRecord:
            raise
        except InputFault as e:
            return ("train.seq_len", str(e)), False
    if not isinstance(texts, Chat):
        return None, bool(texts and texts[-1])
    if not template:
        return ("data.chat_template", f"{texts.where}: the record is a conversation, which is rendered with a chat "
                                      "template, and there is none"), False
    if why := render_problem(texts, template):
        raise BadRecord(why)
    made = chat_spans(template, texts, masks_loss_of(d), (), **chat_options(d), **variables)
    return None, any(b > a for example in made for a, b in example.spans)


def read_first_records(files: list[tuple[str, Path]], cfg, sniff_bytes: int) -> tuple[list[tuple], BadRecords]:
    """(the refusals, the bad records read) of the first records of each records file among `files` (its first
    piece of sniff_bytes: plugins/data/sources.py's SNIFF_BYTES) checked by first_records_problem; then every bad
    record in one refusal, the keys the records make do nothing (no_effect), and records too few to hold one out."""
    d, bad = cfg.data, BadRecords()
    chosen = [(name, path) for name, path in files if suffix_of(path) in RECORDS]
    if not chosen:
        return [], bad
    try:
        template = tokenizers.chat_template(d)
        variables = tokenizers.template_variables(d)
    except (OSError, ValueError, KeyError):  # said by the data rules (data.chat_template[_name], data.tokenizer)
        return [], bad
    if template is None and format_of(d).always_rendered:
        return [], bad  # said by the data rules (a chat needs a template)
    longest = longest_record(cfg)
    widest = tokenizers.widest_token(d) if longest else None
    row = (longest, widest) if widest else None
    # preference pairs tokenized as the tokenize stage will (a BPE is learned there: not before): a completion that
    # starts past a row is refused now
    pairs = None
    if makes_documents(d) and (d.tokenizer == "bytes" or tokenizers.hf_folder(d.tokenizer) is not None):
        try:
            pairs = tokenizers.make(d), cfg.train.seq_len + 1
        except (OSError, ValueError):  # said by the data rules (data.tokenizer)
            pass
    documents, whole, firsts = 0, True, []
    for name, path in chosen:
        lay = layout([(name, path)], sniff_bytes, d.val_fraction)
        firsts += lay.pieces[:1]
        found, learned, complete = first_records_problem(d, lay.pieces[0], template, variables, row, pairs, bad) \
            if lay.pieces else (None, 0, True)
        if found:
            key, why = found
            rule, _, fix = why.partition("; fix: ")
            setting = (key, OmegaConf.select(cfg, key) if key != "data.paths" else list(d.paths), rule,
                       fix or ("repair the record, or remove the file from data.paths" if key == "data.paths" else
                               "data.chat_template= a template for these records" if key == "data.chat_template" else
                               "records with something to learn, or data.loss_on=all"))
            return [setting, *bad_records_refusal(bad, d)], bad
        documents += learned
        whole = whole and complete and not lay.left_out and len(lay.pieces) <= 1
    if refused := bad_records_refusal(bad, d):
        return refused, bad
    if idle := no_effect_problems(d, firsts):
        return idle, bad
    if whole and documents < 2 and all(suffix_of(path) in RECORDS for _, path in files):
        return [("data.paths", list(d.paths), f"the records hold {documents} document(s) with something to learn in "
                 "all: one is held out for evaluation (data.val_fraction) and one at least is trained on",
                 "more records (two at least)")], bad
    return [], bad
