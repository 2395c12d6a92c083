"""A `-m` sweep is checked whole before its first point starts (Hydra calls this from `on_multirun_start`,
orchestrator/boundary.py, before the sweeper runs anything).

Three things are checked, in the sweeper's own terms where it has them (then `plan_lines` says what it will cost):
  1. the sweeper's settings: counts of trials and parallel jobs of at least 1;
  2. each swept key's search space: not empty; of a kind this sweeper reads (the basic sweeper runs lists and
     ranges, not `interval(...)`); one its library accepts (Optuna's distributions are built here, as the sweeper
     builds them: `interval(high, low)` or a log interval from 0 are refused with its words);
  3. the points: the basic sweeper's are all known, and every one is validated as `orchestrate` will validate it;
     an optimising sweeper picks its points later, so every value a `choice` or `range` can take and both ends of an
     `interval` are validated, each with the other keys at their first value.
"""
from __future__ import annotations

import itertools
from typing import Optional

from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf

from orchestrator.config.errors import ConfigError, Problem

COUNTS = ("n_trials", "n_jobs", "budget", "num_workers", "max_batch_size")  # sweepers' counts: none may be < 1


def check_sweep(config: DictConfig) -> list[str]:
    """Refuses (ConfigError) what cannot run; returns the sweep's plan, printed before its first point."""
    from orchestrator.config.command import task_overrides
    from orchestrator.config.values import unresolved

    task = task_overrides(config.hydra)
    sweeper = str(OmegaConf.select(config, "hydra.sweeper._target_", default="") or "")
    basic = sweeper.endswith("BasicSweeper")
    overrides = _parse(task + _sweeper_params(config))
    problems = unresolved(config, ("hydra.sweep.dir",)) + _count_problems(config)
    spaces = {}
    for o in overrides:
        if o.is_sweep_override():
            values, problem = _space(o, basic, sweeper)
            problems += [problem] if problem else []
            spaces[o.get_key_element()] = values
    if problems:
        raise ConfigError(problems)
    from orchestrator.config.validate import folder_problems

    problems = folder_problems("hydra.sweep.dir", str(config.hydra.sweep.dir), "the sweep's files")
    study = None
    if OmegaConf.select(config, "hydra.sweeper.study_dir") is not None:  # Optuna's, with its study kept
        from orchestrator.sweeps.study import KeptStudy

        study = KeptStudy.of(config)
        problems += folder_problems("hydra.sweeper.study_dir", str(study.folder), "the study") + \
            study.problems(config)
    if problems:
        raise ConfigError(problems)
    order = [o.get_key_element() if o.is_sweep_override() else o.input_line for o in overrides]
    points = _check_points(config, order, spaces, every_combination=basic)
    return plan_lines(config, points, basic, study)


def plan_lines(config: DictConfig, points: list[DictConfig], basic: bool, study=None) -> list[str]:
    """What the sweep will cost: its points (or trials; study: Optuna's, kept), the time their training takes at
    least, and this process's own memory beside the points' ranks (each point's plan gives theirs)."""
    from orchestrator.run import orchestrator_bytes
    from planning.plan import GB, duration, step_floor

    sweeper = config.hydra.sweeper
    n_trials = OmegaConf.select(config, "hydra.sweeper.n_trials")
    if basic:
        count, what = len(points), f"{len(points)} point(s), every combination of the swept values"
    elif study is not None:
        count = study.to_run(n_trials)
        what = f"Optuna, {study.describe(n_trials)}, {sweeper.n_jobs} at a time (hydra.sweeper.n_jobs)"
    else:
        count, what = None, "as many points as the sweeper picks (its own count, e.g. hydra.sweeper.optim.budget)"
    at_once = points[0].sweep.parallelism if points else 1
    lines = [f"sweep: {what}; {at_once} run at a time here (sweep.parallelism)"]
    timed = [p for p in points if p.cluster.name != "slurm" and not p.dry_run]
    if timed:
        floors = [step_floor(p)[0] * p.train.steps for p in timed]
        each = f"{duration(min(floors))}" + (f" to {duration(max(floors))}" if max(floors) > min(floors) else "")
        total = sum(floors) if basic else min(floors) * count if count is not None else None
        lines.append(f"  time: each point trains at least {each} (its steps at this machine's matmul rate)" +
                     ("; nothing to run" if count == 0 else "" if total is None else
                      f"; the sweep at least {duration(total)} (cached points take none)"))
    lines.append(f"  memory: this process (the orchestrator) {orchestrator_bytes(points[0]) / GB:,.2f} GB, beside "
                 "each point's ranks and stages (its plan says theirs)")
    return lines


