"""A chat's training examples, by data.chat_turns: the whole conversation with every assistant turn learned (`all`),
or one example per assistant turn (`each`), or the last turn only (`last`); `auto` is `all` where the template's
renderings of a conversation's beginnings are the start of the whole, else `each`.

Reasoning models' templates rewrite earlier turns once a later one follows (Qwen3 drops an earlier answer's
reasoning; DeepSeek-R1 drops every turn's and opens the next one's in its generation prompt), so the whole
conversation is not what the model saw when it wrote an earlier turn. An example per turn is: the conversation up to
that turn as inference renders it (the template's own history, its generation prompt), then what the model writes
there (the turn's reasoning and answer, through the token that stops it), which alone is learned. Where the
template leaves even the last turn's reasoning out (DeepSeek-R1's), what the model writes is the generation prompt's
tail (`<think>\\n`) continued by the reasoning, `</think>`, the answer and the template's closing of the turn.
"""
from __future__ import annotations

from typing import NamedTuple

from plugins.data.chat import (_PROBE, NotExtending, _common_prefix, assistant_spans, has_generation_tags, parting,
                               render, stop_end)
from plugins.data.reasoning import reasoning_of, reads_reasoning, written



class Example(NamedTuple):
    """A training example of a chat: its text, the character spans learned, whether their ends go back to whole
    tokens (spans found by comparing renderings), whether it ends with the assistant's turn."""
    text: str
    spans: list[tuple[int, int]]
    whole_tokens: bool
    ends_with_answer: bool


def examples(template: str, messages: list[dict], turns: str = "auto", stops: tuple[str, ...] = (),
             learn_reasoning: bool = True, **variables) -> list[Example]:
    """The chat's training examples (see the module); learn_reasoning=False: an assistant turn's reasoning is read,
    not learned (what follows it is)."""
    assistant = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    if turns in ("all", "auto"):
        try:
            text, spans, whole = assistant_spans(template, messages, stops, **variables)
        except NotExtending:
            if turns == "all":
                raise
        else:
            if not learn_reasoning and len(spans) == len(assistant):
                spans = [_after_reasoning(text, span, messages[k]) for span, k in zip(spans, assistant)]
            return [Example(text, spans, whole, messages[-1]["role"] == "assistant")]
    chosen = assistant if turns in ("each", "auto") else assistant[-1:]
    made = []
    for k in chosen:
        text, span = turn_example(template, messages, k, stops, **variables)
        made.append(Example(text, [span if learn_reasoning else _after_reasoning(text, span, messages[k])],
                            not has_generation_tags(template), True))
    return made


def turn_example(template: str, messages: list[dict], k: int, stops: tuple[str, ...] = (),
                 **variables) -> tuple[str, tuple[int, int]]:
    """(the text of the conversation up to assistant message k as inference renders it and what the model writes
    there, the character span it writes: its reasoning and answer through the turn's stop token)."""
    reasoning, answer = (s.strip() for s in reasoning_of(messages[k]))
    try:
        text, tagged = render(template, messages[:k + 1], **variables)
        if has_generation_tags(template):
            return text, tagged[-1] if tagged else (len(text), len(text))
        prompt = render(template, messages[:k], add_generation_prompt=True, **variables)[0] if k else \
            text[:text.rfind(answer or reasoning)]  # a chat that opens with the assistant: where its text starts
    except Exception as e:  # raise_exception (roles must alternate, ...)
        raise NotExtending(f"the template cannot render the conversation up to message {k + 1} (the assistant's): "
                           f"{type(e).__name__}: {e}") from None
    start = len(prompt)
    if text.startswith(prompt) and _holds(text[start:], reasoning, answer):
        end = _turn_end(template, messages[:k + 1], text, start, reasoning, answer, **variables)
    elif reads_reasoning(template) == "content":
        text, end = _as_written(prompt, text, reasoning, answer, k)
    elif moved := _after_moved_system(template, messages, k, text, reasoning, answer, **variables):
        text, end = prompt + moved[0], start + moved[1]
    elif not text.startswith(prompt):
        raise NotExtending(f"the template's rendering of the messages before message {k + 1} (the assistant's), "
                           "with the generation prompt, is not the start of its rendering of the conversation up to "
                           f"that message ({parting(prompt, text)}), so what the assistant wrote cannot be told apart")
    else:
        lost = "reasoning" if reasoning and reasoning not in text[start:] else "answer"
        raise NotExtending(f"the template's rendering holds nothing of message {k + 1}'s {lost} (the "
                           "assistant's), so there is nothing of it to learn")
    return text, (start, stop_end(text, start, end, answer, stops, reasoning))


