"""Every rule a config must meet, checked before anything starts; all problems reported at once.

This module walks the schema (known keys, choices, bounds) and collects the rules of the config's owners: each
lives with what it constrains and returns `Problem`s from its `check(cfg)`. The owners' rules read fields as
numbers they divide by, so they run once every field is valid on its own (`parallel.hp=0` is reported as the
field's rule, >= 1, not as a crash of a rule that divides by it); the plan's (memory, disk) and train.init_from's
run once the model and the layout are sound, since they build the partition plan."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Iterable

from omegaconf import DictConfig, ListConfig, OmegaConf

from orchestrator.config.errors import ConfigError, Problem, unknown_key_problem


def _owners() -> tuple[tuple, tuple]:
    """(the model and its layout, from which the partition plan is built; everything else, in the order a reader
    meets the config: data, training, the cluster, the engine, the machine). Imported when the schema holds: they
    bring torch (1.5 s), which a config refused by its schema never waits for."""
    from orchestrator.cache import store as cache
    from orchestrator.tracking import tracker as tracking
    from orchestrator.cluster import rules as cluster
    from plugins.data import rules as data
    from plugins import engines
    from plugins.onnx import rules as onnx
    from plugins.models import registry as models
    from plugins.parallel import rules as layout
    from runtime import kernels, optim, precision, profiling

    return ((models.check, layout.check),
            (data.check, onnx.check, optim.check, profiling.check, cluster.check, engines.check, precision.check, kernels.check,
             tracking.check, cache.check))


_PASSED: set[str] = set()  # configs the command's pre-check validated (the run then does not check them again)


def validate(cfg: DictConfig, overrides: Iterable[str] = (), remember: bool = False) -> None:
    """Raise ConfigError with every problem. remember: a config that passes is not checked again in this process
    (orchestrator/boundary.py checks the command before Hydra writes anything; the run that follows is the same)."""
    overrides = list(overrides)
    seen = OmegaConf.to_yaml(cfg) + "\0".join(overrides)
    if seen in _PASSED:
        return
    problems = schema_problems(cfg, overrides)
    if not problems:
        from planning import plan
        from storage import init_from

        structural, others = _owners()
        structure = [p for rule in structural for p in rule(cfg)]
        folders = _folder_problems(cfg)
        problems = structure + [p for rule in others for p in rule(cfg)] + folders
        if not structure:
            problems += init_from.check(cfg, plan.partition_plan(cfg)["parameters"])
            problems += plan.check(cfg, disk=not folders)
    if problems:
        raise ConfigError(problems)
    if remember:
        _PASSED.add(seen)


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
    return notes


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

    problems: list[Problem] = unresolved(cfg) + group_lists(overrides)
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
            f = fields.get(name)
            if f is not None:
                found = _field_problems(full, node[name], f)
                problems.extend(found or _unread_problems(cfg, full, node[name], f))

    walk(cfg, "")
    return problems


def _unread_problems(cfg: DictConfig, full: str, value, f: dataclasses.Field) -> list[Problem]:
    """A key set (away from its default) where the config never reads it: the user meant a run this is not."""
    when = f.metadata.get("read_when")
    if not when:
        return []
    default = _default(f)
    other, wanted = when
    actual = OmegaConf.select(cfg, other)
    plain = OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value
    if plain == default or actual in wanted:
        return []
    shown = " or ".join(str(w).lower() if isinstance(w, bool) else str(w) for w in wanted)
    now = str(actual).lower() if isinstance(actual, bool) else actual
    choose = other.rsplit(".", 1)[0] if other.endswith(".name") else other  # data=synthetic, not data.name=...
    return [Problem(full, value, f"{full} is read only when {other}={shown}; with {other}={now} it would do nothing",
                    f"{choose}={shown.split(' or ')[0]} for it to apply, or leave {full} unset")]


def _default(f: dataclasses.Field):
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def _field_problems(full: str, value, f: dataclasses.Field) -> list[Problem]:
    meta = f.metadata
    is_list = isinstance(value, (list, ListConfig))
    items = list(value) if is_list else [value]
    if any(isinstance(v, float) and not math.isfinite(v) for v in items):
        return [Problem(full, value, f"{full} must be a finite number ({meta['help']})", f"{full}={_default(f)}")]
    nested = [v for v in items if isinstance(v, (list, tuple, dict, ListConfig, DictConfig))] if is_list else []
    if nested and f.name != "mix":
        return [Problem(full, value, f"the items of {full} are single values, not lists or mappings "
                        f"({meta['help']})", f"{full}=[a,b] (one level of brackets)")]
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
