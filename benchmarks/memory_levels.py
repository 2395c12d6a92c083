"""Activation memory per `memory` level: process memory after the forward pass (when activations peak)
and step time, from `python -m orchestrator` runs, median over the steps after the first five.

On CPU the logged memory is the process RSS. glibc keeps freed blocks mapped, so by default RSS hardly
moves within a step; here the runs set MALLOC_MMAP_THRESHOLD_ so that blocks of 64 KiB and more are
mmap-ed and returned when freed: RSS then follows live memory, and "+N MB" is what the forward pass keeps
alive for the backward pass.

    python benchmarks/memory_levels.py [model=gpt_small] [steps=15] [extra overrides...]
"""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.support.cli import arguments  # noqa: E402


def main(argv: list[str]) -> None:
    arguments(argv, __doc__)  # -h / --help
    args = dict(a.split("=", 1) for a in argv if a.split("=", 1)[0] in ("model", "steps"))
    extra = [a for a in argv if a.split("=", 1)[0] not in ("model", "steps")]
    model, steps = args.get("model", "gpt_small"), int(args.get("steps", 15))
    print(f"{model}, batch 16 x 256 tokens, median of steps 6..{steps}")
    print(f"{'level':<7} {'RSS after forward':>18} {'RSS after backward':>19} {'step time':>10}")
    base = None
    for level in (0, 1, 2):
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "orchestrator", f"model={model}", f"memory=level{level}", f"train.steps={steps}",
                   "train.seq_len=256", "train.batch_size=16", "train.eval_every=0", "train.checkpoint_every=0",
                   "tracking=none", "train.progress=false", *extra]
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
            out = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, env=env)
            if out.returncode:
                raise RuntimeError(out.stdout[-2000:] + out.stderr[-2000:])
            run_dir = re.search(r"^outputs: (\S+)", out.stdout, re.M).group(1)
            rows = [json.loads(x) for x in Path(run_dir, "stages/train/output/metrics.jsonl").read_text().splitlines()]
        fwd = statistics.median(r["memory/rss_post_forward_mb"] - r["memory/rss_pre_forward_mb"] for r in rows[5:])
        after_fwd = statistics.median(r["memory/rss_post_forward_mb"] for r in rows[5:])
        after_bwd = statistics.median(r["memory/rss_post_backward_mb"] for r in rows[5:])
        step = statistics.median(r["step_time_s"] for r in rows[5:])
        base = base or (fwd, step)
        print(f"level{level} {after_fwd:>12.0f} MB (+{fwd:.0f}, {fwd / base[0]:.2f}x) {after_bwd:>12.0f} MB "
              f"{step * 1e3:>7.0f} ms ({step / base[1]:.2f}x)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
