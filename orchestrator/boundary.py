"""The boundary between a command and what it starts: every mistake in the command becomes a refusal before
anything is written, and anything else one readable line.

Hydra composes the config, then calls the callbacks' `on_run_start` / `on_multirun_start`, and only after those
makes the run (or sweep) folder. `Precheck`, registered in conf/config.yaml, uses that moment: it resolves every
key (an `${oc.env:VAR}` of an unset variable, an interpolation to nothing or to itself, a `???` left by `~group`),
refuses a list given to a config group, checks the run folder, and validates the experiment as `orchestrate` will
(for `-m`: every point of the sweep and the sweeper's search space, orchestrator/sweep_check.py). A refusal is a
`ConfigError`: `python -m orchestrator` prints it and exits 2, with nothing written.

`explain` turns what Hydra, OmegaConf or a sweeper raise on their own into the same refusal where the exception
names a key; `unexpected` saves any other exception's traceback to a file and returns the line that says where.
"""
from __future__ import annotations

import copy
import datetime
import os
import tempfile
import traceback
from pathlib import Path
from typing import Any, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import (InterpolationKeyError, InterpolationResolutionError, MissingMandatoryValue,
                              OmegaConfBaseException, UnsupportedInterpolationType)

from orchestrator.config.errors import ConfigError, Problem, from_hydra

# the keys of Hydra's own node that the orchestrator reads (the run and sweep folders, the job's name)
HYDRA_KEYS = ("hydra.run.dir", "hydra.sweep.dir", "hydra.job.name")


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
        from orchestrator.sweep_check import check_sweep

        _refusing(check_sweep, config)


def _refusing(check, config: DictConfig) -> None:
    try:
        check(config)
    except Exception as e:  # everything the checks meet is the command's problem, or a bug said in one line
        error = explain(e, tuple(task_overrides(config.hydra)))
        if error is None:
            raise Refused(ConfigError([])) from e
        raise Refused(error) from None


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


def check_run(config: DictConfig) -> None:
    """A single run: every key resolves, the run folder can be made, and the experiment validates."""
    problems = unresolved(config, HYDRA_KEYS[:1]) + group_lists(task_overrides(config.hydra))
    if problems:
        raise ConfigError(problems)
    check_experiment(experiment(config), task_overrides(config.hydra))
    run_dir = str(config.hydra.run.dir)
    problems = folder_problems("hydra.run.dir", run_dir)
    if problems:
        raise ConfigError(problems)


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


# -- interpolations -------------------------------------------------------------------------------------------

def unresolved(config: DictConfig, hydra_keys: tuple[str, ...] = ()) -> list[Problem]:
    """A problem for every key of the experiment (and the given keys of Hydra's node) whose value cannot be
    resolved, or is missing (`???`)."""
    problems: list[Problem] = []

    def walk(node, path: str) -> None:
        keys = range(len(node)) if isinstance(node, ListConfig) else list(node.keys())
        for name in keys:
            full = f"{path}[{name}]" if isinstance(node, ListConfig) else f"{path}.{name}" if path else str(name)
            if full == "hydra":
                continue
            child = node._get_node(name)
            raw = child._value() if child is not None else None
            if child is not None and not child._is_interpolation() and child._is_missing():
                problems.append(missing_problem(full))
                continue
            try:
                value = node[name]
            except OmegaConfBaseException as e:
                problems.append(value_problem(full, raw, e))
                continue
            if isinstance(value, (DictConfig, ListConfig)):
                walk(value, full)

    walk(config, "")
    for key in hydra_keys:
        try:
            OmegaConf.select(config, key, throw_on_missing=True)
        except OmegaConfBaseException as e:
            problems.append(value_problem(key, _raw(config, key), e))
    return problems


def _raw(config: DictConfig, key: str) -> Any:
    parent, _, name = key.rpartition(".")
    node = OmegaConf.select(config, parent) if parent else config
    child = node._get_node(name) if isinstance(node, DictConfig) else None
    return child._value() if child is not None else "?"


def missing_problem(key: str) -> Problem:
    from orchestrator.config.options import options_of
    from orchestrator.config.schema import GROUP_SCHEMAS

    if key in GROUP_SCHEMAS or key == "tune":
        return Problem(key, "???", f"{key} is a config group every experiment needs (deleting it with ~{key} "
                       "leaves it without a value)", f"choose one of its options: {key}={options_of(key)[0]} "
                       f"(options: {', '.join(options_of(key))})")
    return Problem(key, "???", f"{key} has no value (??? marks a value the config requires)",
                   f"set it: {key}=<value>")


def value_problem(key: str, raw: Any, e: BaseException) -> Problem:
    """The problem of a value OmegaConf could not resolve, by the kind of failure."""
    said = str(e).splitlines()[0] if str(e) else type(e).__name__
    if isinstance(e, MissingMandatoryValue):
        return missing_problem(getattr(e, "full_key", None) or key)
    if isinstance(e, InterpolationKeyError):
        target = said.split("'")[1] if said.count("'") >= 2 else said
        return Problem(key, raw, f"{key} refers to {target}, which is not a key of the config",
                       f"refer to a key that exists (python -m orchestrator --cfg job prints them all), or give "
                       f"{key} a value")
    if isinstance(e, UnsupportedInterpolationType):
        from omegaconf import OmegaConf as oc

        known = sorted(n for n in ("oc.env", "oc.select", "oc.decode", "oc.create", "oc.deprecated", "now",
                                   "hydra") if oc.has_resolver(n))
        return Problem(key, raw, f"{key} uses a resolver that does not exist ({said})",
                       f"use one of: {', '.join(known)}")
    if isinstance(e, InterpolationResolutionError) and "Environment variable" in said:
        var = said.split("'")[1] if said.count("'") >= 2 else "it"
        return Problem(key, raw, f"{key} reads the environment variable {var}, which is not set",
                       f"export {var}=... before the command, or give a default: ${{oc.env:{var},<default>}}")
    if isinstance(e, InterpolationResolutionError) and "Recursive" in said:
        return Problem(key, raw, f"{key} refers to itself (directly or through other keys): it has no value",
                       f"give {key} a value, or refer to another key")
    return Problem(key, raw, f"{key} cannot be resolved: {said}", f"give {key} a plain value")


# -- config groups ---------------------------------------------------------------------------------------------

def group_lists(overrides: list[str]) -> list[Problem]:
    """`model=[a,b]` is legal in Hydra (both options merged into one config, the last winning), and never what a
    user of this command means: one option per group, or -m to sweep over them."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from orchestrator.config.schema import GROUP_SCHEMAS

    problems = []
    for o in OverridesParser.create().parse_overrides(overrides):
        key = o.get_key_element().lstrip("+~")
        if (key in GROUP_SCHEMAS or key == "tune") and isinstance(o.value(), list):
            items = ",".join(str(v) for v in o.value())
            problems.append(Problem(key, f"[{items}]", f"{key} is a config group: a list merges its options into "
                                    "one config (Hydra's rule), the last one's values winning",
                                    f"one option ({key}={o.value()[0] if o.value() else '...'}), or -m {key}={items} "
                                    "to run each"))
    return problems


# -- what escapes anyway -----------------------------------------------------------------------------------------

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
