"""cluster=slurm against the running SLURM cluster (scripts/slurm_cluster.sh start), each run in a fresh
working directory (nothing cached):

- submission overhead: seconds from the plan to the last job submitted, per stage submitted
  (cluster.wait=false; the jobs are then cancelled);
- command to first train step, slurm vs local (the wall-clock stamp of the first step's metrics row);
- a 4-point sweep (`-m parallel=ddp2,megatron_hp4 optimizer.lr=1e-3,3e-4`) vs the sum of its points run alone.

    python benchmarks/slurm.py [steps=20]
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.support.cli import arguments  # noqa: E402

SMALL = ["train.eval_every=0", "train.checkpoint_every=0", "train.progress=false", "tracking=none"]


def cli(args: list[str], cwd: str) -> tuple[float, str]:
    t0 = time.time()
    out = subprocess.run([sys.executable, "-m", "orchestrator", *args], cwd=cwd, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stdout[-3000:] + out.stderr[-3000:])
    return t0, out.stdout


def first_step(args: list[str]) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        t0, stdout = cli(args, tmp)
        run_dir = re.findall(r"^outputs: (\S+)", stdout, re.M)[-1]
        first = json.loads(Path(run_dir, "stages/train/output/metrics.jsonl").read_text().splitlines()[0])
        return first["time"] - t0


def submission_overhead() -> tuple[float, int]:
    with tempfile.TemporaryDirectory() as tmp:
        _, stdout = cli(["cluster=slurm", "cluster.wait=false", *SMALL], tmp)
        jobs_file = next(Path(tmp).rglob("slurm_jobs.json"))
        stages = json.loads(jobs_file.read_text())["stages"]
        subprocess.run(["scancel", *[s["job_id"] for s in stages]], check=False)
        plan_written = (jobs_file.parent / "plan.json").stat().st_mtime
        return jobs_file.stat().st_mtime - plan_written, len(stages)


def wall(args: list[str]) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        t0, _ = cli(args, tmp)
        return time.time() - t0


def main(argv: list[str]) -> None:
    arguments(argv, __doc__)  # -h / --help
    steps = next((int(a.split("=")[1]) for a in argv if a.startswith("steps=")), 20)
    common = [f"train.steps={steps}", *SMALL]

    seconds, n = submission_overhead()
    print(f"submission: {seconds:.2f} s for {n} stages = {seconds / n:.2f} s per stage (plan written -> last sbatch)")

    for name, extra in (("single", []), ("megatron_hp4", ["parallel=megatron_hp4"])):
        local = first_step(["cluster=local", *common, *extra])
        slurm = first_step(["cluster=slurm", "cluster.poll_s=0.5", *common, *extra])
        print(f"command -> first train step, {name}: local {local:.1f} s, slurm {slurm:.1f} s ({slurm / local:.2f}x)",
              flush=True)

    points = [[f"parallel={p}", f"optimizer.lr={lr}"] for p in ("ddp2", "megatron_hp4") for lr in ("1e-3", "3e-4")]
    alone = [wall(["cluster=slurm", *common, *p]) for p in points]
    sweep = wall(["-m", "cluster=slurm", *common, "parallel=ddp2,megatron_hp4", "optimizer.lr=1e-3,3e-4"])
    print(f"4-point sweep: {sweep:.1f} s; points alone: {' + '.join(f'{a:.1f}' for a in alone)} = {sum(alone):.1f} s "
          f"-> sweep / sum {sweep / sum(alone):.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
