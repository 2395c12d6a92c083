"""A record as the tokenize stage reads it: its fields by their type (text, or lists of messages), a chat rendered
with the chat template and the tokens the model learns in it. The same reading of a file's first records before
launch is plugins/data/first_records.py, so that a format mistake is refused before any stage starts."""
from __future__ import annotations

import re
from typing import Iterator, Optional

import numpy as np

from common.problem import InputFault
from plugins.data import tokenizer as tokenizers
from plugins.data.chat import (STANDARD_ROLES, NotExtending, completion_span, encode_spans, render,
                               roles)
from plugins.data.chat_turns import Example, examples
from plugins.data.reasoning import FIELD as REASONING
from plugins.data.reasoning import as_template_reads, reasoning_of, reasoning_problem
from plugins.data.bad_records import Bad, skips
from plugins.data.formats.spec import format_of
from plugins.data.piece_records import BadRecord, documents, kind_of, preview, records


def masks_loss(cfg) -> bool:
    """Whether the records say which tokens the model learns (the shards then hold a mask beside the tokens)."""
    return masks_loss_of(cfg.data)


def masks_loss_of(d) -> bool:
    return format_of(d).masks_loss(d)


def makes_documents(d) -> bool:
    """Whether the format's records make their own documents (pairs, unpaired records: prompted_records.py)."""
    return format_of(d).makes_documents


def piece_documents(d, piece, keep_bad: Optional[bool] = None) -> Iterator[tuple[str, tuple[bytes, ...], bool]]:
    """(split, its texts, closes its document) of a piece: one text, a record's prompt and completion
    (data.format=prompt_completion; a record whose completion is empty has no texts: nothing in it would be learned,
    it is counted and left out), or a chat record's messages (Chat; a prompt and completion that are lists of
    messages, TRL's conversational form: Conversation; one whose every answer is empty is left out as an empty
    completion is: it would teach the stop token alone). A record at fault itself (BadRecord, InputFault) is refused,
    or with keep_bad (default: data.bad_records=skip) yielded as a Bad in its place, and reading goes on."""
    keep_bad, d = skips(d) if keep_bad is None else keep_bad, _plain(d)
    fmt = format_of(d)
    if not fmt.records:
        for split, text, closes, where in documents(piece, d.text_field, d.val_fraction):
            yield split, (Record if piece.kind != "text" or piece.opens else Continued)((text,), where), closes
        return
    for split, record, where in records(piece, fmt.fields(d), d.val_fraction, fmt.optional(d), keep_bad):
        try:
            if isinstance(record, BadRecord):
                raise record
            document = fmt.document(d, record, where)  # (Pair, Chat, Unanswered, Record, or () for nothing to learn)
        except InputFault as e:  # (a piece that cannot be read is raised by `records` itself: not one record's)
            if not keep_bad:
                raise
            document = Bad(e)
        yield split, document, True


class _Keys(dict):
    """A data config as a plain dict, its keys read as attributes too: it is read for every record, and OmegaConf's
    reading of a key costs more than the record's own (most of the check before launch's time on chats)."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _plain(d):
    from omegaconf import DictConfig, OmegaConf

    return _Keys(OmegaConf.to_container(d, resolve=True)) if isinstance(d, DictConfig) else d


def answers(chat: "Chat", d) -> bool:
    """Whether a chat has something to learn besides the stop token where only answers are learned: an answer (the
    assistant's message, a Conversation's completion) with text or tool calls."""
    if not masks_loss_of(d):
        return True
    said = chat.completion if isinstance(chat, Conversation) else \
        [m for m in chat.messages if m["role"] == "assistant"]
    learned = slice(None) if d.get("learn_reasoning", True) else slice(1, None)  # (reasoning, answer), or answer
    return not said or any(m.get("tool_calls") or any(part.strip() for part in reasoning_of(m)[learned])
                           for m in said)


class Unanswered(tuple):
    """A chat left out (no texts, as an empty completion), kept for the checks before launch: its roles and tool
    calls are refused as a rendered chat's are."""

    def __new__(cls, chat: "Chat"):
        left = super().__new__(cls, ())
        left.chat = chat
        return left




def encode_inputs(texts, joint: bool) -> tuple[bytes, ...]:
    """What is encoded of a document: its texts (a text, or a prompt and its completion apart); joint (TRL's way):
    the prompt, and the prompt and completion as one text."""
    return (texts[0], texts[0] + texts[1]) if joint and len(texts) == 2 else tuple(texts)


