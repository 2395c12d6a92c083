"""Chat records rendered as Hugging Face's `apply_chat_template` renders them, with the tokens the model must learn.

A chat record is a list of `{role, content}` messages. A tokenizer folder's `tokenizer_config.json` carries its
model's `chat_template` (Jinja); rendering it the way `transformers` does (the same sandboxed environment and
globals, `trim_blocks` and `lstrip_blocks`, its `{% generation %}` tag around what the assistant says) gives the
text the model was trained to read, and the character spans of the assistant's turns. The tokens those spans cover
are the ones whose labels enter the loss (assistant-only loss, TRL's `assistant_only_loss`); the others get -100.

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

TEMPLATE_FILE = "tokenizer_config.json"
STANDARD_ROLES = ("system", "user", "assistant", "tool")  # what chat templates render (OpenAI's and HF's roles)


def template_of(folder: Path) -> Optional[str]:
    """The chat template a Hugging Face tokenizer folder carries (None: it has none)."""
    for name, key in ((TEMPLATE_FILE, "chat_template"), ("chat_template.json", "chat_template")):
        path = Path(folder) / name
        if path.is_file():
            template = json.loads(path.read_text()).get(key)
            if isinstance(template, str):
                return template
    jinja = Path(folder) / "chat_template.jinja"
    return jinja.read_text() if jinja.is_file() else None


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


def trained_tokens(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """Which tokens (given each token's character offsets in the rendered text) the spans cover: a token is trained
    from the one holding a span's first character to the one holding its last, as transformers' assistant mask."""
    mask = np.zeros(len(offsets), dtype=bool)
    starts = np.array([s for s, e in offsets])
    ends = np.array([e for s, e in offsets])
    for first, last in spans:
        if last <= first:
            continue
        holding = np.nonzero((starts <= first) & (first < ends))[0]
        if not len(holding):
            break  # past the tokens (transformers: "out of bounds maybe due to truncation")
        closing = np.nonzero((starts <= last - 1) & (last - 1 < ends))[0]
        mask[holding[0]:(closing[0] + 1 if len(closing) else len(offsets))] = True
    return mask


def encode_chat(tokenizer, template: str, messages: list[dict], **variables) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, which of them the model must learn) of a chat record, with a `tokenizers.Tokenizer`: the
    rendered text encoded without added special tokens (the template writes them), as apply_chat_template does."""
    text, spans = render(template, messages, **variables)
    encoding = tokenizer.encode(text, add_special_tokens=False)
    return np.asarray(encoding.ids, dtype=np.int64), trained_tokens(encoding.offsets, spans)


@functools.lru_cache(maxsize=8)
def roles(template: str) -> frozenset:
    """The roles a message may have under a template: the standard ones and any the template names (a quoted word:
    `message['role'] == 'ipython'`). A role outside them is a typo or another format's (ShareGPT's 'human', 'gpt')."""
    return frozenset(STANDARD_ROLES) | frozenset(re.findall(r"""['"](\w+)['"]""", template))
