"""The boundary between a command and what it starts: every mistake in the command becomes a refusal before
anything is written, and anything else one readable line.

Hydra composes the config, then calls the callbacks' `on_run_start` / `on_multirun_start`, and only after those
makes the run (or sweep) folder. `Precheck`, registered in conf/config.yaml, uses that moment: it resolves Hydra's
keys that the run reads, checks the run folder, and validates the experiment as `orchestrate` will (validation
resolves every key first and refuses a list given to a config group: orchestrator/config/values.py); for `-m`,
every point of the sweep and the sweeper's search space (orchestrator/sweeps/check.py). A refusal is a
`ConfigError`: `python -m orchestrator` prints it and exits 2, with nothing written.

`explain` turns what Hydra, OmegaConf or a sweeper raise on their own into the same refusal where the exception
names a key; `unexpected` saves any other exception's traceback to a file and returns the line that says where.
"""
from __future__ import annotations

from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from common import tracebacks

from orchestrator.config.command import experiment, explain, task_overrides
from orchestrator.config.errors import ConfigError
from orchestrator.config.validate import check_failed, folder_problems
from orchestrator.phases import check
from orchestrator.config.values import unresolved


class Refused(BaseException):
    """A refusal on its way out of a Hydra callback: Hydra turns a callback's Exception into a warning and goes
    on, so the refusal travels as a BaseException (as KeyboardInterrupt does) to `python -m orchestrator`."""

    def __init__(self, error: ConfigError):
        super().__init__(str(error))
        self.error = error


class Precheck(Callback):
    """hydra.callbacks.precheck in conf/config.yaml: the whole command checked before Hydra writes anything."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _refusing(check_run, config, "overrides")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from orchestrator.report import console
        from orchestrator.sweeps.check import check_sweep

        for line in _refusing(check_sweep, config, "sweep"):
            console.print(line, soft_wrap=True, markup=False)


CHECKING: list[str] = []  # the check in progress ("sweep", "overrides"): a signal during it stopped nothing started


def _refusing(check, config: DictConfig, key: str) -> Any:
    """check(config), its exceptions refusals: Hydra's and OmegaConf's in config terms, any other one as a check
    that stopped (naming it, and `key`: what was checked, with the command's overrides; its traceback saved)."""
    CHECKING.append(key)
    try:
        result = check(config)
        CHECKING.remove(key)
        return result
    except Exception as e:  # everything the checks meet is the command's problem, said as a refusal
        error = explain(e, tuple(task_overrides(config.hydra)))
        if error is None:
            where = f"the command's check ({check.__module__}.{check.__name__})"
            error = ConfigError([check_failed(key, " ".join(task_overrides(config.hydra)), where, e)])
        raise Refused(error) from None


def check_run(config: DictConfig) -> None:
    """A single run: every key resolves, the run folder can be made, and the experiment validates."""
    problems = unresolved(config, ("hydra.run.dir",))  # Hydra's key the run reads (validate resolves the rest)
    if problems:
        raise ConfigError(problems)
    cfg = experiment(config)
    check(cfg, task_overrides(config.hydra))
    if cfg.tune.name == "layout":  # and one layout at least runs: else no trial starts, and the layouts that do say
        from orchestrator.sweeps.tune import layout_problems

        if problems := layout_problems(cfg):
            raise ConfigError(problems)
    run_dir = str(config.hydra.run.dir)
    problems = folder_problems("hydra.run.dir", run_dir, "the run's files") + sweep_keys_alone(config)
    if problems:
        raise ConfigError(problems)


def sweep_keys_alone(config: DictConfig) -> list:
    """sweep.* keys that only a sweep (-m) reads, set on a single run: they would do nothing."""
    from orchestrator.config.errors import Problem
    from orchestrator.config.schema import SweepConfig

    defaults = SweepConfig()
    return [Problem(f"sweep.{name}", config.sweep[name], f"sweep.{name} is read by a sweep (-m) only; this command "
                    "runs one experiment, which it would not change", f"python -m orchestrator -m ... to sweep, or "
                    f"leave sweep.{name} unset") for name in ("parallelism", "max_points")
            if config.sweep[name] != getattr(defaults, name)]


def unexpected(exc: BaseException) -> str:
    """One line for an exception nobody expected, its traceback saved to a file (the line says where)."""
    return f"error: {tracebacks.said(exc)} (an unexpected error: {tracebacks.saved(exc)}; please report it with " \
           "the command you ran)"
