"""Fuzz the command: every key of the schema and of conf/'s groups with boundary values of its type, alone and in
pairs (tests/fuzz_cases.py). Each case must be accepted (its plan made, as a dry run makes it) or refused with the
key named, a rule and a fix, and nothing written; never a traceback, a hang, or a cache entry before a refusal.

CI runs a fixed sample of the cases, seeded; `FUZZ=all pytest tests/test_fuzz.py -n 2 --dist load` walks them
all (both workers), and `FUZZ_REPORT=<file>` writes each case's outcome there (exit status, key named, case).
In-process, through the same boundary as `python -m orchestrator` (orchestrator/boundary.py);
tests/test_bad_inputs.py runs the real command."""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from orchestrator.boundary import Refused, check_run
from orchestrator.config.command import experiment, explain, task_overrides
from orchestrator.config.schema import register
from tests.conftest import CONF
from tests.fuzz_cases import PAIRS_FILE, all_cases, sample, sweep_cases

SAMPLE = 120  # cases per CI run (about 70 s on one worker: --dist loadfile keeps a file on one)
SEED = 20261125
CASES = all_cases(SEED) if os.environ.get("FUZZ") == "all" else sample(SAMPLE, SEED)
CASE_SECONDS = 60  # a case that takes longer hangs
SWEEPS = sweep_cases(SEED) if os.environ.get("FUZZ") == "all" else sweep_cases(SEED)[:12]


def outcome(overrides: list[str], where: Path) -> tuple[int, list]:
    """(exit status, problems) of `python -m orchestrator <overrides> dry_run=true`, in process."""
    def run() -> None:
        from orchestrator.run import orchestrate

        with initialize_config_dir(config_dir=str(CONF), version_base="1.3", job_name="orchestrator"):
            quiet = [] if any(o.lstrip("+~").startswith("tracking") for o in overrides) else ["tracking=none"]
            config = compose(config_name="config", overrides=[*overrides, "dry_run=true", *quiet],
                             return_hydra_config=True)
        check_run(config)
        cfg = experiment(config)
        if cfg.tune.name == "none":
            orchestrate(cfg, where / "run", task_overrides(config.hydra))

    return _status(run, overrides)


def sweep_outcome(overrides: list[str]) -> tuple[int, list]:
    """(exit status, problems) of `python -m orchestrator -m <overrides>` up to its first point, in process: the
    sweep's check, as Hydra's on_multirun_start runs it (orchestrator/boundary.py)."""
    def run() -> None:
        from hydra.core.plugins import Plugins
        from hydra.types import RunMode
        from hydra_plugins.orchestrator_launcher.orchestrator_study import store

        from orchestrator.boundary import Precheck

        Plugins.instance()
        store()  # the Optuna sweeper whose study is kept, as python -m orchestrator stores it
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3", job_name="orchestrator"):
            config = GlobalHydra.instance().hydra.compose_config("config", [*overrides, "dry_run=true"],
                                                                 run_mode=RunMode.MULTIRUN,
                                                                 with_log_configuration=False)
            Precheck().on_multirun_start(config)

    return _status(run, overrides)


def _status(run, overrides: list[str]) -> tuple[int, list]:
    """run() as the command runs it: 0, or 2 with the problems of its refusal (Hydra's errors translated); any other
    exception is raised (a traceback the user would see). Over CASE_SECONDS it is a hang."""
    register()
    GlobalHydra.instance().clear()
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(CASE_SECONDS)
    try:
        run()
    except Refused as r:
        return 2, r.error.problems
    except Exception as e:
        translated = explain(e, tuple(overrides))
        if translated is None:
            raise
        return 2, translated.problems
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return 0, []


def _related(problem, keys: tuple[str, ...]) -> bool:
    """The refusal is about what was fuzzed: the key itself, a part of it, or a rule that names it."""
    words = f"{problem.rule} {problem.fix}"
    return any(problem.key == k or problem.key.startswith(k + ".") or problem.key.startswith(k + "[") or
               k.startswith(problem.key + ".") or k in words or k.rsplit(".", 1)[-1] in problem.key
               for k in keys)


