"""The fuzz test's cases: every key of the schema and of conf/'s groups, with the boundary values of its type, alone
and in pairs with keys of its own section (tests/test_fuzz.py runs them).

A bad input found later goes into VALUES (or SPECIAL for one key), so that every key of its kind is tried with it,
not only the line that found it."""
from __future__ import annotations

import dataclasses
import itertools
import random
import typing
from dataclasses import dataclass

from orchestrator.config.options import option_using, options_of
from orchestrator.config import schema as S

UNSET = ["${fuzz.nothing}", "${oc.env:FUZZ_UNSET_VARIABLE}", "${oc.nope:1}"]  # interpolations to nothing
# values by kind: 0, -1, huge, NaN, inf, empty, a wrong type, a list for a scalar, a mapping for a scalar
VALUES = {
    int: ["0", "-1", "1", "2", "3", "7", "2147483648", "1000000000000000", "1.5", "abc", "true", "[1,2]", "null"],
    float: ["0", "-1", "1e-12", "0.5", "1", "1e30", "nan", "inf", "-inf", "abc", "[0.1]", "null"],
    bool: ["true", "false", "maybe", "2", "null"],
    str: ["''", "x", "bogus", "/proc/fuzz/x", "hf:/nonexistent", "'a b'", "[x]", "{a: 1}", "null"],
    list: ["[]", "x", "[[1]]", "[x]", "[0]", "[-1]", "[nan]", "[1,2,3]", "null"],
    dict: ["{}", "x", "{x: -1}", "{train: 0}", "null"],
    "mix": ["[]", "[{paths: []}]", "[{paths: [/nonexistent]}]", "[{weight: -1}]", "[{paths: [x], weight: nan}]",
            "[{nope: 1}]", "x"],
}
# keys whose own values matter more than their type's (paths and URIs, the ONNX passes, a checkpoint to start from)
SPECIAL = {
    "runs_dir": ["/proc/fuzz", "''", "/"], "cache_dir": ["/proc/fuzz", "''", "/"],
    "triton.cache_dir": ["/proc/fuzz/inductor", "''"], "tracking.artifact_root": ["/proc/fuzz/art", "''"],
    "tracking.uri": ["''", "x", "sqlite:////proc/fuzz/db"], "tracking.experiment": ["''", "'   '"],
    "train.init_from": ["/nonexistent", "hf:/nonexistent", "''", "hf:"], "transform.passes": ["[nope]", "[]"],
    "data.tokenizer": ["hf:", "bpe", "bytes", "''"], "data.paths": ["[/nonexistent]", "['']", "[/proc]"],
    "hydra.run.dir": ["''", "/proc/fuzz/run"], "hydra.job.name": ["''"],
}
GROUPS = ["model", "parallel", "optimizer", "memory", "precision", "triton", "engine", "data", "cluster", "tracking",
          "tune"]


@dataclass(frozen=True)
class Case:
    overrides: tuple[str, ...]   # the command's overrides (an option chosen first where a key needs it)
    keys: tuple[str, ...]        # the keys fuzzed

    @property
    def id(self) -> str:
        return " ".join(self.overrides)


def _kind(hint) -> object:
    origin = typing.get_origin(hint)
    if origin is typing.Union:  # Optional[X]
        return _kind(next(a for a in typing.get_args(hint) if a is not type(None)))
    if origin in (list, typing.List):
        (item,) = typing.get_args(hint) or (str,)
        return "mix" if dataclasses.is_dataclass(item) else list
    if origin in (dict, typing.Dict):
        return dict
    return hint if hint in (int, float, bool, str) else str


def keys() -> list[tuple[str, tuple[str, ...], object, dataclasses.Field]]:
    """(key, the overrides that choose the option declaring it, its kind, its field) for every key."""
    out = []

    def add(prefix: str, schema: type, choose: tuple[str, ...]) -> None:
        hints = typing.get_type_hints(schema)
        for f in dataclasses.fields(schema):
            if prefix == "" and (f.name in GROUPS or dataclasses.is_dataclass(hints[f.name])):
                continue
            if f.name == "name" and prefix.rstrip(".") in GROUPS and f.metadata.get("choices"):
                continue  # a group's name is its option's (choosing it is the group cases' business); one a
                #           registry decides (model, data, engine) is text a user may set: fuzzed
            out.append((prefix + f.name, choose, _kind(hints[f.name]), f))

    add("", S.Config, ())
    hints = typing.get_type_hints(S.Config)
    for name in ("train", "export", "transform", "aggregate", "plan", "sweep"):
        add(f"{name}.", hints[name], ())
    seen = {k for k, *_ in out}
    for group, schemas in S.GROUP_SCHEMAS.items():
        for schema_name, schema in schemas.items():
            option = _smallest(group, option_using(group, schema_name))
            before = len(out)
            add(f"{group}.", schema, (f"{group}={option}", *context(group, option)))
            out[before:] = [k for k in out[before:] if k[0] not in seen and not seen.add(k[0])]
    for key in ("hydra.run.dir", "hydra.job.name"):
        out.append((key, (), str, None))
    return out


PAIRS_FILE = "fuzz_pairs.jsonl"  # preference pairs test_fuzz.py writes in each case's folder


def context(group: str, option: str) -> tuple[str, ...]:
    """What an option needs beside it to run at all, so that its keys' cases are about the keys: an objective of
    preference pairs, pairs to train on (tests/test_fuzz.py writes PAIRS_FILE)."""
    from plugins.objectives import get_objective
    from plugins.objectives.spec import PAIR

    if group == "objective" and get_objective(option).rows == PAIR:
        return ("data=preference", f"data.paths=[{PAIRS_FILE}]")
    return ()


