"""Fuzz the data formats (issue 49): records of every type per field (strings with BOM, CRLF, NUL and non-BMP
characters, empty strings, null, numbers, NaN, booleans, lists, objects, lists of messages right and wrong, bytes
that are UTF-8 or not), missing and extra fields, in every container the tokenize stage reads (JSON Lines as .jsonl
and .json, gzip- and zstd-compressed, Parquet with string and binary columns, an Arrow IPC stream and file, a `datasets` DatasetDict with a
.map() cache beside it), and damaged files (truncated, empty). Each generated input is either

- refused before launch (the data rules, plugins/data/rules.check: a problem naming the key, and the file and the
  record where one is at fault), or
- tokenized into exactly the ids and learned tokens that an independent reading gives: the bytes tokenizer's ids of
  each text, and for chats transformers' apply_chat_template with generation tags around the assistant's turns (the
  project renders the untagged template and finds the turns by prefixes).

Megatron corpora are fuzzed in tests/test_megatron_fuzz.py. Hypothesis draws the cases; CI runs a fixed, derandomized
set of EXAMPLES; `FUZZ=all` runs ten times as many."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from plugins.data.corpus import tokenized
from plugins.data.rules import check
from plugins.data.tokenizer import EOS
from tests.conftest import make_cfg

EXAMPLES = 600 if os.environ.get("FUZZ") == "all" else 60
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TAGGED = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}{% generation %}"
          "{{ m['content'] }}<|im_end|>\n{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ROLES = ("user", "assistant", "system")
ROW = 257  # train.seq_len+1 of the preference and unpaired cases: their completions must start within a row

# -- values a field may hold -------------------------------------------------------------------------------------

PLAIN = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)       # any Unicode but lone surrogates
SPICY = st.sampled_from(["\ufeffBOM first", "crlf\r\nline", "tab\tand NUL\x00", "emoji 🙂 ünï", " ", "", "\n"])
TEXT = st.one_of(PLAIN, SPICY)
NOT_TEXT = st.one_of(st.integers(-5, 5), st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
                     st.lists(PLAIN, max_size=2), st.dictionaries(st.sampled_from("ab"), PLAIN, max_size=2),
                     st.just("\ud800"))                                            # a lone surrogate: not Unicode
REASONING = st.one_of(st.none(), st.sampled_from(["", " "]), PLAIN, st.integers(0, 3))  # never read by CHATML
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(ROLES), "content": TEXT},
                                optional={"reasoning_content": REASONING})
TOOLS = st.one_of(st.none(), st.just([]), st.just([{"type": "function", "function": {"name": "add"}}]), TEXT)
BAD_MESSAGE = st.one_of(st.fixed_dictionaries({"role": st.sampled_from(ROLES + ("human",)), "content": NOT_TEXT}),
                        st.fixed_dictionaries({"role": st.sampled_from(("human", "gpt"))}, optional={"content": TEXT}),
                        st.fixed_dictionaries({"content": TEXT}), PLAIN)
MESSAGES = st.lists(MESSAGE, min_size=1, max_size=4)
VALUE = st.one_of(TEXT, TEXT, TEXT, st.none(), NOT_TEXT, MESSAGES,
                  st.lists(st.one_of(MESSAGE, BAD_MESSAGE), max_size=3))
LABEL = st.booleans()  # an unpaired record's (data.label_field): true where its completion is desirable
BYTES = st.one_of(PLAIN.map(lambda t: t.encode("utf-8")), st.binary(max_size=8))  # Arrow's binary columns


# -- the oracle: what a record must give, from the record alone ----------------------------------------------------

class Refused(Exception):
    """The record must be refused before launch."""


def _text(value) -> bytes:
    """A text field's bytes, None for no text; Refused for anything the project must not train on."""
    if value is None:
        return b""
    if isinstance(value, bytes):
        try:
            value.decode("utf-8")
        except UnicodeDecodeError:
            raise Refused from None
        return value
    if not isinstance(value, str):
        raise Refused
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError:
        raise Refused from None


