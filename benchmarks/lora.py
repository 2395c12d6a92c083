"""LoRA against a full fine-tune: the train step's speed, the peak memory and the checkpoint's bytes, side by side.

Variants, each the orchestrator's own train_step (forward, backward, clipping, AdamW) on its own layout of the same
weights, one process, random tokens:
  full   every weight trains (peft=none)
  lora   peft=lora: adapters of rank `rank` on the attention and MLP Linears train, the rest is frozen
Time: ROUNDS alternating rounds of STEPS steps per variant in this process (the median step time of each round; the
ratio is the median over rounds). Memory: each variant again in a fresh process, its peak RSS (VmHWM) over STEPS
steps. Checkpoint: the bytes of one checkpoint the train stage would write (storage/checkpoint.save: what trains and
its optimizer state).

    python benchmarks/lora.py [models=gpt2_124m,llama_0.5b] [rank=16] [batch=4] [seq=256] [steps=3] [rounds=3]
                              [threads=2]

`models` are the project's model configs, or llama_0.5b: Qwen2.5-0.5B's sizes in the Llama family (0.49B parameters,
without Qwen's q/k/v biases).
"""
from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.support.cli import arguments  # noqa: E402
from benchmarks.support.shapes import model_overrides  # noqa: E402
from benchmarks.support.fresh import one_spec, peak_gb, print_peak  # noqa: E402
from plugins.data.batcher import Batch  # noqa: E402
from plugins.models import get_model  # noqa: E402
from plugins.parallel.layout import build_layout  # noqa: E402
from planning.partition import build_plan  # noqa: E402
from runtime.metrics import MemoryProbe  # noqa: E402
from runtime.optim import build_optimizer  # noqa: E402
from runtime.step import StepSettings, train_step  # noqa: E402
from storage import checkpoint as ckpt  # noqa: E402
from storage.fsio import tree_bytes  # noqa: E402
from orchestrator.config.compose import compose_config  # noqa: E402

VARIANTS = ("full", "lora")


def setup(model: str, variant: str, rank: int, rows: int, seq: int):
    peft = ["peft=lora", f"peft.rank={rank}", f"peft.alpha={2 * rank}"] if variant == "lora" else []
    cfg = compose_config(*model_overrides(model), f"train.batch_size={rows}", f"train.seq_len={seq}",
                         "model.dropout=0", *peft)
    layout = build_layout(cfg, build_plan(cfg.model, cfg.parallel, cfg.peft), get_model(cfg.model.name),
                          torch.device("cpu"))
    return cfg, layout, [build_optimizer(cfg.optimizer, p) for p in layout.parts], StepSettings.of(cfg)


def steps_of(state, first: int, n: int) -> list[float]:
    cfg, layout, optimizers, settings = state
    probe, times = MemoryProbe(torch.device("cpu")), []
    for step in range(first, first + n):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1), generator=g)
        b = Batch(tokens[:, :-1], tokens[:, 1:], 1.0, 1.0)
        times.append(train_step(layout, optimizers, b, step, 1e-4, settings, probe)["step_time_s"])
    return times


def checkpoint_bytes(state) -> int:
    _, layout, optimizers, _ = state
    with tempfile.TemporaryDirectory() as tmp:
        path = ckpt.save(Path(tmp) / "step", list(zip(layout.parts, optimizers)), {"step": 1, "trainer": {}},
                         layout.aliases)
        return tree_bytes(path)


def one(spec: list) -> None:
    model, variant, rank, rows, seq, steps, threads = spec
    torch.set_num_threads(threads)
    steps_of(setup(model, variant, rank, rows, seq), 0, steps)
    print_peak()


def main(argv: list[str]) -> None:
    spec = one_spec(argv)
    if spec is not None:
        return one(spec)
    a = arguments(argv, __doc__)
    rank, rows, seq = int(a.get("rank", 16)), int(a.get("batch", 4)), int(a.get("seq", 256))
    steps, rounds, threads = int(a.get("steps", 3)), int(a.get("rounds", 3)), int(a.get("threads", 2))
    torch.set_num_threads(threads)
    print(f"batch {rows}x{seq}, {threads} thread(s), LoRA r={rank} on attention and MLP")
    print("| model | trained params full / lora | ms/step full | ms/step lora | tokens/s lora/full | peak GB full | "
          "peak GB lora | peak drop GB (the frozen weights' AdamW state) | checkpoint MB full | checkpoint MB lora (share) |"
          "\n|---|---|---|---|---|---|---|---|---|---|")
    for model in a.get("models", "gpt2_124m").split(","):
        states = {v: setup(model, v, rank, rows, seq) for v in VARIANTS}
        times, ratios = {v: [] for v in VARIANTS}, []
        for r in range(rounds):
            for v in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
                times[v].append(statistics.median(steps_of(states[v], r * 10, steps)))
            ratios.append(times["full"][-1] / times["lora"][-1])
        trained = {v: sum(p.numel() for part in states[v][1].parts for p in part.parameters() if p.requires_grad)
                   for v in VARIANTS}
        sizes = {v: checkpoint_bytes(states[v]) for v in VARIANTS}
        frozen_adamw = 2 * 4 * (trained["full"] - trained["lora"]) / 2**30  # two fp32 moments per frozen weight
        del states
        peaks = {v: peak_gb(__file__, [model, v, rank, rows, seq, steps, threads]) for v in VARIANTS}
        print(f"| {model} | {trained['full']:,} / {trained['lora']:,} | {statistics.median(times['full']) * 1e3:,.0f} | "
              f"{statistics.median(times['lora']) * 1e3:,.0f} | {statistics.median(ratios):.2f}x "
              f"({min(ratios):.2f}-{max(ratios):.2f}) | {peaks['full']:.2f} | {peaks['lora']:.2f} | "
              f"{peaks['full'] - peaks['lora']:.2f} ({frozen_adamw:.2f}) | "
              f"{sizes['full'] / 1e6:,.1f} | {sizes['lora'] / 1e6:,.1f} ({sizes['lora'] / sizes['full']:.1%}) |")


if __name__ == "__main__":
    main(sys.argv[1:])
