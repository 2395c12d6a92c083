"""An experiment of phases (SFT, then DPO, then a score), declared once under `phases:` in an experiment config
(conf/experiment/sft_dpo.yaml) and composed here into one config per phase, before anything is checked or run.

A phase is a subtree of overrides on the experiment's config, in the config's own shape: `choices` picks config group
options (`choices: {objective: dpo}` is the command line's `objective=dpo`), every other key sets a value
(`objective: {beta: 0.1}` is `objective.beta=0.1`). The command's overrides hold for every phase; a phase's win over
them. A sweep reaches a phase's key by its path: `-m phases.dpo.objective.beta=0.1,0.5`.

`train.init_from=phase:<name>` starts a phase from an earlier phase's model: that phase's aggregate `hf/` folder,
named by the aggregate's key (orchestrator/dag.py keys) before it exists. So the whole experiment is checked and
planned before its first stage runs, and a later phase's keys follow from the earlier phase's (storage/init_from.py
fingerprints a folder in a cache entry by the entry): a change to the DPO phase reruns DPO alone, a change to SFT
reruns both. The start's files are not there to check yet: its model is checked against that phase's (check_phases).
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from orchestrator.config.errors import ConfigError, Problem, from_hydra, unknown_key_problem
from common.problem import _show

PREFIX = "phase:"     # train.init_from=phase:<name>
CHOICES = "choices"   # a phase's config group options
NAME = re.compile(r"[a-z][a-z0-9_]*")  # a phase's name: its run folder and its stages' names (sft/train)


@dataclass
class Phase:
    name: str
    cfg: DictConfig               # the phase's whole config, its start made concrete (auto values left to the run)
    overrides: list[str]          # the command's and the phase's, as one command would give them
    start: Optional[str] = None   # the earlier phase it starts from
    sets: frozenset = frozenset()  # the config paths the phase sets itself (its choices' groups among them)
    waiting: bool = False         # its start's phase was refused: it is checked once that one is fixed


# What the experiment as a whole runs with, which no phase may set: where it runs and is kept, what the command does
RUN_KEYS = ("cluster", "tracking", "tune", "sweep", "dry_run", "data.preview", "runs_dir", "cache_dir",
            "cache_verify", "phases")


def has_phases(cfg: DictConfig) -> bool:
    return bool(OmegaConf.select(cfg, "phases"))


def compose(cfg: DictConfig, overrides: list[str]) -> list[Phase]:
    """Each phase's config, in the order declared; ConfigError with every problem of the declaration."""
    from orchestrator.config.resolve import resolve_auto
    from orchestrator.dag import keys
    from stages import all_stages

    phases, problems, models = [], [], {}
    declared = [str(name) for name in cfg.phases.keys()]
    for i, (name, tree) in enumerate(cfg.phases.items()):
        phase, found = _phase(cfg, str(name), tree, overrides, declared[:i])
        problems += found
        if phase is None:
            continue
        if phase.start in models:
            problems += _start(phase, *models[phase.start])
        elif phase.start is not None:  # its start's phase was refused above: this one is checked once that is fixed
            phase.waiting = True
        resolved = copy.deepcopy(phase.cfg)
        try:
            resolve_auto(resolved)  # the keys of the runs' resolved configs: what a later phase starts from
            models[phase.name] = (resolved, keys(resolved, all_stages()))
        except Exception:  # noqa: BLE001 (what is wrong with it is this phase's check's to say, in its terms)
            pass
        phases.append(phase)
    if problems:
        raise ConfigError(problems)
    _objective_read_once(phases)
    return phases


def _objective_read_once(phases: list[Phase]) -> None:
    """sweep.objective is the experiment's: read from the last phase that scores (a task's metric) or trains (a
    train stage's measure), as ExperimentReport reads it; the other phases are not checked against it."""
    from orchestrator.config.schema import SweepConfig

    wanted = phases[-1].cfg.sweep.objective if phases else None
    if wanted is None:
        return
    reads = [p for p in phases if (p.cfg.evaluate.tasks if "/" in wanted else trains(p.cfg))]
    for p in phases:
        if not reads or p is not reads[-1]:
            p.cfg.sweep.objective = SweepConfig().objective


def trains(cfg: DictConfig) -> bool:
    """A phase that takes optimizer steps (not a step-0 phase, which saves and scores its start)."""
    return cfg.train.steps != 0 or bool(OmegaConf.select(cfg, "train.epochs"))


