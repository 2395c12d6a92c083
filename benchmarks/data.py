"""Data speed, side by side in one process:

1. tokenize throughput: what the tokenize stage does per tokenizer (read the files, split, encode; bpe also trains)
   in tokens/s, and the encoding alone against the `tokenizers` library called directly on the same texts;
2. the train step with memory-mapped shards (the train stage's way) against the same corpus held in memory,
   alternating rounds (goal >= 0.98x).

    python benchmarks/data.py [paths=<glob or folder>] [vocab=2048] [rounds=6] [steps=20] [threads=2]
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
from plugins.data.batcher import encoded, tokenized  # noqa: E402
from plugins.data.registry import get_source, split_named  # noqa: E402
from plugins.data.tokenizer import make  # noqa: E402
from runtime.metrics import MemoryProbe  # noqa: E402
from plugins.models import get_model  # noqa: E402
from runtime.optim import build_optimizer  # noqa: E402
from plugins.parallel.layout import build_layout  # noqa: E402
from planning.partition import build_plan  # noqa: E402
from runtime.step import StepSettings, train_step  # noqa: E402
from tests.conftest import make_cfg  # noqa: E402


def tokenize_throughput(data_args: list[str], vocab: int) -> None:
    for tokenizer in ("bytes", "bpe"):
        cfg = make_cfg(*data_args, f"data.tokenizer={tokenizer}", f"data.vocab_size={vocab}",
                       f"model.vocab_size={max(vocab, 320)}")
        t0 = time.perf_counter()
        splits, *_ = encoded(cfg)
        stage_s = time.perf_counter() - t0
        n = sum(len(d) for docs in splits.values() for d in docs)
        train, val = split_named(get_source(cfg.data.name).documents(cfg.data), cfg.data)
        tok = make(cfg.data, train)
        t0 = time.perf_counter()
        ours = tok.encode_documents(train + val)
        ours_s = time.perf_counter() - t0
        line = f"{tokenizer:<5} stage {n / stage_s:12,.0f} tokens/s (read, split, {'train, ' if tokenizer == 'bpe' else ''}" \
               f"encode: {stage_s:.2f} s) | encode alone {sum(map(len, ours)) / ours_s:12,.0f} tokens/s"
        if tok.backend is not None:
            texts = [d.decode("utf-8", errors="replace") for d in train + val]
            t0 = time.perf_counter()
            direct = tok.backend.encode_batch(texts, add_special_tokens=False)
            direct_s = time.perf_counter() - t0
            line += f" | tokenizers directly {sum(len(e.ids) for e in direct) / direct_s:12,.0f} tokens/s " \
                    f"(ours / direct {direct_s / ours_s:.2f}x)"
        print(line, flush=True)


def memmap_vs_memory(rounds: int, steps: int) -> None:
    cfg = make_cfg("train.batch_size=16", "train.seq_len=128")
    with tempfile.TemporaryDirectory() as tmp:
        splits, vocab, pad, tok = encoded(cfg)
        shards.write(Path(tmp), splits, vocab, tok.eos, pad, tok.kind)
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
    paths = args.get("paths")
    data_args = ["data=text", f"data.paths=[{paths}]"] if paths else []
    print(f"corpus: {paths or 'the standard library (data=stdlib)'}")
    tokenize_throughput(data_args, int(args.get("vocab", 2048)))
    memmap_vs_memory(int(args.get("rounds", 6)), int(args.get("steps", 20)))


if __name__ == "__main__":
    main(sys.argv[1:])
