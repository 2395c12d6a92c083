"""Optuna 2.10 (what hydra-optuna-sweeper 1.3 allows) as the project calls it: a study's saved direction read back,
a copy of a study made without Optuna announcing a new one, and its log lines plain where they go to a pipe."""
from __future__ import annotations

import logging
import sys
from typing import Any


def directions(saved: str) -> list[str]:
    """The sweeper's direction as saved (`Direction.minimize`, `minimize` or a list of them) as Optuna's names."""
    names = saved.strip("[]").replace("'", "").split(",")
    return [n.strip().rsplit(".", 1)[-1] for n in names]


def study_from_saved(**kwargs: Any):
    """optuna.create_study(**kwargs) for a study rebuilt from its file, quietly: Optuna would say "A new study
    created in memory" (right before the sweeper's "Using an existing study", for a continued one)."""
    import optuna

    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        return optuna.create_study(**kwargs)
    finally:
        optuna.logging.set_verbosity(verbosity)


def plain_lines_off_a_terminal() -> None:
    """Optuna 2 colours its log lines (colorlog) into a pipe or a file too: there, they go through a plain handler."""
    import optuna

    logger = logging.getLogger("optuna")
    if sys.stderr.isatty() or any(getattr(h, "plain", False) for h in logger.handlers):
        return
    optuna.logging.disable_default_handler()
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[%(levelname).1s %(asctime)s] %(message)s"))
    handler.plain = True
    logger.addHandler(handler)
