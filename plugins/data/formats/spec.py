"""A record format is a component: one file of plugins/data/formats/ registers a RecordFormat saying what the rest of
the data code asks of `data.format`: the fields a record is read from, how a record becomes its document(s), whether
the records say which tokens are learned, how many documents an example holds, and the words the checks use. The
readers (records.py, first_records.py, preview.py), the tokenize task (corpus.py), the bad-records switch and the
packing default ask the format; none of them names one. A third-party package adds one through the
`orchestrator.formats` entry-point group (its `data.format` value must then be one the schema accepts)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from common.registry import Registry


@dataclass(frozen=True)
class RecordFormat:
    fields: Callable[[Any], dict]                # data cfg -> {data key: field name} every record must have
    document: Optional[Callable] = None          # (data cfg, record, where) -> its document (Record, Chat, Pair, ...,
    #                                              or () for nothing to learn); None: not records (text: documents)
    optional: Callable[[Any], Optional[dict]] = lambda d: None  # fields a record may lack, by their data key
    masks_loss: Callable[[Any], bool] = lambda d: False  # whether its records say which tokens are learned
    makes_documents: bool = False                # its records make their own documents, tokenized and checked
    #                                              against the row before launch (prompted_records.py)
    per_example: int = 1                         # documents an example holds (a pair: 2), moved and drawn together
    unit: str = "records"                        # the plan's name for its examples
    always_rendered: bool = False                # every record is a chat, rendered with the chat template
    may_render: bool = True                      # a record may be messages (its chat template checked before launch)
    probes_turns: bool = False                   # the template's renderings of a conversation's beginnings are probed
    #                                              before launch (where data.loss_on=completion learns the answers)
    nothing_learned: str = "every completion empty"  # why a file's first records teach nothing (data.loss_on)
    packing_strategy: str = "bfd"                # data.packing_strategy=auto's choice for it

    @property
    def records(self) -> bool:
        """Whether it is records of fields (data.bad_records applies), not text."""
        return self.document is not None


FORMATS: Registry[RecordFormat] = Registry("data.format", "orchestrator.formats")
register_format = FORMATS.register


def format_of(d) -> RecordFormat:
    """The format of a data config (text where it has none: a data.mix entry's source)."""
    get = d.get if hasattr(d, "get") else lambda k, default=None: getattr(d, k, default)
    return FORMATS.get(get("format", "text") or "text")
