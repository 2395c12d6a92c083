"""Preference pairs: a prompt with a chosen and a rejected completion, made into the two documents a preference
objective compares (plugins/objectives/dpo.py), token for token as TRL's DPOTrainer makes them.

A pair comes in one of TRL's three forms:
  standard          prompt, chosen, rejected are texts: <eos> closes each completion (appended unless it ends so)
  conversational    they are lists of messages: the prompt rendered by the chat template with the generation
                    prompt, the prompt and each completion rendered whole (the template's own stop, no <eos> added)
  implicit prompt   chosen and rejected only (texts or conversations): their common beginning is the prompt
                    (the messages they share; or the characters, a space before the first difference going to the
                    completions)
Each document is the prompt and its completion encoded together, as at inference. The learned part starts where the
prompt's ids and the prompt-and-completion's ids first differ, the earlier of the chosen's and the rejected's
(TRL's common_prefix_length): a token merged across the boundary is learned, and both documents learn from the same
position on. The chosen document comes first: a corpus holds a pair as documents 2k and 2k+1.
"""
from __future__ import annotations

from typing import Union

import numpy as np

from common.problem import InputFault
from plugins.data import tokenizer as tokenizers
from plugins.data.chat import render

Text = Union[str, list]  # a text, or a list of {role, content} messages


def split_prompt(chosen: Text, rejected: Text) -> tuple[Text, Text, Text]:
    """(prompt, chosen, rejected) of an implicit-prompt pair: what chosen and rejected begin with alike, and the rest
    of each (TRL's extract_prompt: messages compared whole; texts by character, a space before the first difference
    kept with the completions)."""
    at = 0
    for at in range(min(len(chosen), len(rejected))):
        if chosen[at] != rejected[at]:
            if at and chosen[at - 1] == " ":
                at -= 1
            break
    else:
        at = min(len(chosen), len(rejected))
    return chosen[:at], chosen[at:], rejected[at:]


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many ids a and b begin with alike."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def pair_ids(tok: tokenizers.Tokenizer, prompt: Text, chosen: Text,
             rejected: Text) -> list[tuple[np.ndarray, np.ndarray]]:
    """The chosen and the rejected document: each (its ids, which are learned)."""
    return prompted_ids(tok, prompt, (chosen, rejected))


def prompted_ids(tok: tokenizers.Tokenizer, prompt: Text, completions) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each completion's document, the prompt and it encoded together: (its ids, which are learned), learned from the
    earliest position where a document's ids leave the prompt's alone (TRL's common_prefix_length; a pair's two
    documents learn from the same position; an unpaired record's one is KTO's)."""
    if isinstance(prompt, list):
        head = _chat_ids(tok, prompt, generation_prompt=True)
        wholes = [_chat_ids(tok, prompt + completion) for completion in completions]
    else:
        head = _text_ids(tok, prompt)
        wholes = [_closed(tok, _text_ids(tok, prompt + completion)) for completion in completions]
    start = min(common_prefix(head, ids) for ids in wholes)
    return [(ids, np.arange(len(ids)) >= start) for ids in wholes]


def _text_ids(tok: tokenizers.Tokenizer, text: str) -> np.ndarray:
    """A text's ids as the tokenizer's own call gives them: its <bos> (where its post-processor adds one), then the
    text's."""
    (ids,) = tok.encode([text.encode("utf-8")])
    return np.concatenate([np.asarray(tok.bos, dtype=np.int64), ids])


def _closed(tok: tokenizers.Tokenizer, ids: np.ndarray) -> np.ndarray:
    return ids if len(ids) and ids[-1] == tok.eos else np.append(ids, tok.eos)


def _chat_ids(tok: tokenizers.Tokenizer, messages: list, generation_prompt: bool = False) -> np.ndarray:
    """The messages rendered by the tokenizer's chat template and encoded as transformers' apply_chat_template
    encodes them (the template writes its own special tokens: none added)."""
    text, _ = render(tok.chat_template, messages, add_generation_prompt=generation_prompt, **(tok.special or {}))
    return np.asarray(tok.with_offsets().encode(text, add_special_tokens=False).ids, dtype=np.int64)


def check_pair(pair, made: list[tuple[np.ndarray, np.ndarray]], row: int) -> int:
    """1 when a record's documents are longer than a row (train.seq_len+1 tokens: the row holds their first ones,
    TRL's max_length truncation keeping the start), else 0; refused, naming the record, when a completion starts
    past the row (nothing of it would be learned: TRL drops such pairs without a word). pair: a Prompted record."""
    for (ids, learned), which in zip(made, pair.names):
        if not learned[1:row].any():
            start = int(np.argmax(learned)) if learned.any() else len(ids)
            raise InputFault(f"{pair.where}: the {pair.kind}'s {which} completion starts at token {start:,}, past "
                             f"a row of train.seq_len+1={row:,} tokens: nothing of it would be learned; fix: "
                             f"train.seq_len={start} or more, or a shorter prompt")
    return int(any(len(ids) > row for ids, _ in made))
