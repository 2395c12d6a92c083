"""The command's config, as the run will see it: its overrides as typed, the experiment without Hydra's node, the
checks a run makes first, and the refusal an exception from Hydra, OmegaConf or a sweeper amounts to. Shared by the
command's boundary (orchestrator/boundary.py) and the whole-sweep check (orchestrator/sweeps/check.py)."""
from __future__ import annotations

import copy
from typing import Optional

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from orchestrator.config.errors import ConfigError, from_hydra
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


def check_experiment(cfg: DictConfig, overrides: list[str]):
    """What `orchestrate` (or `tune`) checks first: the same values (auto ones filled in, in cfg: pass a copy, such
    as experiment()'s), the same validation (remembered, so that the run does not pay for it twice). -> the point's
    plan (planning/plan.py) that validation made; None for tune=layout, whose trials are planned one by one."""
    from orchestrator.config.resolve import resolve_auto
    from orchestrator.config.validate import validate

    if cfg.tune.name == "layout":  # tune checks each layout it lists; the base layout's rules do not apply
        problems = tune_problems(cfg, overrides)
        if problems:
            raise ConfigError(problems)
        return None
    resolve_auto(cfg)
    return validate(cfg, overrides, remember=True).plan


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
    return None


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def tune_problems(cfg: DictConfig, overrides: list[str]) -> list:
    """tune's own keys (bounds, choices) before any layout is listed, and no layout key given: each trial sets the
    layout and the memory level itself, so one given on the command line would do nothing."""
    from orchestrator.config.errors import Problem
    from orchestrator.config.validate import schema_problems

    chosen = [o for o in overrides if o not in kept_beside_tune(overrides) and not o.lstrip("+").startswith("tune")]
    return schema_problems(cfg, overrides) + [
        Problem(o.split("=", 1)[0].lstrip("+~"), o.split("=", 1)[-1], "tune=layout tries every layout of "
                "tune.world_size ranks, each with the memory level it needs: the layout and memory keys are its "
                "to choose, and this one would do nothing", f"remove {o} (tune.world_size= the ranks to lay out)")
        for o in chosen]


def kept_beside_tune(overrides: list[str]) -> list[str]:
    """The command's overrides less those a layout trial sets (a key set twice is refused)."""
    return [o for o in overrides if not o.split("=", 1)[0].lstrip("+").startswith(("tune", "parallel", "memory"))]
