"""`python -m orchestrator.tracking.resync <run folder> [<run folder> ...] [--uri URI]`: put runs into MLflow from their folders.

For a run that MLflow missed or holds only in part: run with `tracking=none`, or whose tracking degraded when the
store failed during training (the work went on; the run folder kept everything). A new invocation run is made,
tagged `orchestrator.resynced_from` with the folder, with a child run per stage that has an output: the train
stage's per-step metrics from its metrics.jsonl, every stage's summary numbers, and its small files (JSON, images,
text) as artifacts. The store is the run's own `tracking.uri` unless --uri names another.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

from orchestrator.report import console
from storage.fsio import read_json

ARTIFACT_SUFFIXES = (".json", ".jsonl", ".png", ".txt", ".yaml")
SUMMARIES = ("summary.json", "manifest.json", "index.json")


def _numbers(record: dict, prefix: str = "") -> dict[str, float]:
    """The finite numbers of a (nested) summary, with dotted names."""
    found: dict[str, float] = {}
    for k, v in record.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            found.update(_numbers(v, name + "."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            found[name] = float(v)
    return found


def _step_metrics(path: Path) -> list:
    from mlflow.entities import Metric

    metrics = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        when = int(row.get("time", 0) * 1000)
        metrics += [Metric(k, v, when, int(row["step"])) for k, v in _numbers(row).items() if k not in ("step", "time")]
    return metrics


def resync(run_dir: Path, uri: Optional[str] = None) -> str:
    """The new invocation run's id."""
    from mlflow.entities import Metric

    from orchestrator.tracking.tracker import Invocation, log_artifact

    run_dir = run_dir.resolve()
    if not (run_dir / "config.yaml").is_file() or not (run_dir / "plan.json").is_file():
        raise SystemExit(f"error: {run_dir} is not a run folder (it has no config.yaml and plan.json); run folders "
                         f"are under runs/outputs/<date>/<time>")
    cfg = OmegaConf.load(run_dir / "config.yaml")
    cfg.tracking.name = "mlflow"
    if uri:
        cfg.tracking.uri = uri
    inv = Invocation(cfg, f"resync {run_dir.name}", {"orchestrator.run_dir": str(run_dir),
                                                      "orchestrator.resynced_from": str(run_dir)})
    for name in ("config.yaml", "plan.json", "plan.txt"):
        if (run_dir / name).is_file():
            log_artifact(inv.client, inv.parent, run_dir / name, None, inv.max_artifact_bytes)
    stages = 0
    for row in read_json(run_dir / "plan.json"):
        out = run_dir / "stages" / row["stage"] / "output"
        if not out.is_dir():
            continue  # the stage never finished in this run: nothing to record
        run_id = inv.client.create_run(inv.experiment_id, run_name=row["stage"], tags={
            "mlflow.parentRunId": inv.parent, "orchestrator.kind": "stage", "orchestrator.stage": row["stage"],
            "orchestrator.key": row["key"], "orchestrator.status": "resynced"}).info.run_id
        metrics = _step_metrics(out / "metrics.jsonl") if (out / "metrics.jsonl").is_file() else []
        for summary in SUMMARIES:
            if (out / summary).is_file() and isinstance(record := read_json(out / summary), dict):
                metrics += [Metric(k, v, 0, 0) for k, v in _numbers(record).items()]
        for i in range(0, len(metrics), 900):  # MLflow takes at most 1000 metrics per call
            inv.client.log_batch(run_id, metrics=metrics[i:i + 900])
        for f in sorted(out.iterdir()):
            if f.is_file() and f.suffix in ARTIFACT_SUFFIXES:
                log_artifact(inv.client, run_id, f, None, inv.max_artifact_bytes)
        inv.client.set_terminated(run_id, "FINISHED")
        stages += 1
    inv.client.set_terminated(inv.parent, "FINISHED")
    console.print(f"{run_dir}: {stages} stage(s) recorded in {cfg.tracking.uri} (run {inv.parent})", soft_wrap=True)
    return inv.parent


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    uri = None
    if "--uri" in argv:
        i = argv.index("--uri")
        uri, argv = argv[i + 1], argv[:i] + argv[i + 2:]
    for folder in argv:
        resync(Path(folder), uri)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
