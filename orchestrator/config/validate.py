"""Every rule a config must meet, checked before anything starts; all problems reported at once.

This module walks the schema (known keys, choices, bounds) and collects the rules of the config's owners: each
lives with what it constrains and returns `Problem`s from its `check(cfg)`. The owners' rules read fields as
numbers they divide by, so they run once every field is valid on its own (`parallel.hp=0` is reported as the
field's rule, >= 1, not as a crash of a rule that divides by it); the plan's and train.init_from's run once the
model and the layout are sound (they build the partition plan), the trace once all passed. What they found is handed
on (Checked), so that what prints or runs the point reads it instead of going back to the config."""
from __future__ import annotations

import contextlib
import dataclasses
import math
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf

from common.problem import Found, _show
from orchestrator.config.errors import ConfigError, Problem, unknown_key_problem

if TYPE_CHECKING:
    from planning.plan import Plan
    from plugins.data.tokenize_cost import DataRead


@dataclasses.dataclass(frozen=True)
class Check:
    """One owner's rules: `module.function(cfg)` returns Problems about the config section `key`."""
    key: str
    module: str
    function: str = "check"

    def __call__(self, cfg: DictConfig, *args) -> Found:
        """The owner's problems, with what it read to find them where it hands that on (Found.facts); an exception
        in the check itself is one more problem, naming the check, its key and what it raised (its traceback saved):
        a check never crashes the command."""
        import importlib

        try:
            found = getattr(importlib.import_module(self.module), self.function)(cfg, *args)
            return found if isinstance(found, Found) else Found(found)
        except Exception as e:  # noqa: BLE001 (whatever a check meets is said as a refusal, not a traceback)
            return Found([self.failed(cfg, e)])

    def failed(self, cfg: DictConfig, e: BaseException) -> Problem:
        """The problem an exception in this check amounts to; also where what it reads was made for it and stopped
        (the plan's estimates, for the plan's check)."""
        return check_failed(self.key, _shown(cfg, self.key), f"the check of {self.key} ({self.module}.{self.function})",
                            e)


def _shown(cfg: DictConfig, key: str):
    """What a problem about `key` shows as its value: a section by its option's name (data=text), not its keys."""
    value = OmegaConf.select(cfg, key, default="?")
    return value.get("name", "…") if isinstance(value, DictConfig) else value


class CheckFailed(Problem):
    """A check that stopped with an exception (check_failed): said where nothing else explains it."""


def check_failed(key: str, value, what: str, e: BaseException) -> Problem:
    """The problem an exception inside a check amounts to: what failed, on which file (where it names one), its
    text, and where its traceback is."""
    from common import tracebacks

    filename = getattr(e, "filename", None)
    on = f" on {filename}" if isinstance(filename, str) and filename not in tracebacks.said(e) else ""
    return CheckFailed(key, value, f"{what} stopped{on} with {tracebacks.said(e)}: the input it met is one it does "
                       f"not expect ({tracebacks.saved(e)})", "correct the input the error names; if it looks right, "
                       "report this with the command you ran")


@contextlib.contextmanager
def refusing(key: str, value, what: str):
    """A block that checks or plans: an exception in it leaves as a refusal (ConfigError) naming `what`."""
    try:
        yield
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 (said as a refusal, with the traceback saved)
        raise ConfigError([check_failed(key, value, what, e)]) from None


# The owners' checks: the model and its layout first (the partition plan is built from them), then everything
# else in the order a reader meets the config: data, training, the cluster, the engine, the machine. Imported when
# the schema holds: they bring torch (1.5 s), which a config refused by its schema never waits for.
STRUCTURAL = (Check("model", "plugins.models.registry"), Check("parallel", "plugins.parallel.rules"),
              Check("peft", "plugins.models.lora_rules"))
