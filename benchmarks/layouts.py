"""Start-up and steady-state step time of every layout, through `python -m orchestrator` in a fresh
working directory each (nothing cached).

- command to first step: from starting the command to the wall-clock stamp of the first training step
  (export, transform and the ranks' start-up included);
- step time: median of the steps after the first five, relative to `single` measured in the same run.

On a machine with fewer cores than ranks the ranks share cores: layouts are for correctness there.

    python benchmarks/layouts.py [steps=30] [extra overrides...]
"""
from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.support.cli import arguments  # noqa: E402

LAYOUTS = [("single", []), ("ddp2", ["parallel=ddp2"]), ("ddp2 shard", ["parallel=ddp2", "parallel.dp_mode=shard"]),
           ("megatron_hp2", ["parallel=megatron_hp2"]), ("megatron_hp4", ["parallel=megatron_hp4"]),
           ("pipeline_pp2", ["parallel=pipeline_pp2"]), ("pipeline_pp4_interleaved", ["parallel=pipeline_pp4_interleaved"]),
           ("dp2_hp2_pp2", ["parallel=dp2_hp2_pp2"]), ("dp2_hp2_pp2 shard", ["parallel=dp2_hp2_pp2", "parallel.dp_mode=shard"])]


def run(args: list[str]) -> tuple[float, list[dict]]:
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.time()
        out = subprocess.run([sys.executable, "-m", "orchestrator", *args], cwd=tmp, capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(out.stdout[-2000:] + out.stderr[-2000:])
        run_dir = re.search(r"^outputs: (\S+)", out.stdout, re.M).group(1)
        rows = [json.loads(line) for line in Path(run_dir, "stages/train/output/metrics.jsonl").read_text().splitlines()]
        return rows[0]["time"] - t0, rows


def main(argv: list[str]) -> None:
    arguments(argv, __doc__)  # -h / --help
    steps = next((int(a.split("=")[1]) for a in argv if a.startswith("steps=")), 30)
    extra = [a for a in argv if not a.startswith("steps=")]
    common = [f"train.steps={steps}", "train.eval_every=0", "train.checkpoint_every=0", "tracking=none",
              "train.progress=false", *extra]
    print(f"{'layout':<26} {'ranks':>5} {'command->1st step':>18} {'step time':>10} {'vs single':>9}")
    base = None
    for name, args in LAYOUTS:
        first, rows = run([*common, *args])
        step = statistics.median(r["step_time_s"] for r in rows[5:])
        base = base or step
        ranks = {"single": 1, "ddp2": 2, "megatron_hp2": 2, "megatron_hp4": 4, "pipeline_pp2": 2,
                 "pipeline_pp4_interleaved": 4, "dp2_hp2_pp2": 8}[name.split()[0]]
        print(f"{name:<26} {ranks:>5} {first:>16.1f} s {step * 1e3:>7.1f} ms {step / base:>8.2f}x", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