class Hang(BaseException):
    """Not an Exception: the checks' guard turns those into refusals, and a hang must fail the case."""


def _alarm(signum, frame):
    raise Hang(f"a case took over {CASE_SECONDS} s")


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_fuzzed_command_is_accepted_or_refused_naming_the_key(case, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default runs_dir (runs) and any relative path land here
    if any(o.endswith(f"[{PAIRS_FILE}]") for o in case.overrides):  # an objective of pairs: pairs to read
        pair = {"prompt": "What is 2 + 3? ", "chosen": "5.", "rejected": "6."}
        (tmp_path / PAIRS_FILE).write_text((json.dumps(pair) + "\n") * 400)
    code, problems = outcome(list(case.overrides), tmp_path)
    if os.environ.get("FUZZ_REPORT"):  # the figures of a walk: one line per case (appends of a line are atomic)
        with open(os.environ["FUZZ_REPORT"], "a") as f:
            f.write(f"{code}\t{problems[0].key if code == 2 else ''}\t{case.id}\n")
    _accepted_or_refused_naming(case, code, problems)
    assert code == 0 or not (tmp_path / "runs" / "cache").exists(), "a cache entry was written before the refusal"
    _the_fix_holds(case, code, problems, tmp_path)


@pytest.mark.parametrize("case", SWEEPS, ids=[c.id for c in SWEEPS])
def test_a_fuzzed_sweep_is_checked_whole_or_refused_naming_the_key(case, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _accepted_or_refused_naming(case, *sweep_outcome(list(case.overrides)))
    assert not (tmp_path / "runs").exists(), "the check wrote before the first point"


def _the_fix_holds(case, code: int, problems: list, tmp_path) -> None:
    """Every fix fixes: the first key=value the refusal about the fuzzed key offers (tests/fix_overrides.py), applied
    to the case, and the same refusal does not come back (as the catalogue's are, tests/test_bad_inputs.py)."""
    from tests.fix_overrides import applied, first_fix, not_fixed
    from tests.test_bad_inputs import ROOTS

    about = next((p for p in problems if _related(p, case.keys)), None) if code == 2 else None
    fix = first_fix(list(case.overrides), about.fix, ROOTS) if about is not None else None
    if fix is None or any(key == "dry_run" for key, *_ in fix):  # the case stays a dry run (outcome adds one)
        return
    fixed = applied(list(case.overrides), fix)
    again, found = outcome(fixed, tmp_path / "fixed")
    back = not_fixed(about, fix, found) if again == 2 else []
    assert not back, f"{fixed}: the fix {about.fix!r} does not hold: " + "; ".join(map(str, back))


def _accepted_or_refused_naming(case, code: int, problems: list) -> None:
    assert code in (0, 2), f"{case.id}: {problems}"
    if code == 2:
        assert problems and all(p.key and p.rule and p.fix for p in problems), problems
        assert any(_related(p, case.keys) for p in problems), "\n".join(map(str, problems))


@pytest.mark.parametrize("args,key", [
    (["optimizer.lr=1e-3,3e-4", "hydra.sweep.subdir=same"], "hydra.sweep.subdir"),  # one folder, two points
    (["train.seed=1,2", "hydra.sweep.subdir=${optimizer.lr}"], "hydra.sweep.subdir"),  # differs by an unswept key
    (["hydra/sweeper=optuna", "hydra.sweeper.direction=[minimize,maximize]", "optimizer.lr=interval(1e-4,1e-3)"],
     "hydra.sweeper.direction"),  # two objectives asked of points that return one
])
def test_a_sweep_whose_points_collide_or_cannot_return_is_refused_whole(args, key, tmp_path, monkeypatch):
    """Checked as the command checks a sweep before its first point (in process: sweep_outcome)."""
    monkeypatch.chdir(tmp_path)
    code, found = sweep_outcome(args)
    assert code == 2 and found[0].key == key and found[0].fix, found
    assert not (tmp_path / "runs").exists()
    assert sweep_outcome(["optimizer.lr=1e-3,3e-4", "hydra.sweep.subdir=${optimizer.lr}"])[0] == 0