def _parse(lines: list[str]) -> list[Override]:
    parsed = OverridesParser.create().parse_overrides(lines)
    for o, line in zip(parsed, lines):
        o.input_line = line
    return parsed


def _sweeper_params(config: DictConfig) -> list[str]:
    """Search spaces given in the sweeper's config (`hydra.sweeper.params`, as Optuna's and the basic sweeper's)."""
    params = OmegaConf.select(config, "hydra.sweeper.params")
    return [f"{k}={v}" for k, v in params.items()] if params else []


def _count_problems(config: DictConfig) -> list[Problem]:
    problems = []
    for name in COUNTS:
        value = OmegaConf.select(config, f"hydra.sweeper.{name}", default=None)
        value = OmegaConf.select(config, f"hydra.sweeper.optim.{name}", default=None) if value is None else value
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            problems.append(Problem(f"hydra.sweeper.{name}", value, f"a sweep of {value} {name.replace('_', ' ')} "
                                    "runs nothing (or fails inside the sweeper)", f"hydra.sweeper.{name}=1 or more"))
    return problems


def _space(o: Override, basic: bool, sweeper: str) -> tuple[list[str], Optional[Problem]]:
    """(the values to validate of a swept key, or a problem with its search space)."""
    key, text = o.get_key_element(), o.input_line.split("=", 1)[1]
    if o.is_interval_sweep():
        if basic:
            return [], Problem(key, text, "interval(...) is a search space for a sweeper that picks its points "
                               "(Optuna's, Nevergrad's, Ax's); the basic sweeper runs a list of points",
                               f"list the values (-m {key}=a,b,c or range(start,stop,step)), or choose a sweeper: "
                               f"hydra/sweeper=optuna hydra.sweeper.n_trials=<N> {key}='{text}'")
        value = o.value()
        values = [str(value.start), str(value.end)]
    else:
        try:
            values = list(o.sweep_string_iterator())
        except HydraException as e:
            return [], Problem(key, text, f"the sweep cannot be read: {e}", "see Hydra's sweep syntax: a,b,c, "
                               "choice(a,b), range(start,stop,step)")
        if not values:
            return [], Problem(key, text, f"{text} holds no value: the sweep would run no point",
                               f"give it values, e.g. -m {key}=range(1,5) (the stop is not included)")
    if "optuna" in sweeper.lower():
        problem = _optuna_problem(o, key, text)
        if problem:
            return [], problem
    return values, None


def _optuna_problem(o: Override, key: str, text: str) -> Optional[Problem]:
    """Build the distribution as the Optuna sweeper will: its refusal, now and with the key."""
    from hydra_plugins.hydra_optuna_sweeper._impl import create_optuna_distribution_from_override

    try:
        create_optuna_distribution_from_override(o)
    except (ValueError, AssertionError, NotImplementedError, TypeError) as e:
        said = str(e).splitlines()[0] if str(e) else type(e).__name__
        fix = "a log interval starts above 0, e.g. tag(log, interval(1e-5, 1e-3))" if "log" in said else \
            "interval(low, high) with low <= high" if "low" in said else "see the Optuna sweeper's search spaces"
        return Problem(key, text, f"Optuna cannot search {text}: {said}", fix)
    return None


def _check_points(config: DictConfig, order: list[str], spaces: dict[str, list[str]],
                  every_combination: bool) -> list[DictConfig]:
    """Compose and validate the points: every combination (the basic sweeper will run exactly those), or each
    value of each key with the others at their first (a sweeper that picks its points). order: the overrides as
    given, a swept key standing for its value."""
    from orchestrator.config.command import check_experiment, experiment, explain
    from orchestrator.sweeps.launcher import SweepConfigError, _check_direction

    keys = list(spaces)
    if every_combination:
        points = [dict(zip(keys, combo)) for combo in itertools.product(*spaces.values())]
    else:
        first = {k: v[0] for k, v in spaces.items()}
        points = [first] + [{**first, k: v} for k in keys for v in spaces[k][1:]]
    loader = GlobalHydra.instance().hydra.config_loader
    failures, seen, checked = [], set(), []
    for point in points:
        overrides = [f"{o}={point[o]}" if o in point else o for o in order]
        if tuple(overrides) in seen:
            continue
        seen.add(tuple(overrides))
        try:
            cfg = experiment(loader.load_sweep_config(config, overrides))
            check_experiment(cfg, overrides)
            _check_direction(cfg, config)
            checked.append(cfg)
        except ConfigError as e:
            failures.append((overrides, e))
        except HydraException as e:
            translated = explain(e, tuple(overrides))
            if translated is None:
                raise
            failures.append((overrides, translated))
    if failures:
        raise SweepConfigError(failures)
    return checked
