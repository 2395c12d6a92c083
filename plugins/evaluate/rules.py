"""evaluate.*'s checks before launch (plugins/evaluate/harness.py holds them)."""
from __future__ import annotations

from common.problem import Problem
from plugins.evaluate.harness import problems


def check(cfg) -> list[Problem]:
    return problems(cfg.evaluate)
