"""What a run measured, kept in the store for the next plan (the disk's write rate, the stages' times): a JSON list,
the newest last, the last `kept` of them. An estimate's input, never worth a failed stage: a store that cannot take
a record (read-only, full) is left as it is, and a damaged file reads as none."""
from __future__ import annotations

import datetime
from pathlib import Path

from storage.fsio import atomic_write_json, read_json


def now() -> str:
    """When a record was made, as the plan names it."""
    return datetime.datetime.now().strftime("%Y-%m-%d %H:%M")


def append(path: Path, entry: dict, kept: int) -> None:
    try:
        atomic_write_json(path, [*read(path), entry][-kept:])  # two at once: the later list wins, one record lost
    except OSError:
        pass


def read(path: Path) -> list[dict]:
    try:
        found = read_json(path)
    except (OSError, ValueError):  # none yet, or damaged
        return []
    return [r for r in found if isinstance(r, dict)] if isinstance(found, list) else []
