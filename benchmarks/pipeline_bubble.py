"""Pipeline bubble: measured idle share of a step per schedule, against (p-1)/(m+p-1).

Two measurements, both through the project's PipelineRunner and its Timeline instrumentation:
- simulated: every stage sleeps a fixed time in forward (and twice that in backward) instead of computing,
  so the idle share is the schedule's own, whatever the number of cores;
- real: `python -m orchestrator` runs of the tiny GPT (on a 2-core machine, pp=4 ranks share cores: their
  idle share mixes bubble and waiting for a core).

    python benchmarks/pipeline_bubble.py [microbatches=8] [forward_ms=20] [real=1]
"""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = [(2, "gpipe", 1), (2, "1f1b", 1), (2, "interleaved_1f1b", 2), (2, "zbv", 2),
         (4, "gpipe", 1), (4, "1f1b", 1), (4, "interleaved_1f1b", 2), (4, "zbv", 2)]


def theory(p: int, m: int, chunks: int) -> tuple[float, float]:
    """(p-1)/(m+p-1), and the interleaved form (p-1)/(v*m+p-1) with v chunks per rank."""
    return (p - 1) / (m + p - 1), (p - 1) / (chunks * m + p - 1)


def simulate_rank() -> None:
    """One rank of the simulation (launched by torch.distributed.run)."""
    import torch
    import torch.distributed as dist
    from torch import nn

    sys.path.insert(0, str(ROOT))
    from plugins.parallel.pipeline import PipelineRunner, Timeline
    from plugins.partition import pipeline_stages

    pp, schedule, chunks, m, fwd = (int(os.environ["PP"]), os.environ["SCHEDULE"], int(os.environ["CHUNKS"]),
                                    int(os.environ["M"]), float(os.environ["FWD_MS"]) / 1e3)

    class Sleep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            time.sleep(fwd)
            return x * w

        @staticmethod
        def backward(ctx, g):
            time.sleep(2 * fwd)
            return g, g.sum().reshape(1)

    class SleepStage(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(1))

        def forward(self, x):
            return Sleep.apply(x, self.w)

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    stages = pipeline_stages(pp * chunks, pp, chunks, schedule)
    mine = [s for s in stages if s["rank"] == rank]
    timeline = Timeline()
    runner = PipelineRunner([SleepStage() for _ in mine], [s["stage"] for s in mine], [s["rank"] for s in stages],
                            schedule, m, lambda out, tgt: (out - tgt).pow(2).sum(), dist.group.WORLD,
                            torch.device("cpu"), True, False, 1.0, timeline)
    x = torch.randn(m, 4)
    idle = []
    for _ in range(3):
        runner.train_step(x, x, 1)
        idle.append(timeline.idle_fraction())
    all_idle = [None] * pp
    dist.all_gather_object(all_idle, idle[-1])
    if rank == 0:
        print(json.dumps({"idle": statistics.mean(all_idle)}), flush=True)
    dist.destroy_process_group()


def simulated(pp: int, schedule: str, chunks: int, m: int, fwd_ms: float) -> float:
    env = {**os.environ, "PP": str(pp), "SCHEDULE": schedule, "CHUNKS": str(chunks), "M": str(m), "FWD_MS": str(fwd_ms),
           "PYTHONPATH": str(ROOT), "BUBBLE_RANK": "1"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={pp}", __file__],
                         env=env, capture_output=True, text=True, timeout=600)
    found = re.search(r'^\{"idle": ([0-9.e-]+)\}', out.stdout, re.M)
    if not found:
        raise RuntimeError(out.stdout[-2000:] + out.stderr[-2000:])
    return float(found.group(1))


def real(pp: int, schedule: str, chunks: int, m: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        args = [f"parallel.pp={pp}", f"parallel.pp_schedule={schedule}", f"parallel.pp_chunks={chunks}",
                f"parallel.microbatches={m}", "train.batch_size=16", "train.steps=15", "train.eval_every=0",
                "train.checkpoint_every=0", "tracking=none", "train.progress=false"]
        out = subprocess.run([sys.executable, "-m", "orchestrator", *args], cwd=tmp, capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(out.stdout[-2000:] + out.stderr[-2000:])
        run_dir = re.search(r"^outputs: (\S+)", out.stdout, re.M).group(1)
        rows = [json.loads(line) for line in Path(run_dir, "stages/train/output/metrics.jsonl").read_text().splitlines()]
        return statistics.median(r["pipeline_idle_fraction"] for r in rows[5:])


def main(argv: list[str]) -> None:
    args = dict(a.split("=", 1) for a in argv)
    m, fwd_ms, with_real = int(args.get("microbatches", 8)), float(args.get("forward_ms", 20)), args.get("real", "1") == "1"
    print(f"m={m} microbatches; simulated stages: forward {fwd_ms:g} ms, backward {2 * fwd_ms:g} ms per microbatch")
    print(f"{'pp':>2} {'schedule':<17} {'chunks':>6} {'(p-1)/(m+p-1)':>14} {'(p-1)/(vm+p-1)':>15} {'simulated':>9}"
          f"{'  real (tiny GPT)':>17}")
    for pp, schedule, chunks in CASES:
        flat, interleaved = theory(pp, m, chunks)
        sim = simulated(pp, schedule, chunks, m, fwd_ms)
        measured = f"{real(pp, schedule, chunks, m):>17.3f}" if with_real else ""
        print(f"{pp:>2} {schedule:<17} {chunks:>6} {flat:>14.3f} {interleaved:>15.3f} {sim:>9.3f}{measured}", flush=True)


if __name__ == "__main__":
    if os.environ.get("BUBBLE_RANK") == "1":
        simulate_rank()
    else:
        main(sys.argv[1:])
