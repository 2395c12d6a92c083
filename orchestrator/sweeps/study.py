"""`-m hydra/sweeper=optuna`: Hydra's Optuna sweeper with a study that the same command continues.

Hydra's sweeper keeps its study in memory: a sweep stopped by a signal lost its trials, and the same command began a
new study with a new sampler. Optuna's own RDB storage would keep it, but the Optuna that hydra-optuna-sweeper 1.3
allows (2.10) cannot create its tables under SQLAlchemy 2, which MLflow needs (`get_current_version`:
AssertionError, see docs/slurm-and-sweeps.md). So the study is kept here, beside the MLflow store:

  <runs_dir>/studies/<name>.json      its search, and every trial: state, params with their distributions, values
  <runs_dir>/studies/<name>.sampler   the sampler, pickled (as Optuna's FAQ keeps one): its random state goes on

- The name comes from what makes the study: the experiment (without sweep.parallelism), the search space, the
  sampler's settings and the direction. hydra.sweeper.n_trials and n_jobs are not part of it, so a larger n_trials
  continues the study; a changed search space is another study. hydra.sweeper.study_name names it instead.
- The study is saved before each batch of trials is launched (its trials running, the sampler past them), and at the
  end. On a signal, the batch's trials whose points finished are told their values first.
- Loaded again, the trials are as they were. A trial left running was interrupted: it is kept as FAIL (tagged
  `interrupted`) and its params are queued, so the next trial asked takes them and its point resumes from its
  checkpoint; the sampler goes on from its saved state, so the trials after it are the ones an uninterrupted study
  would have run. hydra.sweeper.n_trials counts the study's completed trials, not this command's.
"""
from __future__ import annotations

import functools
import hashlib
import json
import pickle
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf
from rich.table import Table

from orchestrator.report import console
from orchestrator.sweeps.launcher import InvalidPoint
from orchestrator.sweeps.optuna_compat import directions, plain_lines_off_a_terminal, study_from_saved
from storage.fsio import atomic_write_bytes, atomic_write_json

INTERRUPTED = "interrupted"  # the user attribute of a trial a signal stopped
INVALID = "invalid"  # the user attribute of a trial whose point validation refused (its refusal's rule)
NOT_RUN = "not run"  # the sweep table's word for a point that never started
_UNREAD = object()  # a KeptStudy whose file is not read yet


def search_of(config: DictConfig, arguments: list[str]) -> dict:
    """What makes the study (its name is a digest of this): the experiment as it changes results, the search, the
    sampler, the direction."""
    sweeper = OmegaConf.to_container(config.hydra.sweeper, resolve=False)
    digest = hashlib.sha256(json.dumps(results_of(config), sort_keys=True, default=str).encode()).hexdigest()
    return {"space": sorted(arguments) + sorted(f"{k}={v}" for k, v in (sweeper.get("params") or {}).items()),
            "sampler": sweeper.get("sampler"), "direction": str(sweeper.get("direction")), "experiment": digest}


def results_of(config: DictConfig) -> dict:
    """The experiment as far as it changes what a trial measures: every config section a stage reads, without the
    keys the schema marks content=False (progress bars, logging, where and how many at a time it runs, tracking),
    and the objective the trials return. The cache keys leave out the same keys (orchestrator/dag.py)."""
    from orchestrator.dag import content_view
    from stages import all_stages

    reads = sorted({path for stage in all_stages() for path in stage.reads})
    return {**{path: content_view(OmegaConf.select(config, path)) for path in reads},
            "sweep.objective": config.sweep.objective}


