"""`python -m orchestrator tune=layout tune.world_size=4`: which layout of these ranks trains this model fastest.

Every (dp, hp, pp) of tune.world_size ranks, with both dp modes where dp > 1, each of tune.pp_schedules with each
of tune.microbatches_per_stage where pp > 1 (1F1B with 2 microbatches per stage unless told), and memory=level1 for
a layout whose estimate does not fit without it, is checked like any run; the valid ones train tune.steps steps
each (tokenize, export and transform come from the cache; a trial stops after train), one after another here, or
all submitted at once and followed together on SLURM. The table ranks them by tune.objective, tune.json and
tune.png keep it, MLflow holds a tune run with every trial below it, and the last line is the command that trains
with the winner. A trial is an ordinary cached stage: a second tune of the same model takes every trial from the
cache.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from orchestrator.cache.store import Cache
from orchestrator.config.command import kept_beside_tune, tune_problems
from orchestrator.config.errors import ConfigError, Problem
from orchestrator.config.schema import TuneConfig
from orchestrator.config.resolve import with_tokenizer
from orchestrator.config.validate import validate
from plugins.parallel.schedules import SCHEDULES
from orchestrator.report import console, styled
from orchestrator.run import orchestrate
from storage.fsio import atomic_write_json, read_json

TRIAL_KEYS = ("parallel.dp", "parallel.hp", "parallel.pp", "parallel.dp_mode", "parallel.pp_schedule",
              "parallel.pp_chunks", "parallel.microbatches", "memory.level")


@dataclass
class Trial:
    settings: dict
    status: str = "planned"          # ran | cached | refused | failed
    why: str = ""
    tokens_per_s: Optional[float] = None
    peak_memory_mb: Optional[float] = None
    estimate_mb: Optional[float] = None
    run_dir: Optional[str] = None
    extra: dict = field(default_factory=dict)
    refused_by: list = field(default_factory=list, repr=False)  # the rules' problems (not kept in tune.json)

    @property
    def label(self) -> str:
        s = self.settings
        text = f"dp{s['parallel.dp']} hp{s['parallel.hp']} pp{s['parallel.pp']}"
        if s["parallel.dp"] > 1:
            text += f" {s['parallel.dp_mode']}"
        if s["parallel.pp"] > 1:
            text += f" {s['parallel.pp_schedule']} m{s['parallel.microbatches']}"
        if s["memory.level"]:
            text += f" level{s['memory.level']}"
        return text

    @property
    def overrides(self) -> list[str]:
        return [f"{k}={v}" for k, v in self.settings.items()]


NEAREST = 6  # numbers of ranks tried, nearest first, for one whose layouts fit (each is checked like a run)
CHUNKED = {name for name, s in SCHEDULES.items() if s.multi_chunk}  # given two model chunks per rank


def candidates(world: int, schedules=("1f1b",), per_stage=(2,)) -> list[dict]:
    """The layouts of `world` ranks: every dp*hp*pp factorisation, both dp modes, and for pipelines each schedule
    with each number of microbatches per stage."""
    found = []
    for pp in range(1, world + 1):
        for hp in range(1, world // pp + 1):
            if world % (pp * hp):
                continue
            dp = world // (pp * hp)
            pipelines = [(s, 2 if s in CHUNKED else 1, m * pp) for s in schedules for m in per_stage] if pp > 1 \
                else [("1f1b", 1, 1)]
            for mode in (("replicate", "shard") if dp > 1 else ("replicate",)):
                for schedule, chunks, microbatches in pipelines:
                    found.append({"parallel.dp": dp, "parallel.hp": hp, "parallel.pp": pp, "parallel.dp_mode": mode,
                                  "parallel.pp_schedule": schedule, "parallel.pp_chunks": chunks,
                                  "parallel.microbatches": microbatches, "memory.level": 0})
    return found


def _trial_cfg(cfg: DictConfig, settings: dict) -> DictConfig:
    trial = copy.deepcopy(cfg)
    for key, value in settings.items():
        section, name = key.split(".")
        trial[section][name] = value
    trial.train.steps, trial.train.epochs = cfg.tune.steps, 0  # a trial is timed over tune.steps, epochs or not
    trial.train.eval_every = 0
    trial.train.checkpoint_every = 0
    trial.tune = OmegaConf.structured(TuneConfig)  # a trial is a plain run: tune's own keys do not apply to it
    return trial


def _check(cfg: DictConfig, trial: Trial) -> Optional[DictConfig]:
    """The trial's config (its settings and estimate filled in), or None with trial.why said (a layout rule, or
    memory even with recomputation)."""
    for level in (0, 1):
        settings = {**trial.settings, "memory.level": level}
        trial_cfg = _trial_cfg(cfg, settings)
        try:
            planned = validate(with_tokenizer(trial_cfg)).plan  # the trial's plan: its estimate below
        except ConfigError as e:
            if level == 0 and all(p.key == "parallel" and "exceeds" in p.rule for p in e.problems):
                continue  # does not fit: try it with recomputation
            trial.why = "; ".join(f"{p.key}: {p.rule}" for p in e.problems)[:300]
            trial.refused_by = e.problems
            return None
        trial.settings = settings
        trial.estimate_mb = planned.rank.total / 2**20
        return trial_cfg
    trial.why = "does not fit, even with memory=level1"
    return None


def _layouts(cfg: DictConfig, world: int) -> list[dict]:
    return candidates(world, cfg.tune.pp_schedules, cfg.tune.microbatches_per_stage)


def layout_problems(cfg: DictConfig) -> list[Problem]:
    """[] where a layout of tune.world_size ranks can run (the first that can ends the search), else why not and
    what would (the command's check, before Hydra writes anything)."""
    trials = [Trial(s) for s in _layouts(cfg, cfg.tune.world_size)]
    return [] if any(_check(cfg, t) is not None for t in trials) else _none_fit(cfg, trials)


def _none_fit(cfg: DictConfig, trials: list[Trial]) -> list[Problem]:
    """Why no layout of tune.world_size ranks can run, and the nearest number of ranks with layouts that can (a
    tune that only refuses every trial would say so after its table, exit 1). Where one rank cannot run either, the
    config itself is at fault: its own problems, from the one-rank run's rules."""
    world = cfg.tune.world_size
    one = Trial(_layouts(cfg, 1)[0])
    if _check(cfg, one) is None:
        return one.refused_by
    whys: dict[str, list[str]] = {}
    for t in trials:
        whys.setdefault(t.why, []).append(t.label)
    said = "; ".join(f"{', '.join(labels)}: {why}" for why, labels in whys.items())
    n, fit = 1, [one.label]  # one rank fits (checked above): the answer where no nearer number does
    for m in sorted(range(1, 2 * world + 1), key=lambda m: (abs(m - world), m))[1:NEAREST + 1]:
        found = fit if m == 1 else [t.label for t in map(Trial, _layouts(cfg, m)) if _check(cfg, t) is not None]
        if found:
            n, fit = m, found
            break
    return [Problem("tune.world_size", world, f"no layout of {world} rank(s) can run this config ({said})",
                    f"tune.world_size={n}, whose layouts {', '.join(fit)} fit; or change what the reasons above "
                    "name")]


def tune(cfg: DictConfig, run_dir: Path, overrides: list[str]) -> int:
    t0 = time.perf_counter()
    problems = tune_problems(cfg, overrides)
    if problems:
        raise ConfigError(problems)
    world = cfg.tune.world_size
    trials = [Trial(s) for s in _layouts(cfg, world)]
    checked = [_check(cfg, trial) for trial in trials]  # every trial's rules before any runs
    if all(c is None for c in checked):
        raise ConfigError(_none_fit(cfg, trials))
    if cfg.data.preview:  # the records are the same under every layout: shown once, as the first trial sees them
        from orchestrator.config.resolve import resolve_auto
        from orchestrator.run_plan import data_preview

        first = next(c for c in checked if c is not None)
        resolve_auto(first)  # data.tokenizer=auto and the like, as the trial's plan would fill them in
        for line in data_preview(first):
            console.print(line, soft_wrap=True)
        console.print(f"data.preview={cfg.data.preview}: nothing was started", soft_wrap=True)
        return 0
    console.print(f"tune: {len(trials)} layouts of {world} rank(s) for {cfg.model.name} "
                  f"({cfg.tune.steps} steps each, ranked by {cfg.tune.objective})", soft_wrap=True)
    parent = None if cfg.dry_run else _start_tune_run(cfg, run_dir)  # a dry run records nothing
    cache = Cache(Path(cfg.cache_dir).resolve())
    on_slurm = cfg.cluster.name == "slurm"
    reports = {}
    for i, (trial, trial_cfg) in enumerate(zip(trials, checked)):
        if trial_cfg is None:
            trial.status = "refused"
            continue
        console.rule(f"trial {i + 1}/{len(trials)}: {trial.label}")
        trial_dir = run_dir / "trials" / trial.label.replace(" ", "_")
        trial.run_dir = str(trial_dir)
        # locally one after another (timed alone); on SLURM all submitted, then followed together
        reports[i] = orchestrate(trial_cfg, trial_dir, [*kept_beside_tune(overrides), *trial.overrides], parent,
                                 follow_jobs=not on_slurm, until="train")
    if cfg.dry_run:  # each trial's plan printed; nothing ran, so nothing is ranked
        console.print(f"dry run: {len(reports)} of {len(trials)} layouts planned, nothing was started", soft_wrap=True)
        return 0
    if on_slurm:
        _follow_trials(trials, reports)
    for i, report in reports.items():
        _record(trials[i], report, cache)
    ranked = _rank(trials, cfg.tune.objective)
    seconds = time.perf_counter() - t0
    _report(cfg, ranked, trials, run_dir, overrides, seconds, parent)
    return 0 if ranked else 1


def _follow_trials(trials: list[Trial], reports: dict) -> None:
    from orchestrator.cluster.follow import follow

    submitted = [i for i, r in reports.items() if r.submitted and (Path(trials[i].run_dir) / "slurm_jobs.json").is_file()]
    for i, report in zip(submitted, follow([Path(trials[i].run_dir) for i in submitted])):
        reports[i] = report


def _record(trial: Trial, report, cache: Cache) -> None:
    result = report.results.get("train")
    if result is None or result.status not in ("ran", "cached"):
        trial.status, trial.why = "failed", ((result.error or result.status)[-300:] if result else "not run")
        return
    summary = read_json(cache.entry("train", result.key) / "summary.json")
    trial.status, trial.tokens_per_s = result.status, summary["tokens_per_s"]
    trial.peak_memory_mb = summary.get("peak_memory_growth_mb") or summary.get("peak_memory_mb")


def _rank(trials: list[Trial], objective: str) -> list[Trial]:
    done = [t for t in trials if t.status in ("ran", "cached") and t.tokens_per_s]
    if objective == "memory":
        return sorted(done, key=lambda t: t.peak_memory_mb or float("inf"))
    return sorted(done, key=lambda t: -t.tokens_per_s)


def winner_command(best: Trial, overrides: list[str]) -> str:
    return " ".join(["python -m orchestrator", *kept_beside_tune(overrides), *best.overrides])


def _report(cfg, ranked: list[Trial], trials: list[Trial], run_dir: Path, overrides: list[str], seconds: float,
            parent: Optional[str]) -> None:
    from rich.table import Table

    table = Table(title=f"tune: {len(ranked)} of {len(trials)} layouts ran, {seconds:.0f} s", title_justify="left")
    for col in ("#", "layout", "tokens/s", "peak MB", "estimate MB", "status"):
        table.add_column(col, overflow="fold")
    for i, t in enumerate(ranked + [t for t in trials if t not in ranked]):
        rank = str(i + 1) if t in ranked else "-"
        table.add_row(rank, t.label, f"{t.tokens_per_s:,.0f}" if t.tokens_per_s else "-",
                      f"{t.peak_memory_mb:,.0f}" if t.peak_memory_mb else "-",
                      f"{t.estimate_mb:,.0f}" if t.estimate_mb else "-",
                      styled(t.status, "green" if t in ranked else "yellow") if not t.why else
                      f"{t.status}: {t.why}")
    console.print(table)
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {"objective": cfg.tune.objective, "world_size": cfg.tune.world_size, "steps": cfg.tune.steps,
              "wall_s": seconds, "trials": [{**_kept(t), "label": t.label} for t in trials],
              "ranking": [t.label for t in ranked]}
    if ranked:
        record["command"] = winner_command(ranked[0], overrides)
    atomic_write_json(run_dir / "tune.json", record)
    chart = _chart(ranked, run_dir / "tune.png", cfg.tune.objective)
    if parent:
        from orchestrator.tracking.tracker import _client

        client = _client(cfg.tracking.uri)
        client.log_artifact(parent, str(run_dir / "tune.json"))
        if chart:
            client.log_artifact(parent, str(chart))
        client.set_terminated(parent, "FINISHED" if ranked else "FAILED")
    if ranked:
        console.print(f"the fastest layout: {ranked[0].label}; train with it:", soft_wrap=True)
        console.print(record["command"], soft_wrap=True)
    else:
        console.print("no layout ran: see the statuses above", soft_wrap=True)


def _kept(trial: Trial) -> dict:
    """A trial as tune.json keeps it: its rules' problems are said in its `why`."""
    return {k: v for k, v in trial.__dict__.items() if k != "refused_by"}


def _chart(ranked: list[Trial], path: Path, objective: str) -> Optional[Path]:
    if not ranked:
        return None
    from common.figures import plt

    values = [t.tokens_per_s if objective == "tokens_per_s" else t.peak_memory_mb or 0 for t in ranked]
    fig, ax = plt.subplots(figsize=(7, 0.4 * len(ranked) + 1.2), dpi=100)
    ax.barh([t.label for t in ranked][::-1], values[::-1], color="tab:blue")
    ax.set_xlabel("tokens/s" if objective == "tokens_per_s" else "peak MB per rank")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _start_tune_run(cfg: DictConfig, run_dir: Path) -> Optional[str]:
    if cfg.tracking.name != "mlflow":
        return None
    from orchestrator.tracking.tracker import Invocation

    inv = Invocation(cfg, f"tune {cfg.model.name} x{cfg.tune.world_size}",
                     {"orchestrator.kind": "tune", "orchestrator.run_dir": str(run_dir)}, log_config=False)
    return inv.parent
