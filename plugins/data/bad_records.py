"""Bad records (data.bad_records): a record at fault itself (a line that is not JSON, a field missing or of the wrong
type, messages that are not messages, a pair with nothing to compare, a conversation the template cannot render),
as against a setting at fault (a row too short, no chat template), which no record's absence would mend.

refuse (the default): the check before launch lists every bad record among those it reads (the first LISTED, and
how many), in one refusal, so a set with several is not refused one record per run; past them the tokenize stage
refuses the first it meets. skip: each is left out, never silently: the plan counts those read before launch and
lists the first, the tokenize stage counts every one and lists the first in its log and its index (bad_records)."""
from __future__ import annotations

from dataclasses import dataclass, field

from common.problem import InputFault

LISTED = 20              # bad records named in a refusal, the plan, the tokenize log and its index
SKIP = "data.bad_records=skip"


def skips(d) -> bool:
    """Whether data.bad_records=skip applies: to records (prompt_completion, chat, preference, unpaired), not to
    text."""
    from plugins.data.formats.spec import format_of

    return format_of(d).records and d.get("bad_records", "refuse") == "skip"


class Bad(tuple):
    """A bad record in the stream of a piece's documents (plugins/data/records.piece_documents with keep_bad): no
    texts, so what reads texts alone (a BPE's sample) passes over it; its fault says where it is and what is wrong."""

    def __new__(cls, fault: InputFault):
        bad = super().__new__(cls, ())
        bad.fault = fault
        return bad


@dataclass
class BadRecords:
    """The bad records met: how many, the first LISTED of them (each its message: file and line, its fault, the
    fix), and (before launch) how many records were read, bad or not."""
    count: int = 0
    first: list = field(default_factory=list)
    read: int = 0

    def add(self, fault: InputFault) -> None:
        self.count += 1
        if len(self.first) < LISTED:
            self.first.append(str(fault))

    def merge(self, other: "BadRecords") -> "BadRecords":
        return BadRecords(self.count + other.count, (self.first + other.first)[:LISTED], self.read + other.read)

    @classmethod
    def of(cls, summary: dict) -> "BadRecords":
        """From a tokenize part's summary or an index (its bad_records entry; none: no bad record)."""
        entry = summary.get("bad_records") or {}
        return cls(entry.get("count", 0), list(entry.get("first", [])))

    def entry(self) -> dict:
        return {"count": self.count, "first": self.first}

    def listing(self, indent: str = "\n        ") -> str:
        """The first ones, one a line (the fault of each, its fix left to the refusal's), and how many more."""
        lines = [message.partition("; fix: ")[0] for message in self.first]
        more = self.count - len(lines)
        return "".join(f"{indent}{line}" for line in lines) + (f"{indent}... and {more:,} more" if more else "")

    def fixes(self) -> list[str]:
        """The listed records' own fixes, each once."""
        return list(dict.fromkeys(fix for m in self.first if (fix := m.partition("; fix: ")[2])))


def summed(summaries: list[dict]) -> dict:
    """{"bad_records": their count and the first listed} of the parts' (or a mixture's sources') summaries that
    have one (data.bad_records=skip), in order; {} where none has."""
    if not any("bad_records" in s for s in summaries):
        return {}
    total = BadRecords()
    for summary in summaries:
        total = total.merge(BadRecords.of(summary))
    return {"bad_records": total.entry()}


def refused(fault: InputFault) -> InputFault:
    """A bad record the tokenize stage meets past those read before launch, refused (data.bad_records=refuse), its
    message offering the skip."""
    message, _, fix = str(fault).partition("; fix: ")
    return InputFault(f"{message}; fix: {fix + ', or ' if fix else ''}{SKIP} (each bad record left out and counted)")


def refusal(bad: BadRecords, d) -> list[tuple]:
    """(key, value, rule, fix) of the bad records among those read before launch: none where there is none, or
    data.bad_records=skip leaves some to train on; the skip offered only where it would."""
    read = bad.read
    if not bad.count or (skips(d) and bad.count < read):
        return []
    fixes = bad.fixes()
    own = fixes[0] if len(fixes) == 1 else "repair or remove them"  # one fix for all, else each its own (listed)
    if bad.count >= read:  # nothing would be left: skipping is no fix
        return [("data.paths", list(d.paths), f"every one of the {read:,} record(s) read before launch (the first of "
                 f"each file) is bad, so {SKIP} would leave none:{bad.listing()}", own)]
    return [("data.paths", list(d.paths), f"{bad.count:,} bad record(s) among the {read:,} read before launch (the "
             f"first of each file; up to {LISTED} listed):{bad.listing()}",
             f"{own}; or {SKIP} (each left out and counted, the first {LISTED} listed in the plan and in the tokenize "
             "stage's log)")]


def plan_line(bad: BadRecords) -> list[str]:
    """The plan's line under data.bad_records=skip where bad records were read before launch."""
    if not bad.count:
        return []
    return [f"warning: {SKIP}: {bad.count:,} bad record(s) among the {bad.read:,} read before launch (the first of "
            "each file) will be left out, and any more the tokenize stage meets (it counts them in its log):"
            + bad.listing("\n    ")]


def stage_line(bad: BadRecords) -> str:
    """The tokenize stage's log line of the bad records it left out."""
    return f"warning: {SKIP}: {bad.count:,} bad record(s) left out:" + bad.listing("\n    ")