def swept(config: DictConfig) -> list[str]:
    """The command's sweep overrides (`optimizer.lr=interval(...)`): the search space the sweeper will read."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from orchestrator.config.command import task_overrides

    task = task_overrides(config.hydra)
    parsed = OverridesParser.create().parse_overrides(task)
    return [line for line, o in zip(task, parsed) if o.is_sweep_override()]


def study_name(config: DictConfig, search: dict) -> str:
    given = OmegaConf.select(config, "hydra.sweeper.study_name")
    if given:
        return str(given)
    digest = hashlib.sha256(json.dumps(search, sort_keys=True, default=str).encode()).hexdigest()
    return f"study-{digest[:12]}"


@dataclass
class KeptStudy:
    """A study's two files under <runs_dir>/studies (read once, then kept current by save())."""
    folder: Path
    name: str
    search: dict
    _saved: Any = field(default=_UNREAD, repr=False)

    @classmethod
    def of(cls, config: DictConfig) -> "KeptStudy":
        search = search_of(config, swept(config))
        return cls(Path(str(config.hydra.sweeper.study_dir)).resolve(), study_name(config, search), search)

    @property
    def path(self) -> Path:
        return self.folder / f"{self.name}.json"

    def saved(self) -> Optional[dict]:
        """The study as last saved (None: a new one). Its files are written atomically; one that does not read
        (edited by hand, another version's) is refused rather than half-used."""
        if self._saved is not _UNREAD:
            return self._saved
        if not self.path.is_file():
            self._saved = None
            return None
        try:
            saved = json.loads(self.path.read_text())
            if not isinstance(saved, dict) or not isinstance(saved.get("trials"), list):
                raise ValueError("no list of trials")
            if not isinstance(saved.get("search"), dict):
                raise ValueError("no search entry: what the study searched is unknown")
            fields = ("number", "state", "params", "distributions", "user_attrs", "values")
            broken = next((i for i, t in enumerate(saved["trials"])
                           if not isinstance(t, dict) or any(f not in t for f in fields)), None)
            if broken is not None:
                raise ValueError(f"its trial {broken} lacks one of {', '.join(fields)}")
            from optuna.distributions import json_to_distribution

            for t in saved["trials"]:  # what load() rebuilds, read now: a bad one is said here, not mid-sweep
                for name, d in t["distributions"].items():
                    try:
                        json_to_distribution(d)
                    except Exception as e:  # noqa: BLE001 (Optuna raises ValueError, KeyError, JSONDecodeError)
                        raise ValueError(f"trial {t['number']}'s distribution of {name} cannot be read "
                                         f"({type(e).__name__}: {e})") from None
            sampler = self.folder / f"{self.name}.sampler"
            if sampler.is_file():
                try:
                    pickle.loads(sampler.read_bytes())
                except Exception as e:  # noqa: BLE001 (a pickle cut short or of another Optuna)
                    raise ValueError(f"its sampler {sampler} cannot be unpickled ({type(e).__name__}: {e})") \
                        from None
            self._saved = saved
            return saved
        except (OSError, ValueError) as e:
            from orchestrator.config.errors import ConfigError, Problem

            raise ConfigError([Problem("hydra.sweeper.study_dir", str(self.folder), f"the study {self.path} cannot "
                                       f"be read ({e})", "move it aside to start the study again, or "
                                       "hydra.sweeper.study_name=<another name>")]) from None

    def problems(self, config: DictConfig) -> list:
        """What the sweeper would meet later: a storage of Optuna's own, or a study named to continue whose
        search is another."""
        from orchestrator.config.errors import Problem

        storage = OmegaConf.select(config, "hydra.sweeper.storage")
        if storage:
            return [Problem("hydra.sweeper.storage", storage, "Optuna 2.10 (what hydra-optuna-sweeper 1.3 allows) "
                            "cannot create its RDB tables under SQLAlchemy 2, which MLflow needs; the orchestrator "
                            "keeps the study itself", f"leave hydra.sweeper.storage unset: the study is kept in "
                            f"{self.folder} (hydra.sweeper.study_dir)")]
        if self.path.parent != self.folder or self.name in ("", ".", ".."):
            return [Problem("hydra.sweeper.study_name", self.name, f"the study is kept in {self.folder}, and this "
                            f"name would put it at {self.path}", "a name without / (letters, digits, - and _)")]
        saved = self.saved()
        if saved and saved["search"] != self.search:
            changed = [k for k in self.search if saved["search"].get(k) != self.search[k]]
            return [Problem("hydra.sweeper.study_name", self.name, f"the study {self.path} searched another "
                            f"experiment or space (its {', '.join(changed)} differ): its trials would mislead the "
                            f"sampler", "another hydra.sweeper.study_name (or none: each search gets its own "
                            "study), or the same search as before")]
        return []

    def completed(self) -> int:
        """The study's trials done with (what hydra.sweeper.n_trials counts): completed, or refused as invalid."""
        saved = self.saved()
        return sum(t["state"] == "COMPLETE" or INVALID in t["user_attrs"] for t in saved["trials"]) if saved else 0

    def to_run(self, n_trials: int) -> int:
        """The trials this command will run: n_trials less the study's completed ones."""
        return max(0, n_trials - self.completed())

    def describe(self, n_trials: int) -> str:
        """The plan's line on the study: new, or how far it got."""
        saved = self.saved()
        where = f"study {self.name} ({self.path})"
        if saved is None:
            return f"{where}: new, {n_trials} trial(s) (hydra.sweeper.n_trials)"
        running = sum(t["state"] == "RUNNING" for t in saved["trials"])
        stopped = f", {running} interrupted (resumed first)" if running else ""
        return (f"{where}: continued, {self.completed()} of {n_trials} trial(s) done (hydra.sweeper.n_trials "
                f"counts the study's){stopped}, {self.to_run(n_trials)} to run")

    def save(self, study: Any, sampler: Any = None) -> None:
        """The trials (and, when given, the sampler) written atomically: a signal or a full disk leaves the last
        saved state."""
        from optuna.distributions import distribution_to_json

        self.folder.mkdir(parents=True, exist_ok=True)
        if sampler is not None:
            atomic_write_bytes(self.folder / f"{self.name}.sampler", pickle.dumps(sampler))
        self._saved = {"name": self.name, "search": self.search, "trials": [
            {"number": t.number, "state": t.state.name, "values": t.values, "params": t.params,
             "distributions": {k: distribution_to_json(d) for k, d in t.distributions.items()},
             "user_attrs": t.user_attrs, "system_attrs": _plain(t.system_attrs)}
            for t in study.trials if t.state.name != "WAITING"]}
        atomic_write_json(self.path, self._saved)

    def load(self, sampler: Any) -> tuple[Any, Any]:
        """(the storage holding the study as saved, the sampler to go on with)."""
        import optuna

        storage = _KeptStorage(self.path)
        saved = self.saved()
        path = self.folder / f"{self.name}.sampler"
        if saved is None:
            return storage, sampler
        if path.is_file() and not isinstance(sampler, functools.partial):
            sampler = pickle.loads(path.read_bytes())  # a grid (a partial the sweeper completes) keeps none: its
        study = study_from_saved(storage=storage, study_name=self.name,  # trials' grid ids say what is visited
                                 sampler=None if isinstance(sampler, functools.partial) else sampler,
                                 directions=directions(self.search["direction"]))
        again = []
        with warnings.catch_warnings():  # add_trial, create_trial and enqueue_trial are "experimental" in Optuna 2
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            self._add(study, saved["trials"], again)
            for params in again:
                study.enqueue_trial(params)
        return storage, sampler

    @staticmethod
    def _add(study: Any, trials: list[dict], again: list[dict]) -> None:
        from optuna.distributions import json_to_distribution
        from optuna.trial import TrialState, create_trial

        for t in trials:
            distributions = {k: json_to_distribution(d) for k, d in t["distributions"].items()}
            if t["state"] == "RUNNING":  # a signal stopped it: run its params again, first
                study.add_trial(create_trial(state=TrialState.FAIL, params=t["params"], distributions=distributions,
                                             user_attrs={**t["user_attrs"], INTERRUPTED: True}))  # grid: not visited
                again.append(t["params"])
            else:
                study.add_trial(create_trial(state=TrialState[t["state"]], params=t["params"],
                                             distributions=distributions, values=t["values"],
                                             user_attrs=t["user_attrs"], system_attrs=t.get("system_attrs", {})))

    def table(self, points: Optional[dict[int, str]] = None) -> Table:
        """Every trial of the study, this command's and the earlier ones', in order; points: this command's points'
        statuses by trial number (a trial Optuna still holds running whose point never started reads `not run`, as
        in the sweep's table)."""
        points = points or {}
        trials = (self.saved() or {"trials": []})["trials"]
        names = sorted({k for t in trials for k in t["params"]})
        table = Table(title=f"study {self.name}: {len(trials)} trial(s)", title_justify="left")
        for col in ("trial", "state", *names, "value"):
            table.add_column(col)
        for t in trials:
            state = NOT_RUN if t["state"] == "RUNNING" and points.get(t["number"]) == NOT_RUN else \
                INTERRUPTED if t["state"] == "RUNNING" or t["user_attrs"].get(INTERRUPTED) else \
                INVALID if t["user_attrs"].get(INVALID) else t["state"].lower()
            table.add_row(str(t["number"]), state, *(f"{t['params'][n]:.6g}" if isinstance(t["params"].get(n), float)
                                                     else str(t["params"].get(n, "-")) for n in names),
                          ", ".join(f"{v:.6g}" for v in t["values"]) if t["values"] else "-")
        return table