def _messages(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise Refused
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str) \
                or m["role"] not in ROLES:
            raise Refused
        _text(m["content"])
        reasoning = m.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str) or isinstance(reasoning, str) and reasoning.strip():
            raise Refused  # not text; or reasoning that a template reading none would drop
    return value


def _unanswered(answers: list[dict]) -> bool:
    """Answers there are, and none has text."""
    return bool(answers) and not any(m["content"].strip() for m in answers)


def _chat(hf, messages) -> tuple[list[int], list[int]]:
    theirs = hf.apply_chat_template(messages, chat_template=TAGGED, tokenize=True, return_dict=True,
                                    return_assistant_tokens_mask=True)
    ids, mask = list(theirs["input_ids"]), list(theirs["assistant_masks"])
    return ids + [EOS], mask + [int(messages[-1]["role"] == "assistant")]


def expected(fmt: str, record: dict, hf) -> tuple | None:
    """The document a record gives (ids, learned or None), None for none; Refused when it must be refused."""
    if fmt == "preference":
        return expected_pair(record, hf)
    if fmt == "unpaired":
        return expected_unpaired(record, hf)
    if fmt == "text":
        if "text" not in record:
            raise Refused
        body = _text(record["text"])
        return (list(body) + [EOS], None) if body else None
    if fmt == "chat":
        if "messages" not in record:
            raise Refused
        messages = _messages(record["messages"])
        if record.get("tools") not in (None, []):
            raise Refused  # not a list of schemas; or tools that a template reading none would drop
        if _unanswered([m for m in messages if m["role"] == "assistant"]):
            return None  # nothing to learn but the stop token: left out, as an empty completion is
        ids, mask = _chat(hf, messages)
        return (ids, mask) if any(mask[:-1]) else None
    if "prompt" not in record or "completion" not in record:
        raise Refused
    prompt, completion = record["prompt"], record["completion"]
    if isinstance(prompt, list) or isinstance(completion, list):
        prompt, completion = _messages(prompt), _messages(completion)
        if _unanswered(completion):
            return None
        head = hf.apply_chat_template(prompt, chat_template=CHATML, tokenize=True, add_generation_prompt=True,
                                      return_dict=True)["input_ids"]
        ids = list(hf.apply_chat_template(prompt + completion, chat_template=CHATML, tokenize=True,
                                          return_dict=True)["input_ids"])
        if ids[:len(head)] != list(head):
            raise Refused
        return ids + [EOS], [0] * len(head) + [1] * (len(ids) - len(head) + 1)
    head, tail = _text(prompt), _text(completion)
    if not tail:
        return None
    return list(head) + list(tail) + [EOS], [0] * len(head) + [1] * (len(tail) + 1)


