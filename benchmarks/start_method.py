"""Local ranks forked from the preloaded server against fresh `python -m orchestrator.worker` processes.

For each layout, `python -m orchestrator` runs with cluster.start_method=exec and =forkserver in turn (rounds
alternate, one working directory, so tokenize/export/transform come from the cache and train, checkpoint and
aggregate run every time: each round has its own learning rate). Printed: the median wall time of the command and
of its stages (the orchestrator's stage table), and the ratio forkserver / exec.

    python benchmarks/start_method.py [layouts=single,ddp2,dp2_hp2_pp2] [rounds=3] [steps=10] [model=gpt_tiny]
"""
from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.support.cli import arguments  # noqa: E402

METHODS = ("exec", "forkserver")


def run(args: list[str], cwd: Path) -> tuple[float, float]:
    """(wall time of the command, the stages' total from its table)."""
    t0 = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "orchestrator", *args], cwd=cwd, capture_output=True, text=True,
                            env={**os.environ, "COLUMNS": "200"})
    wall = time.perf_counter() - t0
    if result.returncode:
        sys.exit(f"failed: python -m orchestrator {' '.join(args)}\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    return wall, float(re.search(r"stages \(([\d.]+) s in all\)", result.stdout).group(1))


def main(argv: list[str]) -> None:
    opts = arguments(argv, __doc__)
    layouts = opts.get("layouts", "single,ddp2,dp2_hp2_pp2").split(",")
    rounds, steps, model = int(opts.get("rounds", 3)), int(opts.get("steps", 10)), opts.get("model", "gpt_tiny")
    common = [f"model={model}", f"train.steps={steps}", "train.batch_size=8", "train.seq_len=32", "train.eval_every=0",
              "train.progress=false", "tracking=none"]
    print(f"{'layout':<14}{'exec wall':>11}{'forked wall':>13}{'ratio':>7}{'exec stages':>13}{'forked stages':>15}"
          f"{'ratio':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        for layout in layouts:
            first = [a for a in common if not a.startswith("train.steps=")]  # a key once: twice is refused
            run([*first, f"parallel={layout}", "train.steps=1"], cwd)  # tokenize, export, transform: not timed
            times = {m: [] for m in METHODS}
            for r in range(rounds):
                for i, method in enumerate(METHODS if r % 2 == 0 else METHODS[::-1]):
                    lr = f"optimizer.lr={1e-3 * (1 + r + i / 10):.6f}"  # train, checkpoint, aggregate run again
                    times[method].append(run([*common, f"parallel={layout}", lr,
                                              f"cluster.start_method={method}"], cwd))
            wall = {m: statistics.median(t[0] for t in times[m]) for m in METHODS}
            stage = {m: statistics.median(t[1] for t in times[m]) for m in METHODS}
            print(f"{layout:<14}{wall['exec']:>9.1f} s{wall['forkserver']:>11.1f} s"
                  f"{wall['forkserver'] / wall['exec']:>7.2f}{stage['exec']:>11.1f} s{stage['forkserver']:>13.1f} s"
                  f"{stage['forkserver'] / stage['exec']:>7.2f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
