"""Chat keys whose value would do nothing on the records read before launch (each file's first records, as
plugins/data/first_records.first_records_problem reads them): data.learn_reasoning=false where no assistant turn has
reasoning, and a data.tools_field that no record has while the records hold `tools` (every tool schema would be
dropped without a word). A value that does nothing is a mistake about the data: it is refused, not ignored."""
from __future__ import annotations

import itertools

from plugins.data.bad_records import Bad, skips
from plugins.data.piece_records import BadRecord, records
from plugins.data.reasoning import THINK
from plugins.data.reasoning import FIELD as REASONING
from plugins.data.reasoning import reasoning_of
from plugins.data.records import CHECKED_RECORDS, Unanswered, masks_loss_of, piece_documents
from plugins.data.formats.spec import format_of

TOOLS = "tools"  # TRL's field, and the key's default


def no_effect_problems(d, pieces: list) -> list[tuple]:
    """(key, value, rule, fix) for each chat key that would do nothing on the first records of `pieces` (each
    file's first piece)."""
    if not format_of(d).always_rendered or not pieces:  # (its keys are a chat's: tools, reasoning)
        return []
    return _reasoning_problems(d, pieces) + _tools_problems(d, pieces)


def _reasoning_problems(d, pieces: list) -> list[tuple]:
    if d.get("learn_reasoning", True) or not masks_loss_of(d):
        return []
    read = 0
    for piece in pieces:
        for _, chat, _ in itertools.islice(piece_documents(d, piece), CHECKED_RECORDS):
            if isinstance(chat, Bad):  # (data.bad_records=skip: left out)
                continue
            chat = chat.chat if isinstance(chat, Unanswered) else chat
            read += 1
            if any(m["role"] == "assistant" and reasoning_of(m)[0].strip() for m in chat.messages):
                return []
    return [("data.learn_reasoning", False, "data.learn_reasoning=false leaves an assistant turn's reasoning "
             f"unlearned, and none of the {read} record(s) read before launch (the first of each file) has any (no "
             f"{REASONING}, no {THINK[0]}...{THINK[1]} block in an answer): it would change nothing",
             "data.learn_reasoning=true (the default; it matters only where answers hold reasoning), or records "
             "with reasoning")]


def _tools_problems(d, pieces: list) -> list[tuple]:
    if d.tools_field == TOOLS:
        return []
    read = holding = 0
    for piece in pieces:
        found = records(piece, {}, d.val_fraction, {"named": d.tools_field, TOOLS: TOOLS}, skips(d))
        for _, record, _ in itertools.islice(found, CHECKED_RECORDS):
            if isinstance(record, BadRecord):  # (data.bad_records=skip: left out)
                continue
            if record["named"] is not None:
                return []
            read, holding = read + 1, holding + (record[TOOLS] is not None)
    if not holding:
        return []
    return [("data.tools_field", d.tools_field, f"none of the {read} record(s) read before launch (the first of each "
             f"file) has the field {d.tools_field!r}, and {holding} of them hold {TOOLS!r}: every record's tool "
             "schemas would be dropped, and the model trained on calls to tools it was never shown",
             f"data.tools_field={TOOLS}")]
