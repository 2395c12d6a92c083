"""Wall time of `python -m orchestrator` (the default experiment) split per stage, then of the fully
cached rerun, in a fresh working directory. Stage times are the orchestrator's own (process start to
publish) as recorded in MLflow (`duration_s`).

    python benchmarks/end_to_end.py [extra overrides...]
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlflow

ROOT = Path(__file__).resolve().parents[1]


def run(args: list[str], cwd: Path) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "orchestrator", *args], cwd=cwd, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main(extra: list[str]) -> None:
    if any(a in ("-h", "--help") for a in extra):
        print(__doc__)
        return
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        first = run(extra, cwd)
        cached = run(extra, cwd)
        client = mlflow.MlflowClient(f"sqlite:///{cwd}/runs/mlflow.db")
        exp = client.get_experiment_by_name("orchestrator")
        runs = client.search_runs([exp.experiment_id], order_by=["attribute.start_time ASC"])
        parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)
        stages = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
        print(f"python -m orchestrator {' '.join(extra)}".rstrip())
        print(f"  first run:  {first:6.1f} s wall (command start to exit)")
        for r in stages:
            print(f"    {r.info.run_name:<11} {r.data.metrics.get('duration_s', float('nan')):6.1f} s")
        overhead = first - sum(r.data.metrics.get("duration_s", 0) for r in stages)
        print(f"    {'(orchestrator: start-up, planning, MLflow)':<11} {overhead:6.1f} s")
        print(f"  cached rerun: {cached:4.1f} s wall")


if __name__ == "__main__":
    main(sys.argv[1:])