def _phase(cfg: DictConfig, name: str, tree: Any, overrides: list[str], earlier: list[str]
           ) -> tuple[Optional[Phase], list[Problem]]:
    """One phase composed: the command's config with the phase's choices, then its values."""
    from orchestrator.config.schema import GROUP_SCHEMAS

    where = f"phases.{name}"
    if not NAME.fullmatch(name):
        return None, [Problem(where, name, "a phase's name names its run folder and its stages (sft/train): lower "
                              "case letters, digits and _, starting with a letter",
                              f"rename it: phases.{_name_like(name)}")]
    if tree is not None and not isinstance(tree, DictConfig):
        return None, [Problem(where, tree, "a phase is a subtree of overrides in the config's own shape",
                              f"{where}: {{{CHOICES}: {{objective: dpo}}, objective: {{beta: 0.1}}}}")]
    values = OmegaConf.to_container(tree, resolve=False) if tree is not None else {}
    choices = values.pop(CHOICES, None) or {}
    bad = [g for g in choices if g not in GROUP_SCHEMAS]
    if not isinstance(choices, dict) or bad:
        return None, [Problem(f"{where}.{CHOICES}", _override(choices), "a phase's choices pick an option of a "
                              f"config group: {', '.join(GROUP_SCHEMAS)}", f"{where}.{CHOICES}: {{objective: dpo, "
                              "data: preference}")]
    chosen = [f"{g}={_override(o)}" for g, o in choices.items()]
    leaves = _leaves(values)
    problems = _overridden(name, overrides, {**{g: f"{CHOICES}.{g}" for g in choices}, **{p: p for p, _ in leaves}})
    run_level = [(f"{CHOICES}.{g}", g, o) for g, o in choices.items() if g in RUN_KEYS] + \
        [(p, p, v) for p, v in leaves if any(p == k or p.startswith(k + ".") for k in RUN_KEYS)]
    if run_level:
        return None, [Problem(f"{where}.{path}", _override(v), f"{key} is the experiment's: every phase runs with it "
                              "(where the stages run and are kept, what the command does)", f"{key}={_override(v)} "
                              f"outside the phases (the command line, or the experiment's top level), and "
                              f"~{where}.{path}") for path, key, v in run_level]
    try:
        composed = _compose_with([*(o for o in overrides if _key(o) not in choices), *chosen])
    except Exception as e:  # noqa: BLE001 (Hydra's words for a missing option, said as this phase's key)
        said = from_hydra(e, tuple(chosen))
        return None, [in_phase(name, p, set(choices)) for p in said.problems] if said else \
            [Problem(f"{where}.{CHOICES}", _override(choices), f"the options cannot be composed: {e}",
                     "an option listed under conf/<group>/ (python -m orchestrator --help)")]
    for path, value in leaves:
        try:
            OmegaConf.update(composed, path, value, merge=True)
        except OmegaConfBaseException as e:
            parent = OmegaConf.select(composed, path.rsplit(".", 1)[0]) if "." in path else composed
            known = OmegaConf.select(composed, path, throw_on_missing=False, default=_ABSENT) is not _ABSENT
            p = unknown_key_problem(path, OmegaConf.get_type(parent), value) if not known else \
                Problem(path, value, f"{type(e).__name__}: {str(e).splitlines()[0]}", "a value of the key's type")
            problems.append(in_phase(name, p, {path}))
    with open_dict(composed):
        composed.phases = {}
    start = OmegaConf.select(composed, "train.init_from")
    if isinstance(start, str) and start.startswith(PREFIX):
        start = start[len(PREFIX):]
        if start not in earlier:
            problems.append(Problem(f"{where}.train.init_from", PREFIX + start, f"{PREFIX}<name> starts from the "
                                    f"model of an earlier phase; the phases before {name}: "
                                    f"{', '.join(earlier) or 'none'}",
                                    f"++{where}.train.init_from={PREFIX}{earlier[-1]}" if earlier else
                                    f"move {name} after the phase it starts from, or "
                                    f"++{where}.train.init_from=hf:<a folder>"))
    else:
        start = None
    phase_overrides = [*overrides, *chosen, *(f"{path}={_override(v)}" for path, v in leaves)]
    return Phase(name, composed, phase_overrides, start, frozenset([*choices, *(p for p, _ in leaves)])), problems


_ABSENT = object()


