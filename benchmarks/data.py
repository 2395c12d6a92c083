"""The train step with memory-mapped shards (the train stage's way, several parts read as one stream) against the
same corpus held in memory, alternating rounds in one process (goal >= 0.98x). The tokenize stage's own speed and
memory at corpus scale: benchmarks/data_scale.py.

    python benchmarks/data.py [rounds=6] [steps=20] [threads=2] [tasks=2]
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.support.cli import arguments  # noqa: E402

from plugins.data import Batcher, shards  # noqa: E402
from plugins.data.batcher import tokenized  # noqa: E402
from plugins.data.corpus import build_tokenizer, corpus_layout, write_part  # noqa: E402
from runtime.metrics import MemoryProbe  # noqa: E402
from plugins.models import get_model  # noqa: E402
from runtime.optim import build_optimizer  # noqa: E402
from plugins.parallel.layout import build_layout  # noqa: E402
from planning.partition import build_plan  # noqa: E402
from runtime.step import StepSettings, train_step  # noqa: E402
from orchestrator.config.compose import compose_config  # noqa: E402


def memmap_vs_memory(rounds: int, steps: int, tasks: int) -> None:
    cfg = compose_config("train.batch_size=16", "train.seq_len=128")
    with tempfile.TemporaryDirectory() as tmp:
        lay = corpus_layout(cfg)
        tok = build_tokenizer(cfg, [(cfg, lay)])
        for task in range(tasks):  # the parts `tasks` processes of the stage write
            write_part(cfg, lay, tok, Path(tmp), task, tasks)
        parts = [shards.part_name(t) for t in range(tasks)]
        shards.write_index(Path(tmp), parts, tok.vocab_size, tok.eos, tok.pad, tok.kind)
        batchers = {"memmap": Batcher(shards.read(Path(tmp), True), 16, 128, 1234),
                    "memory": Batcher(tokenized(cfg), 16, 128, 1234)}
        spec = get_model(cfg.model.name)
        layout = build_layout(cfg, build_plan(cfg.model, cfg.parallel), spec, torch.device("cpu"))
        optimizers = [build_optimizer(cfg.optimizer, layout.parts[0])]
        settings, probe = StepSettings.of(cfg), MemoryProbe(torch.device("cpu"))
        times: dict[str, list[float]] = {k: [] for k in batchers}
        step = 0
        for r in range(rounds + 1):
            for name in (("memmap", "memory") if r % 2 else ("memory", "memmap")):
                t0 = time.perf_counter()
                for _ in range(steps):
                    row = train_step(layout, optimizers, batchers[name].train_batch(step), step, 1e-4, settings, probe)
                    row["loss"].item()
                    step += 1
                if r:  # round 0 warms up both
                    times[name].append(time.perf_counter() - t0)
        tokens = 16 * 128 * steps
        ratio = statistics.median(b / a for a, b in zip(times["memmap"], times["memory"]))
        print(f"train step, gpt_tiny 16x128: memory-mapped shards {tokens / statistics.median(times['memmap']):,.0f} "
              f"tokens/s, in memory {tokens / statistics.median(times['memory']):,.0f} tokens/s; memmap / memory "
              f"{ratio:.3f} (median of {rounds} alternating rounds of {steps} steps; goal >= 0.98)")


def main(argv: list[str]) -> None:
    args = arguments(argv, __doc__)
    torch.set_num_threads(int(args.get("threads", 2)))
    memmap_vs_memory(int(args.get("rounds", 6)), int(args.get("steps", 20)), int(args.get("tasks", 2)))


if __name__ == "__main__":
    main(sys.argv[1:])
