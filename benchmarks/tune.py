"""tune=layout against running every trial from scratch: the first tune (empty cache), the second (every trial
cached), and each of the tune's layouts as its own `python -m orchestrator` run with its own empty cache (every
stage), one after another.

    python benchmarks/tune.py [world_size=4] [model=gpt_small] [steps=5]
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.support.cli import arguments  # noqa: E402

ENV = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "COLUMNS": "200"}


def timed(args: list[str], cwd: Path) -> float:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "orchestrator", *args, "tracking=none"], cwd=cwd, env=ENV,
                         capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stdout[-2000:] + out.stderr[-2000:])
    return time.perf_counter() - t0


def main(argv: list[str]) -> None:
    args = arguments(argv, __doc__)
    world, model, steps = int(args.get("world_size", 4)), args.get("model", "gpt_small"), int(args.get("steps", 5))
    tune = ["tune=layout", f"tune.world_size={world}", f"model={model}", f"tune.steps={steps}"]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "tune"
        work.mkdir()
        first, second = timed(tune, work), timed(tune, work)
        record = json.loads(sorted(work.rglob("tune.json"))[0].read_text())
        trials = [t for t in record["trials"] if t["status"] in ("ran", "cached")]
        scratch = 0.0
        for i, t in enumerate(trials):
            alone = Path(tmp) / f"trial{i}"
            alone.mkdir()
            scratch += timed([f"model={model}", f"train.steps={steps}", "train.eval_every=0",
                              "train.checkpoint_every=0", *(f"{k}={v}" for k, v in t["settings"].items())], alone)
    print(f"{model}, world size {world}, {len(trials)} layouts ran, {steps} steps each")
    print(f"first tune {first:.0f} s; second tune {second:.1f} s (cached); every layout from scratch {scratch:.0f} s")
    print(f"first tune / from scratch {first / scratch:.2f}x; second tune / from scratch {second / scratch:.3f}x")


if __name__ == "__main__":
    main(sys.argv[1:])