def document_ids(tok: tokenizers.Tokenizer, pieces: list[np.ndarray], closes: bool, opens: bool, masked: bool,
                 joint: bool) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """A document's ids as at inference and which are learned: the tokenizer's <bos> where its post-processor adds
    one (Llama 3's <|begin_of_text|>) before a document's start, its texts' ids, and one <eos> where it closes (none
    added when the text already ends with it). A prompt's tokens (and the <bos>) are not learned; the completion's
    and its <eos> are. joint: pieces are the prompt's ids and the prompt and completion's together, the first
    len(<bos> + prompt) tokens not learned, as TRL's completion_mask."""
    head = np.asarray(tok.bos if opens else (), dtype=np.int64)
    body = pieces[1] if joint and len(pieces) == 2 else np.concatenate(pieces)
    prompt = len(pieces[0]) if len(pieces) == 2 else 0
    tail = [tok.eos] if closes and not (len(body) and body[-1] == tok.eos) else []
    ids = np.concatenate([head, body, np.asarray(tail, dtype=np.int64)])
    if not masked:
        return ids, None
    trained = np.ones(len(ids), dtype=bool)
    trained[:len(head) + prompt] = False
    return ids, trained


class Record(tuple):
    """A record's texts (its prompt and its completion), knowing where it is (for a message)."""

    def __new__(cls, texts, where):
        record = super().__new__(cls, texts)
        record.where = where
        return record


class Continued(Record):
    """A text piece that goes on a document begun in the piece before (no <bos> before it)."""


def messages_problem(messages, what: str) -> str:
    """Why `messages` is not a list of {role, content} messages of text ('' when it is)."""
    if not isinstance(messages, list):
        return f"{what} is {_kind(messages)}, not a list of {{role, content}} messages: {preview(messages)}"
    if not messages:
        return f"{what} is an empty list of messages"
    for i, m in enumerate(messages, 1):
        if not isinstance(m, dict):
            return f"{what}'s message {i} is {_kind(m)}, not a {{role, content}} object: {preview(m)}"
        for field in ("role", "content"):
            if field not in m:
                return f"{what}'s message {i} has no {field!r} (its fields: {', '.join(m) or 'none'})"
            if not isinstance(m[field], str):
                return (f"{what}'s message {i} has a {field!r} that is {_kind(m[field])}, not text: "
                        f"{preview(m[field])}")
        if m.get(REASONING) is not None and not isinstance(m[REASONING], str):
            return (f"{what}'s message {i} has a {REASONING!r} that is {_kind(m[REASONING])}, not text (or null): "
                    f"{preview(m[REASONING])}")
    return ""


def _kind(value) -> str:
    return "null" if value is None else kind_of(value)


class Chat(Record):
    """A chat record's messages, as a document's texts (their contents: what a BPE learns from); the tokenize stage
    renders it with the chat template and learns the assistant's tokens (plugins/data/chat.py)."""

    def __new__(cls, messages, where, tools=None):
        if why := messages_problem(messages, "the record's data.messages_field"):
            raise InputFault(f"{where}: {why}; fix: records whose data.messages_field is a list of "
                             "{\"role\": ..., \"content\": \"text\"} objects")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise InputFault(f"{where}: the record's tools (data.tools_field) are {_kind(tools)}, not a list of JSON "
                             f"schemas: {preview(tools)}; fix: a list of {{\"type\": \"function\", \"function\": "
                             "{...}} objects, as transformers' apply_chat_template(tools=...) takes them")
        chat = super().__new__(cls, ("".join(reasoning_of(m)).encode("utf-8") for m in messages), where)
        chat.messages, chat.tools = messages, tools or None
        return chat


def check_conversation(prompt, completion, where, d) -> None:
    """InputFault naming the record where a prompt and a completion of which one is a list of messages are not both
    lists of {role, content} messages (TRL's conversational form; a prompt/completion or an unpaired record's)."""
    if isinstance(prompt, list) != isinstance(completion, list):
        key, other_key, other = ("prompt_field", "completion_field", completion) if isinstance(prompt, list) \
            else ("completion_field", "prompt_field", prompt)
        raise InputFault(f"{where}: data.{key} ({d[key]!r}) is a list of messages and data.{other_key} "
                         f"({d[other_key]!r}) is {_kind(other)}: a prompt/completion record is either two texts "
                         "or two lists of {role, content} messages (TRL's conversational form); fix: repair the "
                         "record")
    for value, key in ((prompt, "prompt_field"), (completion, "completion_field")):
        if why := messages_problem(value, f"data.{key} ({d[key]!r})"):
            raise InputFault(f"{where}: {why}; a prompt/completion record is either two texts or two lists "
                             "of messages (TRL's conversational form); fix: repair the record")


class Conversation(Chat):
    """A prompt/completion record in TRL's conversational form (both lists of messages): rendered with the chat
    template, the prompt with the generation prompt and the completion as what follows it; the completion learned."""

    def __new__(cls, prompt, completion, where, d):
        check_conversation(prompt, completion, where, d)
        chat = super().__new__(cls, prompt + completion, where)
        chat.prompt, chat.completion = prompt, completion
        return chat


