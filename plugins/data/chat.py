"""Chat records rendered as Hugging Face's `apply_chat_template` renders them, with the tokens the model must learn.

A chat record is a list of `{role, content}` messages. A tokenizer folder carries its model's chat template (Jinja,
in chat_template.jinja or tokenizer_config.json); rendering it the way `transformers` does (the same sandboxed
environment and globals, `trim_blocks` and `lstrip_blocks`, its `{% generation %}` tag around what the assistant
says) gives the text the model was trained to read, and the character spans of the assistant's turns. The tokens
those spans cover are the ones whose labels enter the loss (assistant-only loss, TRL's `assistant_only_loss`); the
others get -100. The templates models ship have no generation tags: there the assistant's spans are found by
rendering the conversation's prefixes (prefix_spans: the first turn's, and a later turn's only where the rendering
writes it otherwise than the first), which gives what tags in the natural places would.

The tokenize stage reads chat records with it (data.format=chat, plugins/data/corpus.py).
"""
from __future__ import annotations

import functools
import json
import re
from datetime import datetime
from pathlib import Path
from typing import Optional

import numpy as np

from plugins.data.reasoning import THINK, reasoning_of

TEMPLATE_FILE = "tokenizer_config.json"
STANDARD_ROLES = ("system", "user", "assistant", "tool")  # what chat templates render (OpenAI's and HF's roles)


def read_template_file(path: Path) -> str:
    """A template file's text (or a JSON file's); ValueError naming the file where it is not UTF-8."""
    try:
        return Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); templates "
                         "are read as UTF-8, as transformers reads them") from None


def _json_template(path: Path):
    try:
        return json.loads(read_template_file(path)).get("chat_template")
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON ({e})") from None


def templates_of(folder: Path) -> dict[str, str]:
    """The chat templates a Hugging Face tokenizer folder carries, by name ('default': the one apply_chat_template
    uses), read where transformers reads them: chat_template.jinja, chat_template.json, tokenizer_config.json (a
    text, or the list form [{name, template}]), and additional_chat_templates/NAME.jinja."""
    folder = Path(folder)
    found: dict[str, str] = {}
    for name in ("chat_template.json", TEMPLATE_FILE):
        path = folder / name
        if path.is_file():
            template = _json_template(path)
            if isinstance(template, str):
                found.setdefault("default", template)
            elif isinstance(template, list):
                for entry in template:
                    if isinstance(entry, dict) and isinstance(entry.get("name"), str) \
                            and isinstance(entry.get("template"), str):
                        found.setdefault(entry["name"], entry["template"])
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        found["default"] = read_template_file(jinja)  # what transformers writes now, and reads first
    extra = folder / "additional_chat_templates"
    if extra.is_dir():
        for path in sorted(extra.glob("*.jinja")):
            found.setdefault(path.stem, read_template_file(path))
    return found


def template_of(folder: Path, name: str = "") -> Optional[str]:
    """The chat template a Hugging Face tokenizer folder carries (None: it has none), or its template `name`."""
    return templates_of(folder).get(name or "default")


@functools.lru_cache(maxsize=8)
def compiled(template: str):
    """The template in transformers' environment: sandboxed (templates from the Hub are untrusted code), trimmed
    blocks, loop controls, its tojson (no HTML escaping), raise_exception and strftime_now, and `generation`."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: records where the assistant's text lands in the output."""
        tags = {"generation"}
        spans: Optional[list[tuple[int, int]]] = None
        blocks: Optional[list[str]] = None

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller) -> str:
            text = caller()
            if self.spans is not None:
                start = sum(len(b) for b in self.blocks)
                self.spans.append((start, start + len(text)))
            return text

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
    return env.from_string(template), next(e for e in env.extensions.values() if isinstance(e, Generation))


