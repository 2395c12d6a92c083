"""Experiment tracking in MLflow: one parent run per invocation, one child run per stage.

The orchestrator creates the store, the experiment and every run before any stage starts (several
processes creating a fresh sqlite store at once break its migrations); a stage's rank 0 then logs into
its own child run by id. `tracking=none` makes no MLflow call at all (MLflow is not even imported).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf


def flatten_params(value: Any, prefix: str = "") -> dict[str, str]:
    """{"model": {"n_layers": 8}} -> {"model.n_layers": "8"}: MLflow params from (parts of) a config."""
    if isinstance(value, dict):
        flat: dict[str, str] = {}
        for k, v in value.items():
            flat.update(flatten_params(v, f"{prefix}.{k}" if prefix else str(k)))
        return flat
    return {prefix: json.dumps(value) if isinstance(value, (list, type(None))) else str(value)}


def config_params(cfg: DictConfig, paths: Optional[tuple[str, ...]] = None) -> dict[str, str]:
    """The resolved config (or the subtrees at `paths`) as MLflow params."""
    if paths is None:
        return flatten_params(OmegaConf.to_container(cfg, resolve=True))
    selected = {p: OmegaConf.select(cfg, p) for p in paths}  # a section, or a single key such as engine.opset
    return flatten_params({p: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
                           for p, v in selected.items()})


def _client(uri: str):
    import mlflow  # imported here: 1-2 s, and only when tracking is on

    logging.getLogger("mlflow").setLevel(logging.WARNING)  # not "Creating initial MLflow database tables..."
    return mlflow.MlflowClient(tracking_uri=uri)


def _new_store_client(uri: str):
    """The client of a store that may not exist yet (the caller holds store_lock): a new sqlite store is a copy of
    an empty one MLflow migrated once (orchestrator/tracking/fresh_store.py), not migrated again."""
    db = sqlite_file(uri)
    if db is not None and not db.exists():
        from orchestrator.tracking.fresh_store import create_from_template

        create_from_template(db)
    return _client(uri)


SQLITE = "sqlite:///"


def sqlite_file(uri: str) -> Optional[Path]:
    """The database file of a sqlite store's URI (relative to the working folder unless it starts with /), else
    None."""
    return Path(uri[len(SQLITE):]) if uri.startswith(SQLITE) else None


def absolute_uri(uri: str) -> str:
    """A sqlite store's URI with its file's absolute path: the default's is relative to the working folder, so the
    same URI printed names another store from another folder."""
    db = sqlite_file(uri)
    return uri if db is None or db.is_absolute() else SQLITE + os.fspath(db.resolve())


def store_lock(uri: str):
    """A file lock beside a sqlite store: two processes creating a fresh store at once break MLflow's schema
    migration ("Online migration expected to match one row")."""
    db = sqlite_file(uri)
    if db is None:
        return contextlib.nullcontext()
    from filelock import FileLock

    db.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(db) + ".lock")


NAME_CHARS = 80  # a parent run's name, as MLflow's run table shows it whole
OVERRIDES_TAG_CHARS = 5000  # the full overrides, as a tag (MLflow stores 8000 characters at most)


def run_name(overrides: list[str]) -> str:
    """A parent run's name: its overrides, each path by its last component, the first of them that fit in
    NAME_CHARS characters and "+N more" for the rest (the full list is the run's `orchestrator.overrides` tag)."""
    parts = [re.sub(r"[^\s,\[\]=:'\"]*/(?=[^/\s,\]'\"]+)", "", o) for o in overrides]
    for shown in range(len(parts), 0, -1):
        name = " ".join(parts[:shown]) + (f" +{len(parts) - shown} more" if shown < len(parts) else "")
        if len(name) <= NAME_CHARS:
            return name
    more = f" +{len(parts) - 1} more" if len(parts) > 1 else ""
    return (parts[0][:NAME_CHARS - len(more) - 1] + "…" + more) if parts else "default"


FAILED_NOTE = "mlflow_failed.txt"  # in the run folder: the store failed during this run (what it said)


class Degradable:
    """Calls into the store that must never stop the work they record: the first failure warns once, and the
    calls after it do nothing (what was to be recorded stays in the run's files). `said_in`: a file of the run
    folder that the first process of the run to warn writes, so that the others (the orchestrator, each stage's
    rank 0) do not warn again."""

    degraded: Optional[str] = None
    said_in: Optional[Path] = None

    def _safely(self, call, *args, **kwargs):
        if self.degraded:
            return None
        try:
            return call(*args, **kwargs)
        except Exception as e:  # the store's failure, not the work's
            said = str(e).split("\n[SQL:", 1)[0].strip().splitlines()  # SQLAlchemy appends the statement
            self.degraded = f"{type(e).__name__}: {said[0] if said else ''}"[:300]
            log = logging.getLogger("orchestrator.tracking.tracker")
            if self.said_in is not None and self.said_in.exists():
                log.debug("MLflow tracking failed here too (%s)", self.degraded)
            else:
                log.warning("MLflow tracking failed (%s); the work goes on without it (the run folder and "
                            "metrics.jsonl keep everything; python -m orchestrator.tracking.resync <run folder> records it "
                            "later)", self.degraded)
                with contextlib.suppress(OSError):
                    if self.said_in is not None:
                        self.said_in.write_text(self.degraded + "\n")
            log.debug("the store's error in full", exc_info=True)
            return None


def log_artifact(client, run_id: str, path: Path, artifact_path: Optional[str], max_bytes: int) -> None:
    path = Path(path)
    if path.stat().st_size > max_bytes:  # large files stay where they are; MLflow records where
        client.set_tag(run_id, f"artifact.{path.name}", str(path.resolve()))
    else:
        client.log_artifact(run_id, str(path), artifact_path)


INVOCATION_TIMES = ("duration_s", "planned_s")  # how long a stage took in the invocation that ran it, not a result


class Invocation(Degradable):
    """The orchestrator's side: the parent run and the stage runs of one `python -m orchestrator`. Creating it
    fails loudly (the store is checked before launch); after that, tracking failures only degrade it."""

    def __init__(self, cfg: DictConfig, run_name: str, tags: dict[str, str], log_config: bool = True):
        tcfg = cfg.tracking
        self.uri = tcfg.uri
        self.max_artifact_bytes = tcfg.max_artifact_mb * 2**20
        if tags.get("orchestrator.run_dir"):
            self.said_in = Path(tags["orchestrator.run_dir"]) / FAILED_NOTE
        with store_lock(self.uri):  # opening a new store creates (migrates) it: one process at a time
            self.client = _new_store_client(self.uri)
            self.experiment_id = self._experiment(tcfg.experiment, Path(tcfg.artifact_root))
        self.parent = self.client.create_run(self.experiment_id, run_name=run_name, tags={
            "orchestrator.kind": "invocation", **tags}).info.run_id
        if log_config:
            self.log_params(self.parent, config_params(cfg))

    def _experiment(self, name: str, artifact_root: Path) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(name, artifact_location=artifact_root.resolve().as_uri())
        except Exception:  # created by a concurrent invocation in the meantime
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def log_params(self, run_id: Optional[str], params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            if run_id:
                self._safely(self.client.log_batch, run_id, params=items[i:i + 100])

    def log_artifact(self, run_id: Optional[str], path: Path, artifact_path: Optional[str] = None) -> None:
        if run_id:
            self._safely(log_artifact, self.client, run_id, path, artifact_path, self.max_artifact_bytes)

    def start_stage(self, name: str, key: str, params: dict[str, str], tags: dict[str, str]) -> Optional[str]:
        """The stage's run id (None once tracking is degraded)."""
        run = self._safely(self.client.create_run, self.experiment_id, run_name=name, tags={
            "mlflow.parentRunId": self.parent, "orchestrator.kind": "stage", "orchestrator.stage": name,
            "orchestrator.key": key, **tags})
        if run is None:
            return None
        if params:
            self.log_params(run.info.run_id, params)
        return run.info.run_id

    def record_cached(self, name: str, key: str, source_run_id: str) -> None:
        """A stage found in the cache still gets a (finished) run here: it links to the run that computed its outputs
        (a tag, and the run's description as a link in MLflow's UI) and carries that run's metrics (their last
        values) and params, so that comparing two invocations' stages compares what each of them used."""
        source = self._source(source_run_id)
        tags = {"orchestrator.status": "cached", "orchestrator.source_run_id": source_run_id}
        if source is not None:
            made_by = source.data.tags.get("mlflow.parentRunId", "")
            tags.update({"orchestrator.source_invocation": made_by, "mlflow.note.content": (
                f"Cached: these outputs were computed by the {name} run [{source_run_id}]"
                f"(#/experiments/{source.info.experiment_id}/runs/{source_run_id}) of invocation "
                f"[{made_by}](#/experiments/{source.info.experiment_id}/runs/{made_by}); its metrics are copied "
                "here.")})
        elif source_run_id:
            tags["mlflow.note.content"] = (f"Cached: computed by run {source_run_id}, which this store does not hold "
                                           f"(recorded in another store, or deleted since)")
        run_id = self.start_stage(name, key, dict(source.data.params) if source else {}, tags)
        carried = {k: v for k, v in (source.data.metrics if source else {}).items() if k not in INVOCATION_TIMES}
        self.end_run(run_id, "FINISHED", carried)

    def _source(self, run_id: str):
        """The run that computed a cached stage, or None where this store does not have it."""
        if not run_id or self.degraded:
            return None
        try:
            return self.client.get_run(run_id)
        except Exception:  # RESOURCE_DOES_NOT_EXIST: another store's run, or one deleted; not the store failing
            return None

    def end_run(self, run_id: Optional[str], status: str, metrics: Optional[dict[str, float]] = None,
                tags: Optional[dict[str, str]] = None) -> None:
        from mlflow.entities import Metric, RunTag

        if not run_id:
            return
        now = int(time.time() * 1000)
        self._safely(self.client.log_batch, run_id,
                     metrics=[Metric(k, float(v), now, 0) for k, v in (metrics or {}).items()],
                     tags=[RunTag(k, str(v)) for k, v in (tags or {}).items()])
        self._safely(self.client.set_terminated, run_id, status)

    def close_stale(self, run_ids: list[str], reason: str) -> None:
        """Runs left RUNNING by a killed earlier attempt are marked KILLED."""
        for run_id in run_ids:
            try:
                if self.client.get_run(run_id).info.status == "RUNNING":
                    self.client.set_tag(run_id, "orchestrator.killed", reason)
                    self.client.set_terminated(run_id, "KILLED")
            except Exception:  # a run deleted by the user, or another store: nothing to close
                pass


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