def chat_ids(tok: tokenizers.Tokenizer, chat: Chat, masked: bool = True, turns: str = "auto",
             learn_reasoning: bool = True) -> list[tuple[np.ndarray, np.ndarray]]:
    """A chat record's training examples (data.chat_turns: one, or one per assistant turn), each as (its ids: the
    rendered template's, then <eos> unless the template writes it; which are the assistant's, a Conversation's
    completion's): an appended <eos> too when the example ends with the assistant's turn (it learns to stop there)."""
    if why := render_problem(chat, tok.chat_template):
        raise BadRecord(why)
    made = []
    for text, spans, whole, ends_with_answer in chat_spans(tok.chat_template, chat, masked, tok.stops, turns,
                                                           learn_reasoning, **(tok.special or {})):
        ids, trained = encode_spans(tok.with_offsets(), text, spans, whole)
        closes = masked and any(text.endswith(s, 0, end) for _, end in spans[-1:] for s in tok.stops if s)
        if tok.eos in ids or closes:  # the template ends turns with a stop itself (ChatML's <|im_end|>, Gemma's
            made.append((ids, trained))  # <end_of_turn>): its assistant mask holds it; one more: a second stop
            continue
        made.append((np.append(ids, tok.eos), np.append(trained, ends_with_answer)))
    return made


def chat_options(d) -> dict:
    """data.chat_turns and data.learn_reasoning, as chat_ids takes them."""
    return {"turns": d.get("chat_turns", "auto"), "learn_reasoning": d.get("learn_reasoning", True)}


def role_problem(chat: Chat, template: str) -> str:
    """Why a message's role cannot be rendered as meant ('' when every one can): neither a standard role nor one the
    template names, it would render as the template's fallback, or not at all (ShareGPT's 'human')."""
    unknown = next((m["role"] for m in chat.messages if m["role"] not in roles(template)), None)
    if unknown is None:
        return ""
    return (f"{chat.where}: a message's role {unknown!r} is neither one of {', '.join(STANDARD_ROLES)} nor named by "
            "the chat template (it would render as the template's fallback, or not at all); fix: rename the role in "
            "the records, or data.chat_template= a template that knows it")


def render_problem(chat: Chat, template: str) -> str:
    """Why the template cannot render the chat as meant ('' when it can): its roles, then its tool calls."""
    return role_problem(chat, template) or tools_problem(chat, template) or \
        (f"{chat.where}: {why}" if (why := reasoning_problem(chat.messages, template)) else "")


def tools_problem(chat: Chat, template: str) -> str:
    """Why a message's tool calls would not reach the model ('' when they would): a template that never reads
    `tool_calls` drops them, and a call with empty content trains an empty turn."""
    if getattr(chat, "tools", None) and not re.search(r"\btools\b", template):
        return (f"{chat.where}: the record has tools (data.tools_field), and the chat template never reads tools: "
                "the model would not see them; fix: data.chat_template= the model's own template that renders "
                "tools (Qwen2.5's, Llama 3.1's), or records without them")
    at = next((i for i, m in enumerate(chat.messages, 1) if m.get("tool_calls")), None)
    if at is None or "tool_calls" in template:
        return ""
    return (f"{chat.where}: message {at} has tool_calls, and the chat template never reads tool_calls: the calls "
            "would be dropped and what is left of the turn trained; fix: data.chat_template= the model's own "
            "template that renders tool calls (Qwen2.5's, Llama 3.1's), or records without them")


def chat_spans(template: str, chat: Chat, masked: bool = True, stops: tuple[str, ...] = (), turns: str = "auto",
               learn_reasoning: bool = True, **variables) -> list[Example]:
    """The record's training examples (plugins/data/chat_turns.py): (the rendered text, the character spans learned,
    whether their ends go back to whole tokens), the record named on a failure; `stops`: the tokenizer's special
    tokens, after the one that closes a turn nothing is learned."""
    messages = as_template_reads(chat.messages, template)
    try:
        if not masked:
            text, _ = render(template, messages, **variables)
            return [Example(text, [(0, len(text))], False, messages[-1]["role"] == "assistant")]
        if isinstance(chat, Conversation):
            text, span = completion_span(template, as_template_reads(chat.prompt, template),
                                         as_template_reads(chat.completion, template), **variables)
            return [Example(text, [span], False, True)]
        if getattr(chat, "tools", None):  # as transformers passes them (templates test `{% if tools %}`)
            variables = {**variables, "tools": chat.tools}
        return examples(template, messages, turns, stops, learn_reasoning, **variables)
    except NotExtending as e:
        raise BadRecord(f"{chat.where}: {e}; fix: " + ("data.chat_turns=each (an example per assistant turn, each "
                                                       "as at inference), " if turns == "all" else "")
                        + "data.chat_template= a template whose renderings of a conversation's beginning are the "
                        "start of the whole (or with {% generation %} tags around the assistant's turns), or "
                        "data.loss_on=all") from None
    except Exception as e:  # jinja2's TemplateError, raise_exception's message, a sandbox's refusal
        raise BadRecord(f"{chat.where}: the chat template cannot render a record: {type(e).__name__}: {e}; "
                        f"fix: data.chat_template= a template for these messages") from None


CHECKED_RECORDS = 32  # records of each file read before launch, as the tokenize stage reads them, rendered and
#                      measured (plugins/data/first_records.py; no_effect.py reads as many)