DATA = Check("data", "plugins.data.rules")  # hands on what it read of the corpus (plugins/data/tokenize_cost.DataRead)
OTHERS = (DATA, Check("objective", "plugins.objectives.rules"),
          Check("engine", "plugins.onnx.rules"),
          Check("optimizer", "runtime.optim"), Check("train.profile", "runtime.profiling"),
          Check("cluster", "orchestrator.cluster.rules"), Check("engine", "plugins.engines"),
          Check("precision", "runtime.precision"), Check("triton", "runtime.kernels"),
          Check("tracking", "orchestrator.tracking.store_check"), Check("cache_dir", "orchestrator.cache.store"),
          Check("evaluate", "plugins.evaluate.rules"), Check("plan", "orchestrator.calibration"),
          Check("plan.trace", "planning.trace.rules"),
          Check("sweep.objective", "orchestrator.sweeps.objective"))
FOLDERS = Check("runs_dir", __name__, "_folder_problems")  # the plan's disk check is left out where they fail
INIT_FROM = Check("train.init_from", "storage.init_from")  # with the partition plan's parameters
PLAN = Check("train", "planning.plan")  # memory and disk, from the partition plan (and the corpus the data's read)
TRACE = Check("plan.trace", "planning.trace.verdict", "traced")  # the layout's step traced, once the rest passed
CHECKS = (*STRUCTURAL, *OTHERS, FOLDERS, INIT_FROM, PLAN)


@dataclasses.dataclass(frozen=True)
class Checked:
    """What validation found in a config that passed, made once a point and handed on to whatever prints or runs it:
    the point's plan (planning/plan.py), what the data's check read of the corpus (None where it read none), the
    warnings (legal but unwise settings: the plan says each in a line), the trace's lines (plan.trace)."""
    plan: "Plan"
    data: Optional["DataRead"]
    warnings: list[str]
    traced: list[str] = dataclasses.field(default_factory=list)


# What the configs the command's pre-check validated found (orchestrator/boundary.py, before Hydra writes anything):
# the run that follows validates the same config in this process, and reads it from here instead of checking and
# planning it again. Only `remember=True` adds to it: a sweep's points and tune's trials are checked afresh.
_PASSED: dict[str, Checked] = {}


def validate(cfg: DictConfig, overrides: Iterable[str] = (), remember: bool = False) -> Checked:
    """Raise ConfigError with every problem, else return what the checks found (Checked), made once here and handed
    on to whatever prints or reads it. cfg is checked as it runs: its `auto` values made concrete first
    (orchestrator/config/resolve.py: a run resolves them before it is checked; a sweep's points and tune's trials,
    checked before they run, with with_tokenizer). remember: a config that passes is not checked again in this
    process (orchestrator/boundary.py checks the command before Hydra writes anything; the run that follows is the
    same)."""
    overrides = list(overrides)
    seen = OmegaConf.to_yaml(cfg) + "\0".join(overrides)
    if seen in _PASSED:
        return _PASSED[seen]
    problems, planned, said, read = schema_problems(cfg, overrides), None, [], None  # read: the data's, if it passed
    if not problems:
        structure = [p for check in STRUCTURAL for p in check(cfg)]
        folders = FOLDERS(cfg)
        others = {check: check(cfg) for check in OTHERS}
        read = others[DATA].facts
        problems = structure + [p for found in others.values() for p in found] + folders
        if not structure:  # a plan check that stops on an input another check refused says nothing more
            found, planned, said = _plan_problems(cfg, bool(folders), read)
            problems += [p for p in found if not (problems and isinstance(p, CheckFailed))]
    traced = TRACE(cfg, planned) if cfg.plan.trace and not problems else Found()  # last, alone: slow at scale
    if problems or traced:
        raise ConfigError(problems or traced)
    checked = Checked(planned, read, warnings(cfg) + said, traced.facts or [])  # said: the plan check's lines
    if remember:
        _PASSED[seen] = checked
    return checked


