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

import datetime
import os
import tempfile
import traceback
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from orchestrator.config.command import check_experiment, experiment, explain, task_overrides
from orchestrator.config.errors import ConfigError
from orchestrator.config.validate import folder_problems
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
        _refusing(check_run, config)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from orchestrator.report import console
        from orchestrator.sweeps.check import check_sweep

        for line in _refusing(check_sweep, config):
            console.print(line, soft_wrap=True, markup=False)


def _refusing(check, config: DictConfig) -> Any:
    try:
        return check(config)
    except Exception as e:  # everything the checks meet is the command's problem, or a bug said in one line
        error = explain(e, tuple(task_overrides(config.hydra)))
        if error is None:
            raise Refused(ConfigError([])) from e
        raise Refused(error) from None


def check_run(config: DictConfig) -> None:
    """A single run: every key resolves, the run folder can be made, and the experiment validates."""
    problems = unresolved(config, ("hydra.run.dir",))  # Hydra's key the run reads (validate resolves the rest)
    if problems:
        raise ConfigError(problems)
    check_experiment(experiment(config), task_overrides(config.hydra))
    run_dir = str(config.hydra.run.dir)
    problems = folder_problems("hydra.run.dir", run_dir, "the run's files")
    if problems:
        raise ConfigError(problems)


def unexpected(exc: BaseException) -> str:
    """One line for an exception nobody expected, its traceback saved to a file (the line says where)."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = Path(tempfile.gettempdir()) / f"orchestrator-error-{stamp}-{os.getpid()}.txt"
    try:
        path.write_text("".join(traceback.format_exception(exc)))
        where = f"the traceback is in {path}"
    except OSError as e:
        where = f"its traceback could not be saved ({e.strerror})"
    said = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"error: {type(exc).__name__}{': ' + said if said else ''} (an unexpected error: {where}; please " \
           "report it with the command you ran)"
