"""A `-m` sweep is checked whole before its first point starts (Hydra calls this from `on_multirun_start`,
orchestrator/boundary.py, before the sweeper runs anything).

Three things are checked, in the sweeper's own terms where it has them (then `plan_lines` says what it will cost):
  1. the sweeper's settings: counts of trials and parallel jobs of at least 1; its sampler built as the sweeper
     will build it (a seed out of range is refused with Optuna's words), a grid given only lists;
  2. each swept key's search space: not empty; of a kind this sweeper reads (the basic sweeper runs lists and
     ranges, not `interval(...)`); one its library accepts (Optuna's distributions are built here, as the sweeper
     builds them: `interval(high, low)` or a log interval from 0 are refused with its words);
  3. the points, counted before any is made (a range's length is arithmetic): above sweep.max_points the sweep is
     refused at once. Under it, every combination is validated as `orchestrate` will validate it: the basic
     sweeper's points, an optimising sweeper's finite space (choices, ranges) and the corners of its continuous one
     (an interval's two ends). An optimising sweeper's space larger than that has each value validated with the
     other keys at their first, and a point it picks that is invalid is refused as a failed trial
     (orchestrator/sweeps/launcher.py), never run again.
A signal stops the check at once (it runs in the main thread, where Python raises KeyboardInterrupt).
"""
from __future__ import annotations

import copy
import itertools
import math
from pathlib import Path
from typing import Optional

from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Glob, Override, RangeSweep
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict

from orchestrator import interrupt
from orchestrator.config.errors import ConfigError, Problem

SPREAD = 32  # an optimising sweeper's space past sweep.max_points: at most this many values checked, all keys together
COUNTS = ("n_trials", "n_jobs", "budget", "num_workers", "max_batch_size")  # sweepers' counts: none may be < 1


