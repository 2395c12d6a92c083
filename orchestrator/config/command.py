"""The command's config, as the run will see it: its overrides as typed, the experiment without Hydra's node, the
checks a run makes first, and the refusal an exception from Hydra, OmegaConf or a sweeper amounts to. Shared by the
command's boundary (orchestrator/boundary.py) and the whole-sweep check (orchestrator/sweep_check.py)."""
from __future__ import annotations

import copy
import traceback
from typing import Optional

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from orchestrator.config.errors import ConfigError, Problem, from_hydra
from orchestrator.config.values import value_problem


def task_overrides(hydra_node: DictConfig) -> list[str]:
    """The command's overrides as typed (hydra.overrides.task unresolved: `a=${x}` is text there, and reading the
    list as values would resolve it)."""
    return [str(o) for o in OmegaConf.to_container(hydra_node.overrides.task, resolve=False)]


def experiment(config: DictConfig) -> DictConfig:
    """The experiment's config: Hydra's whole config without its `hydra` node."""
    cfg = copy.deepcopy(config)
    with open_dict(cfg):
        cfg.pop("hydra", None)
    return cfg


def check_experiment(cfg: DictConfig, overrides: list[str]) -> None:
    """What `orchestrate` (or `tune`) checks first, on a copy: the same values (auto ones filled in), the same
    validation (remembered, so that the run does not pay for it twice)."""
    from orchestrator.config.resolve import resolve_auto
    from orchestrator.config.validate import schema_problems, validate

    if cfg.tune.name == "layout":  # tune checks each layout it lists; the base layout's rules do not apply
        problems = schema_problems(cfg, overrides)
        if problems:
            raise ConfigError(problems)
        return
    cfg = copy.deepcopy(cfg)
    resolve_auto(cfg)
    validate(cfg, overrides, remember=True)


def folder_problems(key: str, folder: str) -> list[Problem]:
    from storage.fsio import why_unwritable

    if not folder.strip():
        return [Problem(key, folder, f"{key} is empty: the outputs would land in the working directory's root "
                        "or the filesystem's", f"{key}= a folder of its own")]
    why = why_unwritable(folder)
    return [Problem(key, folder, f"the run's files are written in {key}, but {why}",
                    f"{key}= a folder you can write (or leave it unset: it defaults under runs_dir)")] if why else []


def explain(exc: BaseException, argv: tuple[str, ...] = ()) -> Optional[ConfigError]:
    """A refusal for an exception raised by Hydra, OmegaConf or a sweeper outside the checks (None: not one)."""
    if isinstance(exc, ConfigError):
        return exc
    translated = from_hydra(exc, argv)
    if translated is not None:
        return translated
    for e in _chain(exc):
        if isinstance(e, OmegaConfBaseException) and getattr(e, "full_key", None):
            return ConfigError([value_problem(e.full_key, "?", e)])
    if isinstance(exc, OSError) and _raised_in(exc, "hydra", "run_job"):
        return ConfigError(folder_problems("hydra.run.dir", str(exc.filename or "")) or [
            Problem("hydra.run.dir", exc.filename, f"the run folder cannot be made: {exc.strerror}",
                    "hydra.run.dir= a folder you can write")])
    return None


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _raised_in(exc: BaseException, package: str, function: str) -> bool:
    return any(f.name == function and f"/{package}/" in f.filename for f in traceback.extract_tb(exc.__traceback__))