def render(template: str, messages: list[dict], add_generation_prompt: bool = False,
           **variables) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered chat, the character spans of its `generation` blocks). variables: what templates read besides
    the messages (bos_token, eos_token, ...), as transformers passes the tokenizer's special tokens."""
    jinja, generation = compiled(template)
    blocks: list[str] = []
    generation.blocks, generation.spans = blocks, []
    try:
        for block in jinja.generate(messages=messages, add_generation_prompt=add_generation_prompt, **variables):
            blocks.append(block)
        return "".join(blocks), generation.spans
    finally:
        generation.blocks = generation.spans = None


def trained_tokens(offsets: list[tuple[int, int]], spans: list[tuple[int, int]],
                   whole_tokens: bool = False) -> np.ndarray:
    """Which tokens (given each token's character offsets in the rendered text) the spans cover: a token is trained
    from the one holding a span's first character to the one holding its last, as transformers' assistant mask.
    whole_tokens: a span's end is first moved back to the end of the last token wholly inside it (a span found by
    comparing renderings may end inside the next turn's opening token, e.g. the '<|' that '<|user|>' and
    '<|endoftext|>' share)."""
    mask = np.zeros(len(offsets), dtype=bool)
    starts = np.array([s for s, e in offsets])
    ends = np.array([e for s, e in offsets])
    for first, last in spans:
        if whole_tokens:
            inside = ends[(ends <= last) & (ends > first)]
            last = int(inside.max()) if len(inside) else first
        if last <= first:
            continue
        holding = np.nonzero((starts <= first) & (first < ends))[0]
        if not len(holding):
            break  # past the tokens (transformers: "out of bounds maybe due to truncation")
        closing = np.nonzero((starts <= last - 1) & (last - 1 < ends))[0]
        mask[holding[0]:(closing[0] + 1 if len(closing) else len(offsets))] = True
    return mask


_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


def has_generation_tags(template: str) -> bool:
    """Whether the template marks the assistant's text itself ({% generation %} ... {% endgeneration %})."""
    return bool(_GENERATION_TAG.search(template))


class NotExtending(ValueError):
    """The template's renderings of a conversation's prefixes do not extend each other: what the assistant said
    cannot be told from them (the record is refused, naming it)."""


# the message that follows an assistant's turn when its end is looked for: any turn's opening ends the one before
_PROBE = {"role": "user", "content": "?"}


def prefix_spans(template: str, messages: list[dict], text: str, stops: tuple[str, ...] = (),
                 **variables) -> list[tuple[int, int]]:
    """The character spans of the assistant's turns in `text` (the rendered conversation), for a template without
    generation tags: the first from the template's renderings of the conversation's prefixes (turn_span), each
    later one where it is built as the first (spans_like_first: no rendering), else from its own prefixes."""
    assistant = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    if not assistant:
        return []
    first = turn_span(template, messages, assistant[0], text, stops, **variables)
    later = spans_like_first(messages, text, assistant, first, **variables) if len(assistant) > 1 else []
    if later is None:
        later = [turn_span(template, messages, k, text, stops, **variables) for k in assistant[1:]]
    return [first] + later


