"""The pipeline's stages, one module each; they meet only through files and the DAG."""
from __future__ import annotations

from stages.base import Resources, Stage, StageContext, Tracker

ORDER = ("export", "transform", "train", "checkpoint", "aggregate")


def get_stage(name: str) -> Stage:
    """One stage (importing only its own module and plugins)."""
    from importlib import import_module
    return import_module(f"stages.{name}").STAGE


def all_stages() -> list[Stage]:
    """Every stage, in pipeline order."""
    return [get_stage(name) for name in ORDER]


__all__ = ["ORDER", "Resources", "Stage", "StageContext", "Tracker", "all_stages", "get_stage"]
