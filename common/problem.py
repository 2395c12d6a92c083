"""A problem found before launch, in the user's language: the config key, its value, the rule and a fix.

Every owner of a rule (a model, a data source, the layout, an engine, a cluster executor, the plan) returns a list
of these from its `check(cfg)`; validation collects them all and raises them together."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Problem:
    key: str
    value: Any
    rule: str
    fix: str

    def __str__(self) -> str:
        return f"{self.key}={_show(self.value)}\n      rule: {self.rule}\n      fix:  {self.fix}"


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value) if str(value) != "" else "''"  # an empty value, visibly


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
