"""Train-stage throughput vs a minimal hand-written PyTorch loop: same model, data, batch and threads.

The orchestrator's train stage runs exactly as in `python -m orchestrator` (MLflow tracking, metrics
history, progress bar, log lines, gradient clipping, LR schedule), minus periodic eval/checkpoints
(its final evaluation is left out of the timing); its tokens/s is
taken from the wall-clock stamps of its own per-step records, so everything between steps is counted.
The hand-written loop is forward, backward, optimizer step, zero_grad on the same batches, stamped the
same way. The two run alternately, ROUNDS times, in this one process. Per round, each side's step time is
the median of its per-step wall-clock intervals (robust to bursts of steal time on a shared VM) and,
for comparison, the mean; the ratios printed are the medians over rounds.

    python benchmarks/train_throughput.py [model=gpt_tiny] [steps=30] [rounds=12] [threads=2]
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.support.cli import arguments  # noqa: E402

from orchestrator.config.resolve import resolve_auto  # noqa: E402
from orchestrator.tracking.stage_tracker import MlflowStageTracker  # noqa: E402
from orchestrator.tracking.tracker import Invocation  # noqa: E402
from plugins.data import build_batcher  # noqa: E402
from storage.fsio import atomic_write_json  # noqa: E402
from plugins.models import get_model  # noqa: E402
from planning.partition import build_plan  # noqa: E402
from stages.base import StageContext  # noqa: E402
from stages.tokenize import tokenize  # noqa: E402
from stages.train import train  # noqa: E402
from orchestrator.config.compose import compose_config  # noqa: E402

WARMUP = 5


def step_seconds(stamps: list[float], evaluated: frozenset = frozenset()) -> tuple[float, float]:
    """(median, mean) interval between consecutive step-end stamps, warm-up steps excluded, and so are
    intervals that end in an evaluation (the stage evaluates after its last step; the loop does not)."""
    deltas = [b - a for i, (a, b) in enumerate(zip(stamps, stamps[1:]), start=1) if i > WARMUP and i not in evaluated]
    return statistics.median(deltas), statistics.mean(deltas)


def stage_inputs(cfg, workdir: Path) -> dict[str, Path]:
    """What the train stage reads: the tokenize stage's shards and the transform stage's partition plan."""
    inputs = {"tokenize": workdir / "tokenize", "transform": workdir / "transform"}
    for folder in inputs.values():
        folder.mkdir(parents=True, exist_ok=True)
    tokenize(StageContext(cfg=cfg, inputs={}, out=inputs["tokenize"], scratch=workdir, key="bench"))
    atomic_write_json(inputs["transform"] / "partition_plan.json", build_plan(cfg.model, cfg.parallel))
    return inputs


def orchestrator_round(cfg, workdir: Path, inputs: dict[str, Path], invocation: Invocation) -> tuple[float, float]:
    out, scratch = Path(tempfile.mkdtemp(dir=workdir)), Path(tempfile.mkdtemp(dir=workdir))
    run_id = invocation.start_stage("train", "bench", {}, {})
    tracker = MlflowStageTracker(invocation.uri, run_id, 200)
    train(StageContext(cfg=cfg, inputs=inputs, out=out, scratch=scratch, key="bench", tracker=tracker))
    tracker.flush()
    invocation.end_run(run_id, "FINISHED")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return step_seconds([r["time"] for r in rows], frozenset(i for i, r in enumerate(rows) if "eval_loss" in r))


def handwritten_round(cfg, inputs: dict[str, Path]) -> tuple[float, float]:
    spec = get_model(cfg.model.name)
    model = spec.build(cfg.model)
    spec.init_weights(model, cfg.model, cfg.train.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optimizer.lr, fused=True)
    batcher = build_batcher(cfg, inputs["tokenize"] / "tokens")  # the same shards as the stage
    stamps = []
    for step in range(cfg.train.steps):
        batch = batcher.train_batch(step)
        loss = spec.loss(model(batch.inputs), batch.labels) / batch.n_labels
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        stamps.append(time.time())
    return step_seconds(stamps)


def main(argv: list[str]) -> None:
    args = arguments(argv, __doc__)
    model, steps = args.get("model", "gpt_tiny"), int(args.get("steps", 30))
    rounds, threads = int(args.get("rounds", 12)), int(args.get("threads", 2))
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        cfg = compose_config(f"model={model}", f"train.steps={steps}", "train.eval_every=0", "train.checkpoint_every=0",
                             runs_dir=workdir / "runs")
        resolve_auto(cfg)  # precision=auto -> this machine's choice, as the orchestrator does before a run
        invocation = Invocation(cfg, "benchmark", {})
        inputs = stage_inputs(cfg, workdir)
        print(f"{model}, batch {cfg.train.batch_size} x {cfg.train.seq_len} tokens, {steps} steps "
              f"({WARMUP} warm-up), {threads} threads, {rounds} alternating rounds")
        tokens = cfg.train.batch_size * cfg.train.seq_len
        by_median, by_mean = [], []
        for r in range(rounds):
            first_orch = r % 2 == 0  # alternate the order to cancel drift
            a = orchestrator_round(cfg, workdir, inputs, invocation) if first_orch else None
            b = handwritten_round(cfg, inputs)
            a = a if first_orch else orchestrator_round(cfg, workdir, inputs, invocation)
            by_median.append(b[0] / a[0])
            by_mean.append(b[1] / a[1])
            print(f"round {r + 1:2d}: orchestrator {tokens / a[0]:,.0f} tok/s | hand-written {tokens / b[0]:,.0f} tok/s"
                  f" | ratio {by_median[-1]:.3f} (means: {by_mean[-1]:.3f})", flush=True)
        print(f"throughput ratio orchestrator / hand-written, median over {rounds} rounds: "
              f"{statistics.median(by_median):.3f} per-step medians, {statistics.median(by_mean):.3f} per-step means "
              f"(goal >= 0.97)")


if __name__ == "__main__":
    main(sys.argv[1:])