def _shared(a, b) -> int:
    """How long a and b begin alike (texts by character, conversations by message): an implicit prompt's end, a
    space before the first difference going to the completions."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n - 1 if n < min(len(a), len(b)) and n and a[n - 1] == " " else n


def _common(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def expected_pair(record: dict, hf) -> list:
    """A preference record's two documents (chosen, rejected: ids and learned, the rejected's marked 2 as an
    undesirable record's is: objective=kto reads pairs unpaired), each the prompt and its completion encoded together,
    learned from where the prompt's ids and either whole's first differ; Refused when it must be."""
    if "chosen" not in record or "rejected" not in record:
        raise Refused
    parts = {k: record[k] for k in ("prompt", "chosen", "rejected") if record.get(k) is not None or k != "prompt"}
    if isinstance(parts.get("prompt"), list) != isinstance(parts["chosen"], list):
        parts.pop("prompt", None)  # TRL's maybe_extract_prompt: a prompt of another form is not read (UltraFeedback's)
    if len({isinstance(v, list) for v in parts.values()}) > 1:
        raise Refused
    conversational = isinstance(parts["chosen"], list)
    parts = {k: _messages(v) if conversational else _text(v).decode() for k, v in parts.items()}
    if "prompt" not in parts:
        at = _shared(parts["chosen"], parts["rejected"])
        parts = {"prompt": parts["chosen"][:at], "chosen": parts["chosen"][at:], "rejected": parts["rejected"][at:]}
        if not parts["prompt"]:
            raise Refused
    if not parts["chosen"] or not parts["rejected"] or parts["chosen"] == parts["rejected"]:
        raise Refused
    return _learned(parts["prompt"], [parts[k] for k in ("chosen", "rejected")], (1, 2), conversational, hf)


def expected_unpaired(record: dict, hf) -> tuple:
    """An unpaired record's document (ids, learned: its label's mark, 1 desirable or 2 not, where learned), the prompt
    and its completion encoded together as a pair's are; Refused when it must be (a label that is not true or false,
    an empty completion: nothing to judge)."""
    if any(k not in record for k in ("prompt", "completion", "label")) or not isinstance(record["label"], bool):
        raise Refused
    prompt, completion = record["prompt"], record["completion"]
    conversational = isinstance(prompt, list) or isinstance(completion, list)
    if conversational:
        prompt, completion = _messages(prompt), _messages(completion)
    else:
        prompt, completion = _text(prompt).decode(), _text(completion).decode()
    if not completion:
        raise Refused
    return _learned(prompt, [completion], (1 if record["label"] else 2,), conversational, hf)[0]


def _learned(prompt, completions: list, marks: tuple, conversational: bool, hf) -> list:
    """Each completion's document, the prompt and it encoded together (ids, and its mark where learned: from where
    the prompt's ids and any whole's first differ); Refused where that is past a row (nothing of it learned)."""
    if conversational:
        head = list(hf.apply_chat_template(prompt, chat_template=CHATML, tokenize=True, add_generation_prompt=True,
                                           return_dict=True)["input_ids"])
        wholes = [list(hf.apply_chat_template(prompt + c, chat_template=CHATML, tokenize=True,
                                              return_dict=True)["input_ids"]) for c in completions]
    else:
        head = list(prompt.encode())
        wholes = [list((prompt + c).encode()) + [EOS] for c in completions]
    start = min(_common(head, ids) for ids in wholes)
    if start >= ROW:
        raise Refused  # a completion that starts past a row: nothing of it would be learned
    return [(ids, [mark * (i >= start) for i in range(len(ids))]) for ids, mark in zip(wholes, marks)]


# -- containers ------------------------------------------------------------------------------------------------------

def write(container: str, records: list[dict], folder: Path, damage: str, fields: tuple) -> Path:
    """The records in a container; 'damage' truncates or empties the file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if container.startswith("json"):  # .json: JSON Lines by another name; .jsonl.gz, .json.zst: compressed
        path = folder / f"records.{container}"
        path.write_bytes(_compress(container, "".join(json.dumps(r) + "\n" for r in records).encode()))
    else:
        table = _table(records, fields)
        if container == "parquet":
            path = folder / "records.parquet"
            pq.write_table(table, path)
        elif container in ("arrow", "arrow_file"):  # an IPC stream (datasets' format), or the file format (Feather)
            path = folder / ("records.arrow" if container == "arrow" else "records.feather")  # Feather's name too
            new = pa.ipc.new_stream if container == "arrow" else pa.ipc.new_file
            with pa.OSFile(str(path), "wb") as sink, new(sink, table.schema) as writer:
                writer.write_table(table)
        else:  # datasets: save_to_disk's folder, a .map() cache beside it, and a DatasetDict around it
            import datasets

            datasets.disable_progress_bars()
            one = datasets.Dataset(table)
            path = folder / "dict"
            datasets.DatasetDict({"train": one, "test": one.select(range(min(1, len(one))))}).save_to_disk(str(path))
            reloaded = datasets.load_from_disk(str(path / "train"))
            if len(reloaded):
                reloaded.map(lambda r: {k: v for k, v in r.items()})  # cache-*.arrow beside the data
            return path
    if damage == "truncated":  # a write that did not finish: cut inside the last line, or 2/3 of a binary file
        data = path.read_bytes()
        path.write_bytes(data[:-3] if container.startswith("json") else data[:max(1, len(data) * 2 // 3)])
    elif damage == "empty":
        path.write_bytes(b"")
    return path


def _compress(container: str, data: bytes) -> bytes:
    if container.endswith(".gz"):
        import gzip

        return gzip.compress(data)
    if container.endswith(".zst"):
        import zstandard

        return zstandard.ZstdCompressor().compress(data)
    return data


def _table(records: list[dict], fields: tuple):
    """An Arrow table of the records (columns typed by what the values hold, as a user's writer would)."""
    import pyarrow as pa

    names = sorted({k for r in records for k in r})
    if not names:
        return pa.table({fields[0]: pa.array([], pa.string())})
    return pa.table({k: pa.array([r.get(k) for r in records]) for k in names})


def _arrow_ok(records: list[dict], fields: tuple) -> bool:
    try:
        _table(records, fields)
    except (pa_errors() + (TypeError, ValueError, OverflowError)):
        return False
    return True


def pa_errors() -> tuple:
    import pyarrow as pa

    return (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError)


@st.composite
def cases(draw):
    fmt = draw(st.sampled_from(["text", "prompt_completion", "chat", "preference", "unpaired"]))
    fields = {"text": ("text",), "chat": ("messages",), "prompt_completion": ("prompt", "completion"),
              "preference": ("prompt", "chosen", "rejected"), "unpaired": ("prompt", "completion", "label")}[fmt]
    container = draw(st.sampled_from(["jsonl", "jsonl", "json", "jsonl.gz", "json.zst", "parquet", "arrow",
                                      "arrow_file", "datasets"]))
    form = draw(st.sampled_from([TEXT, MESSAGES]))  # a pair's or an unpaired record's: TRL's standard or conversational
    good = {"text": TEXT, "chat": MESSAGES, "prompt_completion": TEXT, "preference": form, "unpaired": form}[fmt]
    values = st.one_of(VALUE, BYTES) if not container.startswith("json") else VALUE

    clean = draw(st.booleans())  # every record of the right types (else: a third of the values anything)

    def record():
        goods = {f: LABEL if f == "label" else good for f in fields}  # (an unpaired record's label: true or false)
        r = {f: draw(goods[f] if clean else st.one_of(goods[f], goods[f], values)) for f in fields}
        if fmt == "preference" and clean and good is MESSAGES and draw(st.integers(0, 3)) == 0:
            asked = {"role": "user", "content": draw(TEXT)}  # UltraFeedback's: a text, conversations repeating it
            r = {"prompt": asked["content"], "chosen": [asked, *r["chosen"]], "rejected": [asked, *r["rejected"]]}
        if not clean and draw(st.integers(0, 9)) == 0 or fmt == "preference" and draw(st.integers(0, 3)) == 0:
            r.pop(draw(st.sampled_from(fields)))               # a missing field (a pair's prompt: implicit)
        if draw(st.booleans()):
            r["extra"] = draw(TEXT if clean else values)        # an extra field, read by no one
        if fmt == "chat" and draw(st.integers(0, 4)) == 0:
            r["tools"] = draw(TOOLS)                            # data.tools_field's default
        return r

    records = [record() for _ in range(draw(st.integers(0, 6)))]
    damage = draw(st.sampled_from(["none"] * 8 + ["truncated", "empty"])) if container != "datasets" else "none"
    skip = fmt != "text" and damage == "none" and draw(st.booleans())  # data.bad_records=skip: bad ones left out
    return fmt, fields, records, container, damage, skip


@pytest.fixture(scope="module")
def bytes_hf():
    """transformers' view of the bytes tokenizer (its byte-level twin), for the chats' expected ids."""
    import transformers

    from plugins.data.tokenizer import _bytes_backend

    return transformers.PreTrainedTokenizerFast(tokenizer_object=_bytes_backend(), eos_token="<eos>")


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_every_record_trains_as_meant_or_is_refused_before_launch(bytes_hf, case):
    fmt, fields, records, container, damage, skip = case
    if container == "datasets" and not any(records):
        return  # datasets cannot save a DatasetDict of no rows or no columns
    if not container.startswith("json"):
        if not _arrow_ok(records, fields):
            return  # Arrow cannot hold these values in one column: no such file can exist
        names = {k for r in records for k in r}
        records = [{k: r.get(k) for k in names} for r in records]  # a column holds a null where a record has none
        if "label" in names:  # a label as its column holds it: true beside 0.5 is a column of numbers, true 1.0
            for r, label in zip(records, _table(records, fields).column("label").to_pylist()):
                r["label"] = label
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        try:
            path = write(container, records, folder, damage, fields)
        except pa_errors():
            return  # datasets' own writer refused the values
        (folder / "chatml.jinja").write_text(CHATML)
        cfg = make_cfg("data=text", f"data.paths=[{path}]", f"data.format={fmt}", "data.packing=false",
                       f"train.seq_len={ROW - 1 if fmt in ('preference', 'unpaired') else 16}",
                       "train.batch_size=1", "train.eval_batches=1", "data.val_fraction=0.5",
                       *([f"data.chat_template={folder}/chatml.jinja"] if fmt != "text" else []),
                       *(["data.bad_records=skip"] if skip else []), runs_dir=folder)
        problems = check(cfg)
        wanted = []
        for r in records:  # refused, or with data.bad_records=skip each bad record left out
            try:
                wanted += [] if (d := expected(fmt, r, bytes_hf)) is None else d if fmt == "preference" else [d]
            except Refused:
                if not skip:
                    wanted = None
                    break
        least = 4 if fmt == "preference" else 2  # documents that can be split into a training and a held-out part
        if damage != "none" or wanted is not None and len(wanted) < least:
            assert problems, (case, "a damaged input, or one too small to hold a document out, was accepted")
            return
        if problems:
            assert all(p.key.startswith(("data.", "train.", "model.")) and p.rule and p.fix for p in problems), problems
            record_level = [p for p in problems if "line " in p.rule or "row " in p.rule]
            if wanted is not None and len(wanted) >= least:
                assert not record_level, (case, "a good record refused", problems)
            return
        assert wanted is not None, (case, "a record that must be refused was accepted")
        if skip and len(wanted) < sum(2 if fmt == "preference" else 1 for _ in records):
            event("data.bad_records=skip: trained on the good records alone")
        corpus = tokenized(cfg)
        ours = sorted((ids.tolist(), None if m is None else m.astype(int).tolist()) for ids, m in
                      zip(corpus.train + corpus.val, (corpus.train_mask or [None] * len(corpus.train))
                          + (corpus.val_mask or [None] * len(corpus.val))))
        theirs = sorted((ids, mask) for ids, mask in wanted)
        assert ours == theirs, case
        _drawn_once(corpus, cfg, fmt == "preference")


def _drawn_once(corpus, cfg, pairs: bool) -> None:
    """An epoch of training batches draws each training example once (a pair as one), and the held-out batches hold
    each held-out example once (plugins/data/epochs.py)."""
    from plugins.data.batcher import Batcher

    batcher = Batcher(corpus, 2 if pairs else 1, cfg.train.seq_len, 0, pairs=pairs)
    per = 2 if pairs else 1
    for split, batch_of, count in (("train", batcher.train_batch, batcher.examples(0, "train")),
                                   ("val", batcher.eval_batch, batcher.eval_batches(10**6))):
        n = batcher.examples(0, split)
        steps = n if split == "train" else count
        drawn = [int(d) // per for s in range(steps) for d in batch_of(s).drawn[::per] if d >= 0]
        assert sorted(drawn) == list(range(n)), (split, drawn)