def _smallest(group: str, option: str) -> str:
    """The tiny option of a schema where there is one (llama_tiny, not llama2_70b or llama_1b, whose sizes this
    machine refuses)."""
    tiny = option.split("_")[0].rstrip("0123456789") + "_tiny"  # llama2_70b, llama3_8b: llama_tiny
    return tiny if tiny in options_of(group) else option


def values_of(key: str, kind, f) -> list[str]:
    values = list(SPECIAL.get(key, [])) + list(VALUES[kind])
    meta = f.metadata if f is not None else {}
    for bound, step in (("min", -1), ("max", 1)):
        b = meta.get(bound)
        if b is not None and kind in (int, float):
            values += [str(b), str(b + step if kind is int else b + step * max(abs(b), 1) * 1e-3)]
    for choice in meta.get("choices", ()) or ():
        values.append(str(choice))
    return list(dict.fromkeys(values + UNSET[:1]))


def group_cases() -> list[Case]:
    cases = []
    for g in GROUPS:
        options = options_of(g)
        for v in [*options, "bogus", f"[{options[0]},{options[-1]}]", "null", "''"]:
            cases.append(Case((f"{g}={v}",), (g,)))
        cases.append(Case((f"~{g}",), (g,)))
    return cases


def single_cases() -> list[Case]:
    cases = []
    for key, choose, kind, f in keys():
        for v in values_of(key, kind, f):
            cases.append(Case((*choose, f"{key}={v}"), (key,)))
    return cases + [Case((f"+{k}={v}",), (k,)) for k in ("fuzz", "train.fuzz") for v in ("1",)] + \
        [Case((f"{k}={v}",), (k.split(".")[0],)) for k, v in (("train", "1"), ("model", "{}"))]


def pair_cases(rng: random.Random, per_section: int) -> list[Case]:
    """Two keys of one section, each with one of its values: the rules between keys (bounds that depend on each
    other, a key that only matters with another)."""
    by_section: dict[str, list] = {}
    for entry in keys():
        by_section.setdefault(entry[0].rsplit(".", 1)[0] if "." in entry[0] else "", []).append(entry)
    cases = []
    for section, entries in sorted(by_section.items()):
        pairs = list(itertools.combinations(entries, 2))
        for (k1, c1, t1, f1), (k2, c2, t2, f2) in rng.sample(pairs, min(per_section, len(pairs))):
            choose = tuple(dict.fromkeys(c1 + c2))
            cases.append(Case((*choose, f"{k1}={rng.choice(values_of(k1, t1, f1))}",
                               f"{k2}={rng.choice(values_of(k2, t2, f2))}"), (k1, k2)))
    return cases


def all_cases(seed: int = 0, pairs_per_section: int = 40) -> list[Case]:
    return group_cases() + single_cases() + pair_cases(random.Random(seed), pairs_per_section)


def sample(n: int, seed: int) -> list[Case]:
    return random.Random(seed).sample(all_cases(seed), n)


# -m sweeps: search spaces of every kind Hydra's grammar has, on keys of each type, under each sweeper, with the
# sweepers' and the sweep's own settings (tests/test_fuzz.py checks them as `on_multirun_start` does)
SPACES = ["1,2", "choice(1,2)", "range(1,3)", "range(3,1)", "range(0,100000)", "shuffle(range(1,3))", "choice()",
          "interval(0.1,0.5)", "interval(0.5,0.1)", "tag(log,interval(0,1))", "tag(int,interval(1,4))", "x,y", "1,abc",
          "range(0,10,0)", "glob(*)"]
SWEPT = ["train.seed", "optimizer.lr", "train.batch_size", "parallel.dp", "data.val_fraction", "train.steps"]
SWEEPERS = [(), ("hydra/sweeper=optuna", "hydra.sweeper.n_trials=2"),
            ("hydra/sweeper=optuna", "hydra/sweeper/sampler=grid"),
            ("hydra/sweeper=optuna", "hydra/sweeper/sampler=random")]
SETTINGS = ["hydra.sweeper.n_trials=0", "hydra.sweeper.n_jobs=0", "hydra.sweeper.sampler.seed=-1",
            "hydra.sweeper.sampler.seed=7", "hydra.sweeper.direction=maximize", "hydra.sweeper.study_name=fuzz",
            "sweep.parallelism=4", "sweep.max_points=1", "sweep.max_points=0", "cluster=debug", "tracking=none",
            "hydra.sweeper.storage=sqlite:///x.db", "sweep.objective=tokens_per_s", "hydra.sweeper.direction=up",
            "hydra.sweeper.study_name=../x", "+hydra.launcher.fuzz=1", "+hydra.sweeper.fuzz=1",
            # points that collide (one folder for all) and a return the sweeper cannot take (two objectives)
            "hydra.sweep.subdir=same", "hydra.sweep.subdir=${optimizer.lr}",
            "hydra.sweeper.direction=[minimize,maximize]"]


def sweep_cases(seed: int = 0, n: int = 200) -> list[Case]:
    """A swept key with a space, under a sweeper, with one setting (keys: what a refusal must name)."""
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        key, space, sweeper, setting = (rng.choice(SWEPT), rng.choice(SPACES), rng.choice(SWEEPERS),
                                        rng.choice(SETTINGS))
        if setting.lstrip("+").startswith("hydra.sweeper.") and not sweeper:
            setting = "sweep.parallelism=2"  # the basic sweeper has no sampler (Hydra refuses the key itself)
        cases.append(Case((*sweeper, f"{key}={space}", setting),
                          (key, setting.split("=")[0].lstrip("+"), "hydra.sweeper", "hydra.sweep", "sweep",
                           "cluster")))
    return list({c.id: c for c in cases}.values())