def _after_moved_system(template: str, messages: list[dict], k: int, text: str, reasoning: str, answer: str,
                        **variables) -> tuple[str, int]:
    """(the turn as the template writes it, where its closing ends in it), or () where this does not apply: for a
    template that writes the system prompt into the conversation's last user turn only (Mistral v3's and Nemo's), the
    conversation up to assistant message k renders without it, so the turn is what follows the history rendered
    without system messages; the example is then the prompt as inference renders it (the system prompt in the last
    user turn) followed by that turn."""
    bare = [m for m in messages[:k] if m["role"] != "system"]
    if len(bare) == k:
        return ()
    try:
        head = render(template, bare, add_generation_prompt=True, **variables)[0]
    except Exception:  # a template that needs its system message: not this case
        return ()
    if not text.startswith(head) or not _holds(text[len(head):], reasoning, answer):
        return ()
    end = _turn_end(template, messages[:k + 1], text, len(head), reasoning, answer, **variables)
    return text[len(head):], end - len(head)


def _holds(turn: str, reasoning: str, answer: str) -> bool:
    return (not reasoning or reasoning in turn) and (not answer or answer in turn)


def _turn_end(template: str, messages: list[dict], text: str, start: int, reasoning: str, answer: str,
              **variables) -> int:
    """Where the turn's closing text ends: where the rendering stops agreeing with the same conversation followed by
    a user's turn (not the text written only at a conversation's end), unless that turn rewrites this one (Qwen3's
    history without reasoning): then the rendering's end."""
    try:
        end = _common_prefix(text, render(template, messages + [_PROBE], **variables)[0])
    except Exception:  # a template that refuses the probe's turn: the rendering's end
        return len(text)
    return end if _holds(text[start:end], reasoning, answer) else len(text)


def _as_written(prompt: str, text: str, reasoning: str, answer: str, k: int) -> tuple[str, int]:
    """(the prompt continued by what the model writes, its end) for a template that drops the reasoning even from
    the conversation's last turn (DeepSeek-R1's): the generation prompt's tail past the history (`<think>\\n`)
    continued by the reasoning and the answer as the model writes them, then the template's closing of the turn."""
    common = _common_prefix(prompt, text)
    opened, turn = prompt[common:], text[common:]
    at = turn.rfind(answer) if answer else 0
    if at < 0:
        raise NotExtending(f"the template's rendering holds nothing of message {k + 1}'s answer (the assistant's), "
                           "so there is nothing of it to learn")
    raw = written(reasoning, answer)
    if not raw.startswith(opened):
        raise NotExtending(f"the template drops message {k + 1}'s reasoning (the assistant's), and its generation "
                           f"prompt ends with {opened!r}, which the turn as the model writes it ({raw[:40]!r}) does "
                           "not start with, so what the model writes cannot be told")
    made = prompt + raw[len(opened):] + turn[at + len(answer):]
    return made, len(made)


def _after_reasoning(text: str, span: tuple[int, int], message: dict) -> tuple[int, int]:
    """The span from after its reasoning's text (data.learn_reasoning=false: the reasoning is read, not learned)."""
    reasoning = reasoning_of(message)[0].strip()
    at = text.find(reasoning, span[0], span[1]) if reasoning else -1
    return (at + len(reasoning), span[1]) if at >= 0 else span
