"""Values the schema cannot check field by field: interpolations that resolve to nothing (an `${oc.env:VAR}` of an
unset variable, a key that does not exist, a key that refers to itself), `???` left by `~group`, and a list given to
a config group. validate() runs these first: a value that cannot be read cannot be checked."""
from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import (InterpolationKeyError, InterpolationResolutionError, MissingMandatoryValue,
                              OmegaConfBaseException, UnsupportedInterpolationType)

from common.problem import Problem


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
        known = sorted(n for n in ("oc.env", "oc.select", "oc.decode", "oc.create", "oc.deprecated", "now",
                                   "hydra") if OmegaConf.has_resolver(n))
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


def group_lists(overrides: list[str]) -> list[Problem]:
    """`model=[a,b]` is legal in Hydra (both options merged into one config, the last winning), and never what a
    user of this command means: one option per group, or -m to sweep over them."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from orchestrator.config.schema import GROUP_SCHEMAS

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException:  # composition read them, or said why it could not
        return []
    problems = []
    for o in parsed:
        key = o.get_key_element().lstrip("+~")
        if (key in GROUP_SCHEMAS or key == "tune") and isinstance(o.value(), list):
            items = ",".join(str(v) for v in o.value())
            problems.append(Problem(key, f"[{items}]", f"{key} is a config group: a list merges its options into "
                                    "one config (Hydra's rule), the last one's values winning",
                                    f"one option ({key}={o.value()[0] if o.value() else '...'}), or -m {key}={items} "
                                    "to run each"))
    return problems