def _plain(attrs: dict) -> dict:
    """A trial's system attributes that JSON keeps (the grid sampler's grid_id and search_space among them: without
    them a continued grid would visit its points again)."""
    return {k: v for k, v in attrs.items() if _json_safe(v)}


def _json_safe(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def _KeptStorage(path: Path) -> Any:
    """Optuna's in-memory storage, named for where it is kept (Hydra's sweeper logs the storage it was given)."""
    from optuna.storages import InMemoryStorage

    class KeptStorage(InMemoryStorage):
        def __str__(self) -> str:
            return f"{path} (kept by the orchestrator)"

    return KeptStorage()


def run_study(sweeper: Any, config: DictConfig, arguments: list[str]) -> None:
    """Run Hydra's Optuna sweep (sweeper: its OptunaSweeperImpl) on the kept study."""
    import optuna

    plain_lines_off_a_terminal()
    kept = KeptStudy.of(config)
    storage, sweeper.sampler = kept.load(sweeper.sampler)
    sweeper.storage, sweeper.study_name = storage, kept.name
    sweeper.n_trials = kept.to_run(sweeper.n_trials)  # n_trials counts the study's trials, not this command's
    sweeper.job_idx = len((kept.saved() or {"trials": []})["trials"])  # point i is the study's trial i
    launcher = sweeper.launcher
    launcher.study_file = kept.path  # its pictures, at the end (orchestrator/sweeps/pictures.py)
    sweeper.launcher = _SavingLauncher(launcher, kept, storage, sweeper)
    Path(str(config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)  # the results file, trials or none
    try:
        sweeper.sweep(arguments)
    except RuntimeError as e:  # the grid's last trial told FAIL: Optuna's GridSampler stops the study outside an
        if "Study.stop" not in str(e) or not sweeper.launcher.rejected:  # objective, and Hydra's sweeper lets
            raise  # that escape where it tells a failure (it guards only the success's tell)
        raise sweeper.launcher.rejected[-1] from None
    except KeyboardInterrupt:  # the finished trials of the batch in flight keep their values
        study = optuna.load_study(study_name=kept.name, storage=storage)
        running = [t for t in study.trials if t.state.name == "RUNNING"]
        for trial, value in zip(running, launcher.finished_values(len(running))):
            if value is not None:
                study.tell(trial.number, value)
        raise
    finally:
        if optuna.study.get_all_study_summaries(storage):
            kept.save(optuna.load_study(study_name=kept.name, storage=storage), sweeper.sampler)
            console.print(kept.table(launcher.statuses()))


class _SavingLauncher:
    """The sweeper's launcher, saving the study before each batch: its trials running, the sampler past them."""

    def __init__(self, launcher: Any, kept: KeptStudy, storage: Any, sweeper: Any):
        self.launcher, self.kept, self.storage, self.sweeper = launcher, kept, storage, sweeper
        self.rejected: list = []  # the invalid points, as the sweeper will raise them

    def launch(self, job_overrides, initial_job_idx: int):
        import optuna

        study = optuna.load_study(study_name=self.kept.name, storage=self.storage)
        self.kept.save(study, self.sweeper.sampler)
        batch = [t for t in study.trials if t.state.name == "RUNNING"]  # asked for these points, in order
        returns = self.launcher.launch(job_overrides, initial_job_idx)
        for trial, ret in zip(batch, returns):
            rejected = getattr(ret, "_return_value", None)
            if isinstance(rejected, InvalidPoint):  # the sweeper tells it FAIL; saved as invalid, never queued again
                self.rejected.append(rejected)
                study._storage.set_trial_user_attr(trial._trial_id, INVALID, "; ".join(p.rule for p in
                                                                                        rejected.problems))
        return returns
