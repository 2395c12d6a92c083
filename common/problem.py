"""A problem found before launch, in the user's language: the config key, its value, the rule and a fix.

Every owner of a rule (a model, a data source, the layout, an engine, a cluster executor, the plan) returns a list
of these from its `check(cfg)`; validation collects them all and raises them together. A check that reads inputs to
judge them (the data's: the corpus's layout, its first records) returns them as `Found`, its problems with what it
read, so that what prints the plan is handed those facts instead of reading the inputs again."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable


@dataclass(frozen=True)
class Problem:
    key: str
    value: Any
    rule: str
    fix: str

    def __str__(self) -> str:
        return f"{self.key}={_show(self.value)}\n      rule: {self.rule}\n      fix:  {self.fix}"


class Found(list):
    """A check's problems (it is their list), and `facts`: what the check read to find them (None: nothing to hand
    on)."""

    def __init__(self, problems: Iterable = (), facts: Any = None):
        super().__init__(problems)
        self.facts = facts


class InputFault(ValueError):
    """A fault of the user's input that a stage finds as it reads it (a record past the ones checked before launch),
    said in full by its message: the file and the line or row, what is wrong, the fix. The stage fails with the
    message alone (orchestrator/worker.py): the Python traceback says nothing more to the user."""


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value) if str(value) != "" else "''"  # an empty value, visibly


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
