"""Recording a run that had nothing to do, after it has ended.

When every stage is cached, the run itself takes a second or two while MLflow would take longer than that
(`import mlflow` ~2 s, opening a sqlite store ~1.5 s). Such a run writes down what it would have recorded (the
same calls an `Invocation` gets) and a detached process replays them: the user's command returns at once, and
the store holds the same runs a moment later. A process that already imported MLflow (a sweep) records inline.

    python -m orchestrator.tracking.later <run dir>/mlflow_pending.json   # what the detached process runs
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

from storage.fsio import atomic_write_json, read_json

PENDING, RECORDED, LOG = "mlflow_pending.json", "mlflow_recorded.json", "mlflow_record.log"
PARENT = "<parent>"  # stands for the parent run's id until the replay creates it


def worthwhile(cfg, nothing_to_run: bool) -> bool:
    """Record later: tracking is on, nothing runs, and MLflow is not imported yet (its import is the cost). Not on
    SLURM: there the run's record goes to slurm_jobs.json for `orchestrator.follow`, which needs the parent's id."""
    return (cfg.tracking.name == "mlflow" and nothing_to_run and cfg.cluster.name != "slurm"
            and "mlflow" not in sys.modules)


class LaterInvocation:
    """What a run with nothing to do calls on its tracker (orchestrator.run), written down instead of sent.
    The parent's id is not known before the replay: the report and the printout say where it will be."""

    parent = PARENT

    def __init__(self, run_dir: Path, run_name: str, tags: dict[str, str]):
        self.run_dir = run_dir
        self.journal: dict = {"config": str(run_dir / "config.yaml"), "run_name": run_name, "tags": tags, "calls": []}
        self.pid: Optional[int] = None

    def log_artifact(self, run_id: str, path: Path, artifact_path: Optional[str] = None) -> None:
        self.journal["calls"].append(["log_artifact", run_id, str(path), artifact_path])

    def record_cached(self, name: str, key: str, source_run_id: str) -> None:
        self.journal["calls"].append(["record_cached", name, key, source_run_id])

    def end_run(self, run_id: str, status: str, metrics: Optional[dict] = None, tags: Optional[dict] = None) -> None:
        self.journal["calls"].append(["end_run", run_id, status, metrics or {}, tags or {}])
        if run_id == PARENT:  # the run is over: hand the journal to a process of its own
            self.pid = start(self.run_dir, self.journal)

    def close_stale(self, run_ids: list[str], reason: str) -> None:  # nothing runs, so nothing is superseded
        pass


def start(run_dir: Path, journal: dict) -> int:
    atomic_write_json(run_dir / PENDING, journal)
    with open(run_dir / LOG, "ab") as log:  # detached: the user's shell and Ctrl-C do not reach it
        return subprocess.Popen([sys.executable, "-m", "orchestrator.tracking.later", str(run_dir / PENDING)],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True).pid


def replay(pending: Path) -> str:
    """Send the journal's calls to MLflow; the parent run's id is written to mlflow_recorded.json beside it."""
    from orchestrator.tracking.tracker import Invocation

    journal = read_json(pending)
    tracking = Invocation(OmegaConf.load(journal["config"]), journal["run_name"], journal["tags"])
    for name, *args in journal["calls"]:
        args = [tracking.parent if a == PARENT else a for a in args]
        getattr(tracking, name)(*args)
    atomic_write_json(pending.with_name(RECORDED), {**journal, "parent_run_id": tracking.parent,
                                                    "degraded": tracking.degraded})
    pending.unlink()
    return tracking.parent


if __name__ == "__main__":
    print(f"recorded as MLflow run {replay(Path(sys.argv[1]))}")
