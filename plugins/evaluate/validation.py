"""The run's own data, for the evaluate stage: its validation documents as text (the shipped val_perplexity task
scores the model on them, lm-eval's loglikelihood_rolling) and the prompts of its first validation records (the
generations' prompts, with the answers the records give; a text document's opening and what follows it), both read
from the tokenize stage's output.

The documents are the token shards' (plugins/data/shards.py), decoded with the tokenizer that made them, in the
order the shards hold them (a mixture: its sources' in data.mix's order); a chat template's markers are kept as
their text, which the tokenizer reads back as the same special tokens, so the text is what trained (the closing
<eos> left to lm-eval's rolling windows, which begin with their own). The prompts are token ids, not
text: a chat record's prompt is its rendering up to the first token the model learns (the template's assistant
header included), so the model answers what it was trained to answer, with nothing tokenized twice.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from plugins.data.corpus import TOKENIZER_DIR, TOKENS_DIR
from plugins.data.prompted_records import UNDESIRABLE
from plugins.data.shards import read_all
from plugins.data.tokenizer import load_saved
from storage.fsio import atomic_write_bytes

TASK = "val_perplexity"


def _validation(tokenize_out: Path, stride: int = 1) -> Iterator[tuple[np.ndarray, Optional[np.ndarray]]]:
    """Each validation document's tokens, with which of them the model learns (None: the corpus says not). stride:
    the documents an example holds, its first scored (a preference pair's chosen: its rejected is no text the model
    should write)."""
    for corpus in read_all(Path(tokenize_out) / TOKENS_DIR, packed=False):
        for i in range(0, len(corpus.val), stride):
            yield np.asarray(corpus.val[i]), None if corpus.val_mask is None else np.asarray(corpus.val_mask[i])


def write_documents(tokenize_out: Path, path: Path, limit: Optional[int], stride: int = 1) -> int:
    """The validation documents as JSON Lines ({"text": ...}), the first `limit` (None: all), an example's first
    where it holds `stride`; their number."""
    saved = load_saved(Path(tokenize_out) / TOKENIZER_DIR)
    tok, lines = saved.with_offsets(), []
    for ids, _ in _validation(tokenize_out, stride):
        ids = ids[:-1] if len(ids) and ids[-1] == saved.eos else ids  # lm-eval's rolling windows put their own
        text = tok.decode([int(i) for i in ids], skip_special_tokens=False)
        if text.strip():
            lines.append(json.dumps({"text": text}, ensure_ascii=False))
        if limit is not None and len(lines) >= limit:
            break
    if not lines:
        raise RuntimeError(f"{TASK}: the validation split holds no text to score (tokenize output {tokenize_out})")
    atomic_write_bytes(path, ("\n".join(lines) + "\n").encode())
    return len(lines)


def prompts(tokenize_out: Path, n: int, opening: int = 32, stride: int = 1) -> list[tuple[list[int], list[int]]]:
    """The first n validation records' prompts, with the answers the records give: in a chat or prompt-completion
    corpus a record's ids up to its first learned token and the learned ids from there to the next unlearned one
    (none of an unpaired record labelled undesirable);
    in a text corpus a document's first `opening` tokens (at most half of it) and the next `opening`."""
    out = []
    for ids, learned in _validation(tokenize_out, stride):
        if len(out) >= n:
            break
        if learned is None:
            first = min(opening, len(ids) // 2)
            if first:
                out.append(([int(i) for i in ids[:first]], [int(i) for i in ids[first:2 * first]]))
            continue
        at = np.flatnonzero(learned)
        if not len(at) or at[0] == 0:
            continue
        first = int(at[0])
        if learned[first] == UNDESIRABLE:  # an unpaired record's completion labelled undesirable: no answer to show
            continue
        gaps = np.flatnonzero(learned[first:] == 0)
        last = first + int(gaps[0]) if len(gaps) else len(ids)
        out.append(([int(i) for i in ids[:first]], [int(i) for i in ids[first:last]]))
    return out
