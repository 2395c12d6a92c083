"""A stage's side of tracking: its rank 0 logs metrics, params, tags and artifacts into the child run the
orchestrator created for it (orchestrator/tracking/tracker.py), by id."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

from orchestrator.tracking.tracker import FAILED_NOTE, Degradable, _client, log_artifact
from stages.base import Tracker

FLUSH_EVERY_S = 10.0
MAX_BATCH = 900  # MLflow takes at most 1000 metrics per log_batch


class MlflowStageTracker(Degradable, Tracker):
    """A stage's rank 0 logging into its child run; metrics are batched (one write every few seconds).

    Tracking never stops a stage: when the store fails (a server gone, a file damaged), one warning says so and
    the tracker records nothing more (the train stage's metrics.jsonl keeps every step)."""

    def __init__(self, uri: str, run_id: str, max_artifact_mb: int):
        self.client = _client(uri)
        self.run_id = run_id
        self.max_bytes = max_artifact_mb * 2**20
        self._pending: list = []
        self._last_flush = time.monotonic()

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        self._safely(self.client.log_batch, self.run_id, params=[Param(k, str(v)) for k, v in params.items()])

    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        from mlflow.entities import Metric

        if self.degraded:
            return
        now = int(time.time() * 1000)
        self._pending.extend(Metric(k, float(v), now, step or 0) for k, v in metrics.items())
        if len(self._pending) >= MAX_BATCH or time.monotonic() - self._last_flush > FLUSH_EVERY_S:
            self.flush()

    def log_artifact(self, path: Path, artifact_path: Optional[str] = None) -> None:
        self._safely(log_artifact, self.client, self.run_id, path, artifact_path, self.max_bytes)

    def log_table(self, data: dict[str, list], artifact_file: str) -> None:
        self._safely(self.client.log_table, self.run_id, data, artifact_file)

    def set_tags(self, tags: dict[str, Any]) -> None:
        for k, v in tags.items():
            self._safely(self.client.set_tag, self.run_id, k, str(v))

    def last_step(self, metric: str) -> Optional[int]:
        history = self._safely(self.client.get_metric_history, self.run_id, metric) or []
        return max((m.step for m in history), default=None)

    def end(self, status: str) -> None:
        """Close this run (stages that run without the orchestrator watching, as SLURM jobs, close their own)."""
        self.flush()
        self._safely(self.client.set_terminated, self.run_id, status)

    def flush(self) -> None:
        while self._pending and not self.degraded:
            batch, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
            self._safely(self.client.log_batch, self.run_id, metrics=batch)
        self._pending = [] if self.degraded else self._pending
        self._last_flush = time.monotonic()


def stage_tracker(spec: dict, rank: int) -> Tracker:
    """The tracker a stage process gets: MLflow for rank 0 when tracking is on, else one that records nothing."""
    t = spec.get("tracking")
    if rank != 0 or not t:
        return Tracker()
    tracker = MlflowStageTracker(t["uri"], t["run_id"], t["max_artifact_mb"])
    run_dir = spec.get("entry_meta", {}).get("run_dir")
    tracker.said_in = Path(run_dir) / FAILED_NOTE if run_dir else None
    return tracker