def turn_span(template: str, messages: list[dict], k: int, text: str, stops: tuple[str, ...] = (),
              **variables) -> tuple[int, int]:
    """The character span of assistant message k in `text`: from where the rendering of messages[:k] with the
    generation prompt ends (what inference gives the model) to where the rendering of messages[:k+1] stops agreeing
    with the same conversation followed by one more (user) turn: its closing text (<|im_end|>, <|eot_id|>, </s>, a
    newline), not the text a template writes only at a conversation's end; where that closing text starts with a
    special token (`stops`), the span ends after it, as the model's generation stops there (ChatML's newline after
    <|im_end|>, Gemma's after <end_of_turn>, is never generated). Each rendering must be a prefix of the next."""
    message = messages[k]
    reasoning, said = (s.strip() for s in reasoning_of(message))
    try:
        upto = text if k + 1 == len(messages) else render(template, messages[:k + 1], **variables)[0]
        # what follows the turn: the conversation's own next message, else one more (user) turn rendered
        probe = render(template, messages[:k + 1] + [_PROBE], **variables)[0] if k + 1 == len(messages) \
            or messages[k + 1]["role"] != "user" else text
        end = _common_prefix(upto, probe)
        if k or not said:
            prompt, _ = render(template, messages[:k], add_generation_prompt=True, **variables)
        else:  # a chat that opens with the assistant: no empty conversation is rendered (templates read
            prompt = upto[:upto.rfind(said, 0, end)]  # messages[0]); its turn starts where its text does
    except Exception as e:  # raise_exception (roles must alternate, ...), a template reading messages[0]
        raise NotExtending(f"the template cannot render the conversation up to message {k + 1} (the "
                           f"assistant's), which finding what the assistant said needs: {type(e).__name__}: "
                           f"{e}") from None
    if not (text.startswith(prompt) and upto.startswith(prompt) and text[:end] == upto[:end]):
        raise NotExtending(f"the template's rendering of the messages before message {k + 1} (the "
                           "assistant's), with the generation prompt, is not the start of the whole "
                           f"conversation's rendering ({parting(prompt, text)}), so what the assistant said "
                           "cannot be told apart")
    if said and said not in text:
        raise NotExtending(f"the template's rendering holds nothing of message {k + 1}'s content (the "
                           "assistant's), so there is nothing of it to learn")
    if reasoning and reasoning not in text[len(prompt):end]:
        raise NotExtending(f"the template drops message {k + 1}'s reasoning (the assistant's) once a turn "
                           "follows it, so the whole conversation is not what the model read and "
                           "wrote at that turn")
    if said and said not in text[len(prompt):end]:
        raise NotExtending(f"the template renders message {k + 1} (the assistant's) otherwise when it ends the "
                           "conversation than when a turn follows it, so what the assistant said cannot be told "
                           "apart")
    return len(prompt), stop_end(text, len(prompt), end, said, stops, reasoning)


def spans_like_first(messages: list[dict], text: str, assistant: list[int], first: tuple[int, int],
                     **variables) -> Optional[list[tuple[int, int]]]:
    """The later assistant turns' spans where the rendering writes each as it wrote the first (whose span came from
    the prefix renderings, so its prompt is the start of the whole): every message's text found in order; between
    two messages' texts the same text wherever their roles are the same (a template that marks the last user turn,
    or places the system prompt there, writes it otherwise); around each later turn the same text as around the
    first (the previous turn's closing and the generation prompt before it, its closing through the stop token
    after it). None where any of it differs (reasoning, tool calls, a last turn written otherwise, as Qwen3's is):
    those turns need their own prefix renderings. One rendering for a chat of any length, where the prefixes take
    a rendering of each turn (quadratic in its turns)."""
    if assistant[0] == 0 or variables.get("tools"):
        return None
    texts = []
    for m in messages:
        if not isinstance(m.get("content"), str) or m.get("tool_calls") or reasoning_of(m)[0].strip():
            return None
        texts.append(m["content"].strip())
    ats, cursor = [], 0
    for said in texts:
        at = text.find(said, cursor) if said else -1
        if at < 0:
            return None
        ats.append(at)
        cursor = at + len(said)
    gaps: dict[tuple[str, str], str] = {}  # (the previous message's role, this one's): the text between them
    for k in range(assistant[0], len(messages)):
        between = text[ats[k - 1] + len(texts[k - 1]):ats[k]]
        if gaps.setdefault((messages[k - 1]["role"], messages[k]["role"]), between) != between:
            return None
    k0 = assistant[0]
    start, end = first
    before, after = ats[k0 - 1] + len(texts[k0 - 1]), ats[k0] + len(texts[k0])
    if not before <= start <= ats[k0] <= after <= end:
        return None
    opens, closing = start - before, text[after:end]  # the span starts past the generation prompt; its closing
    spans = []
    for k in assistant[1:]:
        after = ats[k] + len(texts[k])
        if messages[k - 1]["role"] != messages[k0 - 1]["role"] or text[after:after + len(closing)] != closing:
            return None
        spans.append((ats[k - 1] + len(texts[k - 1]) + opens, after + len(closing)))
    return spans