def _name_like(name: str) -> str:
    """A phase name the rule takes, as close to `name` as it can be."""
    like = re.sub(r"[^a-z0-9_]", "_", name.lower()).lstrip("0123456789_")
    return like or "phase"


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _overridden(name: str, overrides: list[str], set_here: dict[str, str]) -> list[Problem]:
    """The command's overrides of what this phase sets itself: a phase's value wins over the command's, so such an
    override would change nothing in this phase, silently. set_here: config path -> its path in the phase."""
    return [Problem(_key(o), o.split("=", 1)[1] if "=" in o else None, f"phase {name} sets {_key(o)} itself "
                    f"(phases.{name}.{set_here[_key(o)]}), which the command's value would not change",
                    f"++phases.{name}.{set_here[_key(o)]}={o.split('=', 1)[1] if '=' in o else 'null'} in place of "
                    f"{o} (the phase's own value, on the command line)") for o in overrides if _key(o) in set_here]


def _start(phase: Phase, earlier_cfg: DictConfig, earlier_keys: dict[str, str]) -> list[Problem]:
    """The phase's start made concrete: the earlier phase's aggregate hf/ folder, by that stage's key, and its
    tokenizer (the one the earlier phase trained with, which its aggregate ships) where data.tokenizer=auto."""
    from plugins.data.tokenizer import AUTO

    where = f"phases.{phase.name}"
    if "aggregate" not in earlier_keys:
        return [Problem(f"{where}.train.init_from", PREFIX + phase.start, f"phase {phase.start} writes no model "
                        "(it runs no aggregate stage)", f"start {phase.name} from a phase that trains")]
    tokenizer = earlier_cfg.data.tokenizer
    if phase.cfg.data.tokenizer == AUTO and tokenizer == "bpe":
        return [Problem(f"phases.{phase.start}.data.tokenizer", "bpe", f"phase {phase.name} starts from phase "
                        f"{phase.start}'s model, whose BPE is learned on {phase.start}'s corpus only as it runs",
                        f"++phases.{phase.start}.data.tokenizer=hf:<a tokenizer folder> (or bytes)")]
    _start_at(phase, start_folder(Path(earlier_cfg.cache_dir).expanduser().resolve(), earlier_keys["aggregate"]))
    if phase.cfg.data.tokenizer == AUTO:
        phase.cfg.data.tokenizer = tokenizer
    return []


def check(cfg: DictConfig, overrides: list[str]):
    """What the command checks first (orchestrator/boundary.py, a sweep's points): a run as orchestrator/config/
    command.py's check_experiment checks it, or every phase of an experiment so (check_phases). -> the plan(s)."""
    from orchestrator.config.command import check_experiment

    return check_phases(cfg, overrides) if has_phases(cfg) else check_experiment(cfg, overrides)


def start_folder(cache_root: Path, aggregate_key: str) -> Path:
    """The folder a phase's start names: the aggregate's hf/ in the cache entry of that key."""
    return cache_root / "aggregate" / aggregate_key / "hf"


def retarget(phases: list[Phase], planned: Phase, aggregate_key: str, cache_root: Path) -> None:
    """The phases that start from `planned` named by the key its plan gave its aggregate: where it counted
    train.epochs into train.steps as it was planned, the key differs from the one worked out when it was composed."""
    folder = start_folder(cache_root, aggregate_key)
    for p in phases:
        if p.start == planned.name:
            _start_at(p, folder)


def _start_at(phase: Phase, folder: Path) -> None:
    """The phase's train.init_from: the folder its start's aggregate writes, promised to the checks that would
    otherwise look for its files (storage/init_from.py PROMISED)."""
    from storage.init_from import PROMISED

    PROMISED[str(folder)] = f"phase {phase.start}'s aggregate"
    phase.cfg.train.init_from = f"hf:{folder}"