def _plan_problems(cfg: DictConfig, folders_refused: bool, read: Optional["DataRead"]
                   ) -> tuple[list[Problem], Optional["Plan"], list[str]]:
    """The point's plan (None where it cannot be made), what it refuses: train.init_from's shapes against the
    partition plan, the memory and disk of the plan's estimates (read: the corpus as the data's check read it), and
    what the plan's check says without refusing (a dry run's disk)."""
    from planning import plan

    try:
        planned = plan.plan_of(cfg)
    except plan.EstimatesFailed as e:  # the estimates are the plan check's input: said as that check's stopping
        return INIT_FROM(cfg, e.partition["parameters"]) + [PLAN.failed(cfg, e.__cause__)], None, []
    except Exception as e:  # noqa: BLE001 (the partition plan's: said as a check's, not raised)
        return [check_failed("model", OmegaConf.select(cfg, "model.name"), "the partition plan (planning/plan.py)",
                             e)], None, []
    found = PLAN(cfg, planned, read, not folders_refused)
    return INIT_FROM(cfg, planned.parameters) + found, planned, found.facts or []


def warnings(cfg: DictConfig) -> list[str]:
    """Legal but unwise settings: the run goes ahead, and the plan says this in one line each."""
    from plugins.parallel import world_size
    from runtime import machine
    from runtime.threads import usable_cores

    notes = []
    world = world_size(cfg.parallel)
    cores = usable_cores()
    if cfg.cluster.name == "local" and world > cores and not machine.has_cuda():
        notes.append(f"warning: {world} ranks (dp*hp*pp) on {cores} CPU cores: the ranks share cores, so this "
                     "layout runs slowly here (fine for checking correctness; give it more cores or a cluster)")
    if cfg.triton.enabled and cfg.triton.mode == "reduce-overhead" and not machine.has_cuda():
        notes.append("warning: triton.mode=reduce-overhead uses CUDA graphs; on a CPU it compiles as mode=default")
    from plugins.evaluate.prompts import warnings as task_warnings

    return notes + task_warnings(cfg)


def folder_problems(key: str, folder: str, what: str) -> list[Problem]:
    """`what` is written under the folder that `key` names: it must be named, and be (or can be made) writable."""
    from storage.fsio import why_unwritable

    why = "it is empty" if not folder.strip() else why_unwritable(folder)
    return [Problem(key, folder, f"{what} are written under {key}, but {why}",
                    f"{key}= a folder you can write (or leave it unset: it defaults under runs_dir)")] if why else []


def _folder_problems(cfg: DictConfig) -> list[Problem]:
    from storage.fsio import why_unwritable

    problems = []
    written = [("triton.cache_dir", "Inductor's compiled kernels")] if cfg.triton.enabled else []
    if cfg.tracking.name == "mlflow" and "://" not in str(cfg.tracking.artifact_root):
        written.append(("tracking.artifact_root", "MLflow's artifacts"))
    for key, what in written:
        problems += folder_problems(key, str(OmegaConf.select(cfg, key)), what)
    for key in ("runs_dir", "cache_dir"):
        if not str(cfg[key]).strip():
            problems.append(Problem(key, cfg[key], f"{key} is empty: the folders under it would land at the "
                                    "filesystem's root", f"{key}= a folder of its own (the default: runs)"))
            continue
        folder = Path(cfg[key]).expanduser().absolute()
        # an existing cache may be read-only: it serves the stages it holds (orchestrate checks the others)
        writes = key == "runs_dir" or not folder.is_dir()
        why = "it is the filesystem's root: every stage and run would write its folders there" \
            if folder == Path(folder.anchor) else why_unwritable(folder) if writes else ""
        if why:
            problems.append(Problem(key, cfg[key], f"outputs are written under {key}, but {why}",
                                    f"{key}= a folder you can write, of its own (the default is under ./runs)"))
    return problems


# -- the schema: known keys, choices, bounds ---------------------------------------------------------------

