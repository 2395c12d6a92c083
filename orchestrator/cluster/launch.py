"""A stage made ready to run: its spec (what the worker reads), its log folder, and the outcome of running it.

Every executor (local, debug, SLURM) takes a `Launch` and ends with an `Outcome`; this module knows nothing
about any of them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from orchestrator.dag import PlannedStage
from orchestrator.tracking.tracker import config_params


@dataclass
class Launch:
    planned: PlannedStage
    spec: dict
    spec_path: Path
    log_dir: Path

    def open_run(self, tracking, cfg, status: str, closes_itself: bool = False) -> Optional[str]:
        """Create the stage's MLflow run (None without tracking) and have the stage's rank 0 log into it;
        closes_itself: the stage ends the run (no orchestrator watches it, as on SLURM)."""
        if tracking is None:
            return None
        ps = self.planned
        run_id = tracking.start_stage(ps.name, ps.key, config_params(cfg, ps.stage.reads),
                                      {"orchestrator.status": status})
        if run_id is None:  # tracking degraded: the stage records into its files only
            return None
        self.spec["tracking"] = {"uri": cfg.tracking.uri, "run_id": run_id,
                                 "max_artifact_mb": cfg.tracking.max_artifact_mb, "end_run": closes_itself}
        self.spec["entry_meta"]["mlflow_run_id"] = run_id
        return run_id


@dataclass
class Outcome:
    ok: bool
    seconds: float
    error: Optional[str] = None
    interrupted: bool = False      # stopped on the user's request (Ctrl-C); its progress is saved
    waited_s: float = 0.0          # before its first rank started: the run's start-up (orchestrator/cluster/local.py)


def write_spec(path: Path, spec: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(spec, indent=2, sort_keys=True))