def stop_end(text: str, start: int, end: int, said: str, stops: tuple[str, ...], reasoning: str = "") -> int:
    """Where an assistant's turn text[start:end] ends for the model: after the special token that closes it (the first
    of `stops` after its content: a turn of tool calls alone has its calls before it), else at `end`. The answer is
    looked for after the turn's reasoning: a reasoning that quotes its answer ("6*7 is 42.") would otherwise end
    the turn at the first stop after the quote. The reasoning's own tags never stop a turn, even where a tokenizer
    makes them special: `</think>` is followed by the answer (or a tool call)."""
    stops = tuple(s for s in stops if s not in THINK)
    after = start
    if reasoning and (at := text.find(reasoning, start, end)) >= 0:
        after = at + len(reasoning)
    if said and (at := text.find(said, after, end)) >= 0:
        after = at + len(said)
    found = [(at, -len(s)) for s in stops if s and 0 <= (at := text.find(s, after, end)) and at + len(s) <= end]
    return min(found)[0] - min(found)[1] if found else end


def parting(prompt: str, text: str) -> str:
    """Where two renderings part, in words: what each has there."""
    at = _common_prefix(prompt, text)
    return f"after {at:,} characters the prompt has {prompt[at:at + 24]!r}, the whole {text[at:at + 24]!r}"


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def completion_span(template: str, prompt: list[dict], completion: list[dict],
                    **variables) -> tuple[str, tuple[int, int]]:
    """(the rendered prompt + completion, the completion's character span): TRL's conversational prompt-completion
    records, the prompt rendered with the generation prompt and the completion as what follows it, all of it (TRL's
    completion_mask: the newline a template writes after the stop token too)."""
    text, _ = render(template, prompt + completion, **variables)
    head, _ = render(template, prompt, add_generation_prompt=True, **variables)
    if not text.startswith(head):
        raise NotExtending("the template's rendering of the prompt with the generation prompt is not the start of "
                           "the prompt and completion's rendering, so the completion cannot be told apart")
    return text, (len(head), len(text))


def assistant_spans(template: str, messages: list[dict], stops: tuple[str, ...] = (),
                    **variables) -> tuple[str, list[tuple[int, int]], bool]:
    """(the rendered chat, the assistant's character spans, whether they came from comparing renderings): the
    template's generation tags where it has them (transformers' return_assistant_tokens_mask), else its renderings
    of the conversation's prefixes (prefix_spans)."""
    text, tagged = render(template, messages, **variables)
    if has_generation_tags(template):
        return text, tagged, False
    return text, prefix_spans(template, messages, text, stops, **variables), True


def special_texts(tokenizer) -> tuple[str, ...]:
    """The texts of a `tokenizers.Tokenizer`'s special tokens: a turn's stop among them (<|im_end|>, <end_of_turn>,
    <|eot_id|>, </s>), after which nothing of an assistant's turn is learned (prefix_spans's `stops`)."""
    return tuple(t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special)


def encode_chat(tokenizer, template: str, messages: list[dict], **variables) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, which of them the model must learn) of a chat record, with a `tokenizers.Tokenizer`: the
    rendered text encoded without added special tokens (the template writes them), as apply_chat_template does."""
    text, spans, by_prefix = assistant_spans(template, messages, special_texts(tokenizer), **variables)
    return encode_spans(tokenizer, text, spans, by_prefix)


def encode_spans(tokenizer, text: str, spans: list[tuple[int, int]],
                 whole_tokens: bool) -> tuple[np.ndarray, np.ndarray]:
    encoding = tokenizer.encode(text, add_special_tokens=False)
    return np.asarray(encoding.ids, dtype=np.int64), trained_tokens(encoding.offsets, spans, whole_tokens)


@functools.lru_cache(maxsize=8)
def roles(template: str) -> frozenset:
    """The roles a message may have under a template: the standard ones and any the template names (a quoted word:
    `message['role'] == 'ipython'`). A role outside them is a typo or another format's (ShareGPT's 'human', 'gpt')."""
    return frozenset(STANDARD_ROLES) | frozenset(re.findall(r"""['"](\w+)['"]""", template))