def check_phases(cfg: DictConfig, overrides: list[str]) -> list:
    """Every phase composed and checked as its run will be, its problems said under its own keys; a phase that starts
    from another has that phase's model. -> the phases' plans."""
    from orchestrator.config.command import check_experiment

    if cfg.tune.name != "none":
        raise ConfigError([Problem("tune.name", cfg.tune.name, "tune=layout tunes the layout of one run; an "
                                   "experiment runs several", "tune a phase alone (its choices and values on the "
                                   "command line), then set the layout it chose in the experiment")])
    phases, plans, problems = compose(cfg, overrides), {}, []
    for phase in phases:
        if phase.waiting:
            continue
        try:
            plans[phase.name] = check_experiment(copy.deepcopy(phase.cfg), phase.overrides)
        except ConfigError as e:
            problems += [(phase.name, _rekeyed(phase.name, p, phase.sets)) for p in e.problems]
    for phase in phases:
        if phase.start in plans and phase.name in plans:
            problems += [(None, p) for p in _same_model(phase, plans[phase.start].parameters,
                                                        plans[phase.name].parameters)]
    if problems:
        raise ConfigError(said_once(problems))
    return list(plans.values())


def _same_model(phase: Phase, theirs: dict, ours: dict) -> list[Problem]:
    """The parameters of the phase's model against those of the model it starts from (LoRA's adapters, which one
    side may have and the other not, aside)."""
    names = {n for n in theirs.keys() | ours.keys() if "lora_" not in n}
    differ = sorted(n for n in names if (theirs.get(n) or {}).get("shape") != (ours.get(n) or {}).get("shape"))
    if not differ:
        return []
    n = differ[0]
    return [Problem(f"phases.{phase.name}.model", phase.cfg.model.name, f"phase {phase.name} starts from phase "
                    f"{phase.start}'s model, and its model differs: {len(differ)} parameter(s), e.g. {n}: "
                    f"{(theirs.get(n) or {}).get('shape', 'none')} there, {(ours.get(n) or {}).get('shape', 'none')} "
                    "here", f"the model= and model.* values of "
                    f"phase {phase.start} (set them once, outside the phases)")]


def in_phase(name: str, p: Problem, sets: frozenset | set) -> Problem:
    """A phase's problem, said as the phase's (_rekeyed), the phase named."""
    return _named(_rekeyed(name, p, sets), [name])


def _named(p: Problem, phases: list[str]) -> Problem:
    return Problem(p.key, p.value, f"in phase{'s' if len(phases) > 1 else ''} {', '.join(phases)}: {p.rule}", p.fix)


def _rekeyed(name: str, p: Problem, sets: frozenset | set) -> Problem:
    """A phase's problem under the phase's key where the phase sets it (else the command's or the experiment's key,
    which the phase takes), its fix as the override that sets the value in that phase."""
    from orchestrator.config.schema import GROUP_SCHEMAS

    def here(path: str) -> str:  # where the phase sets it
        return f"phases.{name}.{CHOICES + '.' if path in GROUP_SCHEMAS else ''}{path}"

    key = p.key if p.key.startswith("phases.") else here(p.key) if p.key in sets else p.key
    fix = re.sub(r"(?<![\w.+/~-])([a-z_]+(?:\.[A-Za-z_0-9]+)*)=(?!=)",
                 lambda m: f"++{here(m.group(1))}=" if m.group(1) in sets else m.group(0), p.fix)
    return Problem(key, p.value, p.rule, fix)


def said_once(problems: list[tuple[Optional[str], Problem]]) -> list[Problem]:
    """The same problem of several phases (a key of the experiment's that each reads) said once, naming them;
    problems: (the phase it is in, or None for the experiment's own, the problem)."""
    said: dict[tuple, list] = {}
    for phase, p in problems:
        said.setdefault((p.key, _show(p.value), p.rule, p.fix), []).append(phase)
    return [_named(Problem(key, value, rule, fix), names) if names[0] else Problem(key, value, rule, fix)
            for (key, value, rule, fix), names in said.items()]


def _leaves(values: dict, prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for k, v in values.items():
        path = f"{prefix}{k}"
        out += _leaves(v, path + ".") if isinstance(v, dict) and v else [(path, v)]
    return out


def _override(value: Any) -> str:
    """A value as a command-line override writes it (the phase's recorded overrides, a refusal's value and fix)."""
    if isinstance(value, list):
        return "[" + ",".join(_override(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_override(v)}" for k, v in value.items()) + "}"
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _compose_with(overrides: list[str]) -> DictConfig:
    """The experiment's config composed by Hydra with these overrides, without Hydra's node (in the command's Hydra
    context where there is one, else from conf/)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():  # the command's search path and primary config (--config-name)
        from hydra.core.hydra_config import HydraConfig

        name = HydraConfig.get().job.config_name if HydraConfig.initialized() else "config"
        return compose(config_name=name, overrides=overrides)
    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)
