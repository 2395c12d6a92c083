"""Pipeline bubble: measured idle share of a step per schedule, against its theory, with the step time beside it.

Two measurements, both through the project's PipelineRunner and its Timeline instrumentation:
- simulated: every stage sleeps instead of computing, so the idle share is the schedule's own, whatever the number
  of cores. A stage has a forward (F ms), an input-gradient node (B ms) and a separate weight-gradient node (W ms),
  as a real layer has: zero-bubble schedules (zbv) run B and W at different times to fill the bubble, the others
  run them together. Stage 0 computes an input gradient too (its input requires one), as its inner layers would.
  With v chunks per rank (interleaved, zbv) a chunk takes 1/v of those times: the same model in more stages.
- real: `python -m orchestrator` runs of the tiny GPT (on a 2-core machine, pp=4 ranks share cores: their
  idle share mixes bubble and waiting for a core).

Theory: GPipe and 1F1B (p-1)/(m+p-1); interleaved with v chunks per rank (p-1)/(v*m+p-1); ZB-V about 0 (its
schedule fills the warm-up and cool-down with weight-gradient work).

    python benchmarks/pipeline_bubble.py [microbatches=8] [forward_ms=40] [input_ms=F] [weight_ms=F] [real=1]
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
sys.path.insert(0, str(ROOT))

from benchmarks.support.cli import arguments  # noqa: E402
CASES = [(2, "gpipe", 1), (2, "1f1b", 1), (2, "interleaved_1f1b", 2), (2, "zbv", 2),
         (4, "gpipe", 1), (4, "1f1b", 1), (4, "interleaved_1f1b", 2), (4, "zbv", 2)]


def theory(p: int, m: int, schedule: str, chunks: int) -> float:
    """The schedule's own bubble: (p-1)/(m+p-1); interleaved (p-1)/(v*m+p-1) with v chunks per rank; ZB-V ~0."""
    if schedule == "zbv":
        return 0.0
    if schedule in ("interleaved_1f1b", "looped_bfs"):
        return (p - 1) / (chunks * m + p - 1)
    return (p - 1) / (m + p - 1)


def simulate_rank() -> None:
    """One rank of the simulation (launched by torch.distributed.run)."""
    import torch
    import torch.distributed as dist
    from torch import nn

    sys.path.insert(0, str(ROOT))
    from plugins.parallel.pipeline import PipelineRunner, Timeline
    from planning.partition import pipeline_stages

    pp, schedule, chunks, m = int(os.environ["PP"]), os.environ["SCHEDULE"], int(os.environ["CHUNKS"]), int(os.environ["M"])
    # the same model in p*v stages: a chunk does 1/v of a rank's work (so step times compare across schedules)
    fwd, inp, wgt = (float(os.environ[k]) / 1e3 / chunks for k in ("FWD_MS", "INPUT_MS", "WEIGHT_MS"))

    class Activations(torch.autograd.Function):
        """Forward F; backward B: the input-gradient node."""
        @staticmethod
        def forward(ctx, x):
            time.sleep(fwd)
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            time.sleep(inp)
            return g

    class Weights(torch.autograd.Function):
        """The weight-gradient node: its backward (W) is needed for the parameter only."""
        @staticmethod
        def forward(ctx, w):
            return w.clone()

        @staticmethod
        def backward(ctx, g):
            time.sleep(wgt)
            return g

    class SleepStage(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(1))

        def forward(self, x):
            return Activations.apply(x) * Weights.apply(self.w)

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    stages = pipeline_stages(pp * chunks, pp, chunks, schedule)
    mine = [s for s in stages if s["rank"] == rank]
    timeline = Timeline()
    runner = PipelineRunner([SleepStage() for _ in mine], [s["stage"] for s in mine], [s["rank"] for s in stages],
                            schedule, m, lambda out, tgt: (out - tgt).pow(2).sum(), dist.group.WORLD,
                            torch.device("cpu"), True, False, 1.0, timeline)
    x = torch.randn(m, 4, requires_grad=True)  # stage 0 computes an input gradient, as its inner layers would
    idle, seconds = [], []
    for _ in range(4):
        t0 = time.perf_counter()
        runner.train_step(x, x.detach(), 1)
        seconds.append(time.perf_counter() - t0)
        idle.append(timeline.idle_fraction())
    all_idle = [None] * pp
    dist.all_gather_object(all_idle, statistics.mean(idle[1:]))
    if rank == 0:
        print(json.dumps({"idle": statistics.mean(all_idle), "step_s": statistics.median(seconds[1:])}), flush=True)
    dist.destroy_process_group()


def simulated(pp: int, schedule: str, chunks: int, m: int, ms: tuple[float, float, float]) -> dict:
    env = {**os.environ, "PP": str(pp), "SCHEDULE": schedule, "CHUNKS": str(chunks), "M": str(m), "FWD_MS": str(ms[0]),
           "INPUT_MS": str(ms[1]), "WEIGHT_MS": str(ms[2]), "PYTHONPATH": str(ROOT), "BUBBLE_RANK": "1"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={pp}", __file__],
                         env=env, capture_output=True, text=True, timeout=600)
    found = re.search(r'^(\{"idle".*\})$', out.stdout, re.M)
    if not found:
        raise RuntimeError(out.stdout[-2000:] + out.stderr[-2000:])
    return json.loads(found.group(1))


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
    args = arguments(argv, __doc__)
    m, fwd = int(args.get("microbatches", 8)), float(args.get("forward_ms", 40))
    ms = (fwd, float(args.get("input_ms", fwd)), float(args.get("weight_ms", fwd)))
    with_real = args.get("real", "1") == "1"
    print(f"m={m} microbatches; simulated rank per microbatch: forward {ms[0]:g} ms, input gradient {ms[1]:g} ms, "
          f"weight gradient {ms[2]:g} ms (separate nodes; split over the rank's chunks)")
    print(f"{'pp':>2} {'schedule':<17} {'chunks':>6} {'theory':>7} {'simulated':>9} {'step (s)':>9}"
          f"{'  real (tiny GPT)':>17}")
    for pp, schedule, chunks in CASES:
        sim = simulated(pp, schedule, chunks, m, ms)
        measured = f"{real(pp, schedule, chunks, m):>17.3f}" if with_real else ""
        print(f"{pp:>2} {schedule:<17} {chunks:>6} {theory(pp, m, schedule, chunks):>7.3f} {sim['idle']:>9.3f} "
              f"{sim['step_s']:>9.3f}{measured}", flush=True)


if __name__ == "__main__":
    if os.environ.get("BUBBLE_RANK") == "1":
        simulate_rank()
    else:
        main(sys.argv[1:])