def schema_problems(cfg: DictConfig, overrides: list[str]) -> list[Problem]:
    from orchestrator.config.options import options_of
    from orchestrator.config.schema import GROUP_SCHEMAS
    from orchestrator.config.values import group_lists, unresolved

    problems: list[Problem] = unresolved(cfg) + group_lists(overrides) + set_twice(overrides)
    if problems:  # a value that cannot be read cannot be checked
        return problems
    for o in overrides:  # `model=model_schema` composes (Hydra sees the schema in the group), but is no option
        group, _, option = o.lstrip("+").partition("=")
        if group in GROUP_SCHEMAS and option in GROUP_SCHEMAS[group]:
            problems.append(Problem(group, option, f"{option} is the schema of the {group} options, not an option",
                                    f"choose one of: {', '.join(options_of(group))}"))

    def walk(node: DictConfig, path: str) -> None:
        schema = OmegaConf.get_type(node)
        fields = {f.name: f for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else {}
        for name in node.keys():
            full = f"{path}.{name}" if path else str(name)
            if fields and name not in fields:
                added = next((o for o in overrides if o.lstrip("+").split("=", 1)[0] == full), "")
                problems.append(unknown_key_problem(full, schema, node[name], added))
                continue
            child = node._get_node(name)
            if isinstance(child, DictConfig):
                walk(child, full)
                continue
            if isinstance(child, ListConfig) and any(isinstance(child._get_node(i), DictConfig)
                                                     for i in range(len(child))):
                for i in range(len(child)):  # data.mix's sources: each item's keys by its own schema
                    item = child._get_node(i)
                    if isinstance(item, DictConfig):
                        walk(item, f"{full}[{i}]")
                continue
            f = fields.get(name)
            if f is not None:
                # a key that would do nothing is said so first: "leave it unset" holds, where a value in range
                # would be refused in turn as doing nothing
                unread = _unread_problems(cfg, full, node[name], f)
                problems.extend(unread or [_in_entry(p) for p in _field_problems(full, node[name], f)])

    walk(cfg, "")
    return problems


def set_twice(overrides: list[str]) -> list[Problem]:
    """A group chosen twice or a key set twice on the command line: Hydra keeps the last, and the first would
    silently do nothing (`data=text ... data=chat`)."""
    given: dict[str, list[str]] = {}
    for o in overrides:
        key, eq, value = o.lstrip("+~").partition("=")
        if eq and not o.startswith("~"):
            given.setdefault(key.strip(), []).append(value)
    return [Problem(key, " then ".join(values), f"{key} is set {len(values)} times on the command line "
                    f"({', then '.join(f'{key}={v}' for v in values)}): the last one wins, and the others would "
                    "do nothing", f"keep one of them, e.g. {key}={values[-1]}")
            for key, values in given.items() if len(set(values)) > 1]  # the same value twice changes nothing


def _unread_problems(cfg: DictConfig, full: str, value, f: dataclasses.Field) -> list[Problem]:
    """A key set (away from its default) where the config never reads it: the user meant a run this is not.
    read_when is one (key, values) condition or a list of them, all of which must hold (a combination)."""
    from orchestrator.config.schema import Filled

    when = f.metadata.get("read_when")
    if not when:
        return []
    plain = OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value
    if plain == _default(f):
        return []
    for other, wanted in ([when] if isinstance(when[0], str) else when):
        actual = _effective(cfg, other)
        if actual in wanted:
            continue
        if isinstance(wanted, Filled):
            now = f"[{', '.join(map(format, actual))}]" if isinstance(actual, ListConfig) else _show(actual)
            state = "is given" if wanted.filled else "is empty"
            return [Problem(full, value, f"{full} is read only when {other} {state}; with {other}={now} it "
                            "would do nothing", f"{'give ' + other + ' a value' if wanted.filled else other + '=[]'} "
                            f"for it to apply, or leave {full} unset")]
        shown = " or ".join(map(_word, wanted))
        now = _word(actual)
        if actual != (given := OmegaConf.select(cfg, other)):
            now = f"{given} ({actual} here)"
        choose = other.rsplit(".", 1)[0] if other.endswith(".name") else other  # data=synthetic, not data.name=...
        possible = [w for w in wanted if _possible(cfg, other, w)]  # (none: a format the source cannot carry)
        fix = f"{choose}={_word(possible[0])} for it to apply, or leave {full} unset" if possible else \
            f"leave {full} unset (data={cfg.data.name} carries no records of another format)"
        return [Problem(full, value, f"{full} is read only when {other}={shown}; with {other}={now} it would do "
                        f"nothing", fix)]
    return []


def _possible(cfg: DictConfig, key: str, value) -> bool:
    """Whether setting key=value can hold in this config: a record format the data source carries (data=stdlib
    reads text only, so a key read for chat records is better left unset than data.format=chat offered)."""
    if key != "data.format":
        return True
    from plugins.data.registry import get_source, source_names

    return cfg.data.name not in source_names() or get_source(cfg.data.name).carries(value)


def _word(value) -> str:
    """A value as the command line writes it (true, not True)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _effective(cfg: DictConfig, key: str):
    """A key's value as the run reads it: `auto` resolved where the config alone decides it (a chat's rows hold whole
    records: data.packing_strategy=auto is bfd for them)."""
    actual = OmegaConf.select(cfg, key)
    if key == "data.packing_strategy" and actual == "auto":
        from plugins.data.packing import packing_strategy

        return packing_strategy(cfg.data)
    return actual


def _default(f: dataclasses.Field):
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def _in_entry(problem: Problem) -> Problem:
    """A key of a list's entry (data.mix[0].weight): Hydra's overrides cannot set one entry's key, so the fix says
    what the entry holds, for the user to restate the list whole."""
    import re

    m = re.match(r"(\S+)\[(\d+)\]\.(\w+)=(\S+)", problem.fix)
    if m is None:
        return problem
    listed, i, name, value = m.groups()
    return dataclasses.replace(problem, fix=f"{name}: {value} in entry {i} of {listed} (restate {listed} whole: an "
                               f"override cannot set one entry's key){problem.fix[m.end():]}")


def _field_problems(full: str, value, f: dataclasses.Field) -> list[Problem]:
    meta = f.metadata
    is_list = isinstance(value, (list, ListConfig))
    items = list(value) if is_list else [value]
    if any(isinstance(v, float) and not math.isfinite(v) for v in items):
        default = "null" if _default(f) is None else _default(f)  # as an override writes it
        return [Problem(full, value, f"{full} must be a finite number ({meta['help']})", f"{full}={default}")]
    nested = [v for v in items if isinstance(v, (list, tuple, dict, ListConfig, DictConfig))] if is_list else []
    if nested and f.name != "mix":
        flat = [w for v in items for w in (v if isinstance(v, (list, tuple, ListConfig)) else [v])
                if not isinstance(w, (list, tuple, dict, ListConfig, DictConfig))]
        shown, default = f"[{','.join(map(str, flat))}]" if flat else "[a,b]", _default(f)  # the user's items,
        fix = f"{full}=[{','.join(map(str, default))}] (the default), or {shown}" if default else f"{full}={shown}"
        return [Problem(full, value, f"the items of {full} are single values, not lists or mappings "  # unchecked:
                        f"({meta['help']})", f"{fix} (one level of brackets)")]  # after the default
    choices = meta.get("choices")
    if choices and any(v not in choices for v in items):
        return [Problem(full, value, f"{full} must be {'a list of' if is_list else 'one of'} "
                        f"{', '.join(map(str, choices))} ({meta['help']})",
                        f"{full}=[{choices[0]}]" if is_list else f"{full}={choices[0]}")]
    lo, hi = meta.get("min"), meta.get("max")
    for item in items:
        if not isinstance(item, (int, float)) or isinstance(item, bool):
            continue
        if (lo is not None and item < lo) or (hi is not None and item > hi):
            span = f"between {lo} and {hi}" if lo is not None and hi is not None else \
                f">= {lo}" if lo is not None else f"<= {hi}"
            if is_list:
                kept = [v for v in items if (lo is None or v >= lo) and (hi is None or v <= hi)]
                return [Problem(full, value, f"every item of {full} must be {span} ({meta['help']})",
                                f"{full}={kept or [lo if lo is not None else hi]}")]
            default = f.default if f.default is not dataclasses.MISSING else None
            in_range = isinstance(default, (int, float)) and (lo is None or default >= lo) and \
                (hi is None or default <= hi) and default != 0
            return [Problem(full, value, f"{full} must be {span} ({meta['help']})",
                            f"{full}={default if in_range else lo if lo is not None and item < lo else hi}")]
    return []
