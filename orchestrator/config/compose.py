"""A config composed as `python -m orchestrator <overrides>` composes it, for code that is not the command: benchmarks,
tests, a notebook. Validation is the caller's (orchestrator.config.validate), as the command validates after Hydra
composes. data.tokenizer=auto is made concrete (the data's code reads a tokenizer; the command resolves it before
planning, orchestrator/config/resolve.py); the other `auto` values stay (resolve_auto makes them concrete for the
machine that runs them).

    from orchestrator.config.compose import compose_config
    cfg = compose_config("model=llama_tiny", "train.steps=10")
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional

from omegaconf import DictConfig

from orchestrator.config.options import CONF


def last_wins(args: Iterable[str]) -> list[str]:
    """Overrides built from a base and additions (a benchmark's defaults, then its arguments): each key keeps its
    last value, as one written command would hold it (the command refuses a key set twice to different values)."""
    args = list(args)
    key = [a.lstrip("+~").split("=", 1)[0] if "=" in a and not a.startswith("-") else None for a in args]
    return [a for i, a in enumerate(args) if key[i] is None or key[i] not in key[i + 1:]]


def compose_config(*overrides: str, runs_dir: Optional[Path] = None, conf: Path = CONF) -> DictConfig:
    """The experiment's config for these overrides (the last of a key's wins), from conf/ and the schema."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from orchestrator.config.resolve import with_tokenizer
    from orchestrator.config.schema import register

    register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf), version_base="1.3", job_name="orchestrator"):
        extra = [f"runs_dir={runs_dir}"] if runs_dir is not None else []
        return with_tokenizer(compose(config_name="config", overrides=last_wins([*overrides, *extra]),
                                      return_hydra_config=False))
