"""An assistant message's reasoning, as reasoning models' templates read it: Qwen3's reads `reasoning_content` (or
the `<think>...</think>` that opens the content), DeepSeek-R1's only the content (it splits it at `</think>` and
keeps the answer). A record may give either form; each template is handed the one it reads."""
from __future__ import annotations

THINK = ("<think>", "</think>")  # the reasoning block's tags in the reasoning models' templates and outputs
FIELD = "reasoning_content"  # the messages' field (Qwen3's templates, vLLM's and TRL's reasoning records)


def reasoning_of(message: dict) -> tuple[str, str]:
    """(its reasoning, its answer) of a message: its reasoning_content and content, else the content split where
    Qwen3's template splits it (the text before the last </think>, after its <think>; the text after it)."""
    content = message.get("content") or ""
    if isinstance(message.get(FIELD), str):
        return message[FIELD], content
    if THINK[1] in content:
        return content.split(THINK[1])[0].split(THINK[0])[-1], content.split(THINK[1])[-1]
    return "", content


def reads_reasoning(template: str) -> str:
    """How a template reads a message's reasoning: 'field' (reasoning_content), 'content' (a <think> block in the
    content, which it splits at </think>), or '' (it reads none: reasoning given to it is dropped)."""
    return "field" if FIELD in template else "content" if THINK[1] in template else ""


def as_template_reads(messages: list[dict], template: str) -> list[dict]:
    """The messages with their reasoning where the template reads it: reasoning_content moved into the content as
    <think>\\n...\\n</think>\\n\\n for a template that reads only the content (DeepSeek-R1's)."""
    if reads_reasoning(template) != "content" or not any(isinstance(m.get(FIELD), str) for m in messages):
        return messages
    return [m if not isinstance(m.get(FIELD), str) else
            {**{k: v for k, v in m.items() if k != FIELD}, "content": written(*reasoning_of(m))} for m in messages]


def written(reasoning: str, answer: str) -> str:
    """A reasoning and its answer as a reasoning model writes them (Qwen3's and DeepSeek-R1's form)."""
    return f"{THINK[0]}\n{reasoning.strip(chr(10))}\n{THINK[1]}\n\n{answer.lstrip(chr(10))}"


def reasoning_problem(messages: list[dict], template: str) -> str:
    """Why a message's reasoning would not reach the model ('' when it would): a template that reads none drops
    it. Returns the message's number and what to do."""
    at = next((i for i, m in enumerate(messages, 1) if isinstance(m.get(FIELD), str) and m[FIELD].strip()), None)
    if at is None or reads_reasoning(template):
        return ""
    return (f"message {at} has reasoning ({FIELD}), and the chat template reads none (neither {FIELD} nor a "
            f"{THINK[0]} block in the content): the reasoning would be dropped; fix: data.chat_template= the "
            "reasoning model's own template (Qwen3's, DeepSeek-R1's), or records without it")
