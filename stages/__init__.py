"""The pipeline's stages, one module each; they meet only through files and the DAG."""
from __future__ import annotations

from stages.base import Resources, Stage, StageContext, Tracker

ORDER = ("tokenize", "reference", "export", "transform", "train", "checkpoint", "aggregate", "evaluate")


def get_stage(name: str) -> Stage:
    """One stage (importing only its own module and plugins)."""
    from importlib import import_module
    return import_module(f"stages.{name}").STAGE


def all_stages(until: str | None = None) -> list[Stage]:
    """Every stage, in pipeline order; with `until`, that stage and the stages it needs only."""
    stages = [get_stage(name) for name in ORDER]
    if until is None:
        return stages
    by_name, needed, frontier = {s.name: s for s in stages}, set(), {until}
    while frontier:
        needed |= frontier
        frontier = {u for n in frontier for u in by_name[n].after} - needed
    return [s for s in stages if s.name in needed]


__all__ = ["ORDER", "Resources", "Stage", "StageContext", "Tracker", "all_stages", "get_stage"]