def check_sweep(config: DictConfig) -> list[str]:
    """Refuses (ConfigError) what cannot run; returns the sweep's plan, printed before its first point."""
    from orchestrator.config.command import task_overrides
    from orchestrator.config.values import unresolved

    task = task_overrides(config.hydra)
    sweeper = str(OmegaConf.select(config, "hydra.sweeper._target_", default="") or "")
    basic = sweeper.endswith("BasicSweeper")
    overrides = _parse(task + _sweeper_params(config))
    problems = unresolved(config, ("hydra.sweep.dir",)) + _count_problems(config) + \
        _plugin_problems(config) + _sampler_problems(config, overrides)
    if problems:
        raise ConfigError(problems)
    swept = [o for o in overrides if o.is_sweep_override()]
    if not basic and not swept:
        raise ConfigError([Problem("hydra.sweeper", sweeper.rsplit(".", 1)[-1], "this sweeper searches the keys "
                                   "swept on the command line (or in hydra.sweeper.params), and none is: every trial "
                                   "would run the same point", "sweep a key, e.g. 'optimizer.lr=interval(1e-4,1e-2)' "
                                   "or 'train.batch_size=choice(8,16)'")])
    count = math.prod(_count(o) for o in swept)
    limit = config.sweep.max_points
    if basic and count > limit:
        raise ConfigError([_too_many(swept, count, limit)])
    spaces = {}
    # values checked per key: all where every combination is; else a spread (the sampler picks few of them)
    most = limit if count <= limit else max(2, min(limit, SPREAD) // max(1, len(swept)))
    for o in swept:
        values, problem = _space(o, basic, sweeper, most)
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
    checks = count if count <= limit else 1 + sum(len(v) - 1 for v in spaces.values())
    if checks >= 20:  # several seconds: say what is going on (a signal stops it at once)
        from orchestrator.report import console

        console.print(f"sweep: checking {checks} point(s) before the first starts", soft_wrap=True, markup=False)
    points, plans = _check_points(config, order, spaces, every_combination=count <= limit)
    lines = plan_lines(config, points, basic, study, plans)
    if not basic and swept:
        lines.insert(1, f"  checked: every combination of the search space's values ({count}; an interval by its two "
                        "ends)" if count <= limit else f"  checked: each value (at most {most} a key, spread from end "
                        f"to end) with the other keys at their first ({count:,} combinations > sweep.max_points="
                        f"{limit}); a combination the sampler picks that is invalid is refused as a failed trial")
    return lines


def _count(o: Override) -> int:
    """How many values a swept key takes, without listing them (a range's length is arithmetic; an interval
    counts its two ends, which is what is checked of it)."""
    value = o.value()
    if o.is_interval_sweep():
        return 2
    if isinstance(value, Glob):  # a group's options it matches (a key's glob is refused by _space)
        return max(1, len(_glob(o, o.get_key_element(), o.input_line.split("=", 1)[1])[0]))
    if isinstance(value, RangeSweep):
        step = value.step or 1  # a step of 0 is refused by _space (counted first, as one of 1)
        return max(0, math.ceil((value.stop - value.start) / step))
    return max(1, len(getattr(value, "list", None) or [value]))


def _too_many(swept: list[Override], count: int, limit: int) -> Problem:
    sizes = " x ".join(f"{o.get_key_element()}: {_count(o):,}" for o in swept)
    return Problem("sweep.max_points", limit, f"this sweep has {count:,} points ({sizes}), more than sweep.max_points: "
                   "each is validated before the first starts (about 0.2 s each) and run as its own experiment",
                   f"fewer values, sweep.max_points={count} to check and run them all, or a sweeper that samples: "
                   "hydra/sweeper=optuna hydra.sweeper.n_trials=<N> with the same search space")


def _plugin_problems(config: DictConfig) -> list[Problem]:
    """The launcher and the sweeper built from their settings as Hydra will build them after this check: a key
    either does not take (`+hydra.launcher.foo=1`) refused now, with its words."""
    from hydra.core.plugins import Plugins

    problems = []
    for key in ("hydra.launcher", "hydra.sweeper"):
        node = OmegaConf.select(config, key)
        try:
            Plugins.instance()._instantiate(copy.deepcopy(node))  # Hydra's own way: it trusts its core plugins
        except Exception as e:  # noqa: BLE001 (Hydra's InstantiationException wraps the plugin's own TypeError)
            problems.append(Problem(key, str(node.get("_target_", "?")).rsplit(".", 1)[-1], f"Hydra cannot build "
                                    f"{key} from its settings: {_cause_said(e)}", f"remove the {key}.* setting it names, or see "
                                    "the plugin's settings (python -m orchestrator -m --cfg hydra)"))
    return problems


def _cause_said(e: Exception) -> str:
    """The first line of what a plugin raised (Hydra's instantiate wraps it: its cause, where there is one)."""
    cause = e.__cause__ or e
    return str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__


def _sampler_problems(config: DictConfig, overrides: list[Override]) -> list[Problem]:
    """An Optuna sampler built as the sweeper will build it (its seed checked by numpy's rule), and a grid given
    only listed values (Optuna's grid cannot enumerate an interval)."""
    sampler = OmegaConf.select(config, "hydra.sweeper.sampler")
    if sampler is None:
        return []
    from hydra.utils import instantiate

    target = str(sampler.get("_target_", ""))
    try:
        instantiate(sampler)
    except Exception as e:  # noqa: BLE001 (whatever the sampler refuses is said with its key)
        said = _cause_said(e)
        key = "hydra.sweeper.sampler.seed" if "seed" in said.lower() else "hydra.sweeper.sampler"
        value = OmegaConf.select(config, key) if key.endswith("seed") else target
        return [Problem(key, value, f"{target.rsplit('.', 1)[-1]} cannot be built: {said}",
                        "hydra.sweeper.sampler.seed= a number from 0 to 4294967295" if key.endswith("seed") else
                        "see Optuna's documentation of this sampler's arguments")]
    directions = OmegaConf.select(config, "hydra.sweeper.direction")
    given = list(directions) if OmegaConf.is_list(directions) else [directions] if directions is not None else []
    wrong = [d for d in given if str(d).rsplit(".", 1)[-1].lower() not in ("minimize", "maximize")]
    if wrong:
        return [Problem("hydra.sweeper.direction", wrong[0], "Optuna minimizes or maximizes the objective",
                        "hydra.sweeper.direction=minimize (the natural direction of sweep.objective)")]
    if len(given) > 1:  # a multi-objective study: Optuna would take each point's one value and fail every trial
        shown = f"[{', '.join(str(d).rsplit('.', 1)[-1] for d in given)}]"
        return [Problem("hydra.sweeper.direction", shown, f"{len(given)} directions ask Optuna for a study of "
                        f"{len(given)} objectives, and a point returns one, sweep.objective's: every trial would "
                        "train, then fail", "one direction: hydra.sweeper.direction=minimize (a loss) or maximize (a "
                        "score)")]
    if target.endswith("GridSampler"):
        intervals = [o for o in overrides if o.is_sweep_override() and o.is_interval_sweep()]
        return [Problem(o.get_key_element(), o.input_line.split("=", 1)[1], "Optuna's grid sampler runs every "
                        "combination of listed values; an interval has no list", f"list the values: "
                        f"{o.get_key_element()}=choice(a,b,c) or range(start,stop,step), or another sampler "
                        "(hydra/sweeper/sampler=tpe)") for o in intervals]
    return []


def _check_folder(loaded: DictConfig, index: int, overrides: list[str], folders: dict[str, list[str]]) -> None:
    """Each point writes its config, plan and logs into hydra.sweep.dir/hydra.sweep.subdir: two points that resolve
    to one folder would overwrite each other's (`hydra.sweep.subdir=same`)."""
    with open_dict(loaded):
        loaded.hydra.job.num = loaded.hydra.job.id = index  # as the launcher numbers them
    subdir = OmegaConf.select(loaded, "hydra.sweep.subdir")
    other = folders.setdefault(subdir, overrides)
    if other is not overrides:
        raise ConfigError([Problem("hydra.sweep.subdir", subdir, f"the points {' '.join(other)} and "
                                   f"{' '.join(overrides)} would both write into "
                                   f"{subdir}, the second overwriting the first's config, plan and logs",
                                   "leave hydra.sweep.subdir at its default (${hydra.job.num}: one folder a point), "
                                   "or make it differ per point (e.g. ${hydra.job.override_dirname})")])


def plan_lines(config: DictConfig, points: list[DictConfig], basic: bool, study=None, plans: Optional[list] = None
               ) -> list[str]:
    """What the sweep will cost: its points (or trials; study: Optuna's, kept), the time their training takes at
    least, and this process's own memory beside the points' ranks (each point's plan gives theirs). plans: each
    point's plan (planning/plan.py) as validation made it, or None (tune=layout: its trials are planned one by one)."""
    from orchestrator.run_plan import orchestrator_bytes
    from planning.plan import GB, plan_of
    from planning.plan_time import duration, expected_times
    from planning.stage_time import timing_of

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
    plans = plans or [None] * len(points)
    timed = [(p, timing_of(p, planned or plan_of(p)))
             for p, planned in zip(points, plans) if p.cluster.name != "slurm" and not p.dry_run and not p.data.preview
             and not isinstance(planned, list)]  # an experiment's points: each phase's plan times it, as it runs
    if timed:  # each point's train stage as its own plan times it: by a comparable run measured here, else its floor
        trains = [expected_times(p, timing, ["train"], Path(p.cache_dir).resolve())["train"] for p, timing in timed]
        seconds = [e.seconds for e in trains]
        floors = sum(e.floor for e in trains)
        bound = "at least" if floors else "about"
        each = f"{duration(min(seconds))}" + (f" to {duration(max(seconds))}" if max(seconds) > min(seconds) else "")
        how = "its steps at this machine's matmul rate: no run of its layout measured here yet" if floors == len(
            trains) else "as a run measured here" if not floors else \
            f"{len(trains) - floors} as a run measured here, {floors} at their matmul rate (none measured)"
        total = sum(seconds) if basic else min(seconds) * count if count is not None else None
        lines.append(f"  time: each point trains {bound} {each} ({how})" +
                     ("; nothing to run" if count == 0 else "" if total is None else
                      f"; the sweep {bound} {duration(total)} (cached points take none)"))
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


def _space(o: Override, basic: bool, sweeper: str, most: int) -> tuple[list[str], Optional[Problem]]:
    """(the values to validate of a swept key, at most `most` of them spread from end to end, or a problem with
    its search space)."""
    key, text = o.get_key_element(), o.input_line.split("=", 1)[1]
    if isinstance(o.value(), Glob):  # options of a config group, listed by name
        return _glob(o, key, text)
    if isinstance(o.value(), RangeSweep) and not o.value().step:
        return [], Problem(key, text, "a range with a step of 0 never reaches its stop",
                           f"range(start,stop,step) with a step other than 0, e.g. -m {key}=range(1,5)")
    if o.is_interval_sweep():
        if basic:
            return [], Problem(key, text, "interval(...) is a search space for a sweeper that picks its points "
                               "(Optuna's, Nevergrad's, Ax's); the basic sweeper runs a list of points",
                               f"list the values (-m {key}=a,b,c or range(start,stop,step)), or choose a sweeper: "
                               f"hydra/sweeper=optuna hydra.sweeper.n_trials=<N> {key}='{text}'")
        value = o.value()
        values = [str(value.start), str(value.end)]
    elif isinstance(o.value(), RangeSweep) and not o.value().shuffle and _count(o) > most:
        r = o.value()  # listed, a range of 10^9 values would fill the memory: its values at spread positions
        values = [str(r.start + r.step * i) for i in _spread(_count(o), most)]
    else:
        try:
            values = list(o.sweep_string_iterator())
            values = [values[i] for i in _spread(len(values), most)]
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


def _glob(o: Override, key: str, text: str) -> tuple[list[str], Optional[Problem]]:
    """glob(...) picks options of a config group by name (model=glob(gpt*)); a key has no options to pick from."""
    from orchestrator.config.options import options_of
    from orchestrator.config.schema import GROUP_SCHEMAS

    if key not in GROUP_SCHEMAS:
        return [], Problem(key, text, f"glob(...) picks options of a config group by name, and {key} is a key, not "
                           f"a group (groups: {', '.join(GROUP_SCHEMAS)})", f"list the values: -m {key}=a,b,c")
    values = o.value().filter(options_of(key))
    if not values:
        return [], Problem(key, text, f"{text} matches no option of {key}", f"one of: {', '.join(options_of(key))}")
    return values, None


def _spread(n: int, most: int) -> list[int]:
    """Indices of at most `most` of n values, evenly spread, both ends included."""
    if n <= most:
        return list(range(n))
    return sorted({round(i * (n - 1) / (most - 1)) for i in range(most)})


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
                  every_combination: bool) -> tuple[list[DictConfig], list]:
    """Compose and validate the points: every combination (the basic sweeper will run exactly those), or each
    value of each key with the others at their first (a sweeper that picks its points). order: the overrides as
    given, a swept key standing for its value. -> the points, and each one's plan (orchestrator/phases.py check's)."""
    from orchestrator.config.command import experiment, explain
    from orchestrator.phases import check
    from orchestrator.sweeps.launcher import SweepConfigError, _check_direction

    keys = list(spaces)
    if every_combination:
        points = [dict(zip(keys, combo)) for combo in itertools.product(*spaces.values())]
    else:
        first = {k: v[0] for k, v in spaces.items()}
        points = [first] + [{**first, k: v} for k in keys for v in spaces[k][1:]]
    loader = GlobalHydra.instance().hydra.config_loader
    failures, seen, checked, plans, folders, directions = [], set(), [], [], {}, {}
    for point in points:
        if interrupt.requested():  # a signal whose KeyboardInterrupt a library swallowed (C code clears errors)
            raise KeyboardInterrupt
        overrides = [f"{o}={point[o]}" if o in point else o for o in order]
        if tuple(overrides) in seen:
            continue
        seen.add(tuple(overrides))
        try:
            loaded = loader.load_sweep_config(config, overrides)
            _check_folder(loaded, len(seen) - 1, overrides, folders)
            cfg = experiment(loaded)
            planned = check(cfg, overrides)
            try:  # the sweeper's direction against the objective's: one problem for the sweep, said once
                _check_direction(cfg, config)
            except ConfigError as e:
                directions.update({(p.key, p.rule, p.fix): p for p in e.problems})
            checked.append(cfg)
            plans.append(planned)
        except ConfigError as e:
            failures.append((overrides, e))
        except HydraException as e:
            translated = explain(e, tuple(overrides))
            if translated is None:
                raise
            failures.append((overrides, translated))
    if failures:
        raise SweepConfigError(failures)
    if directions:
        raise ConfigError(list(directions.values()))
    return checked, plans
