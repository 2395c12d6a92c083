"""Compute only where it counts: the train step, dense against sparse, torch and ort, side by side in one run.

Two batches a fine-tuner meets, random tokens, one process:
  masked   prompt/completion rows, full length, the first `masked` share of each row's labels ignored (the prompt)
  padded   one document a row, real lengths uniform so that `density` of the positions are real, padding after
Variants, each the orchestrator's own train_step (forward, backward, clipping, AdamW) on its own layout of the same
weights:
  dense    train.label_sparsity=false, padded rows kept padded: the head over every position, the blocks over padding
  sparse   train.label_sparsity=true (the head and the loss on the labelled positions only, plugins/models/
           head_loss.py) and, on padded rows, each row's real tokens packed together (plugins/data/packing.repack)
engine=ort runs the blocks' units in ONNX Runtime with the head in torch (label sparsity applies as is); its graphs
take the rows' shape and no document mask, so padded rows stay padded there.

Time: ROUNDS alternating rounds of STEPS steps per variant in this process (the median step time of each round;
the ratio is the median over rounds). Memory: each variant again in a fresh process, its peak RSS over STEPS steps
(what `top` shows; on a CPU freed memory stays in the heap, so this is the step's high-water mark).

    python benchmarks/sparsity.py [models=gpt_small,gpt2_124m] [batch=4] [seq=256] [masked=0.7] [density=0.5]
                                  [steps=3] [rounds=3] [engines=torch,ort] [threads=2]
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
from benchmarks.support.fresh import one_spec, peak_gb, print_peak  # noqa: E402
from plugins.data.batcher import Batch  # noqa: E402
from plugins.models import get_model  # noqa: E402
from plugins.parallel.layout import build_layout  # noqa: E402
from planning.partition import build_plan  # noqa: E402
from runtime.metrics import MemoryProbe  # noqa: E402
from runtime.optim import build_optimizer  # noqa: E402
from runtime.step import StepSettings, train_step  # noqa: E402
from orchestrator.config.compose import compose_config  # noqa: E402

VARIANTS = ("dense", "sparse")


def batch(kind: str, rows: int, seq: int, vocab: int, masked: float, density: float, step: int) -> Batch:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, vocab - 1, (rows, seq + 1), generator=g)
    inputs, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    if kind == "masked":
        labels[:, :int(seq * masked)] = -100
        return Batch(inputs, labels, 1.0, float((labels != -100).float().mean()))
    real = torch.randint(max(2, int(seq * (2 * density - 1))), seq + 1, (rows,), generator=g) if density > 0.5 else \
        torch.randint(2, max(3, int(2 * seq * density)), (rows,), generator=g)
    pad = torch.arange(seq)[None, :] >= real[:, None]
    inputs[pad], labels[pad] = vocab - 1, -100
    labels[torch.arange(rows), real - 1] = -100  # nothing follows a document's last token
    return Batch(inputs, labels, float((~pad).float().mean()), float((labels != -100).float().mean()),
                 real=real.numpy())


def setup(model: str, engine: str, variant: str, rows: int, seq: int, transform: str):
    cfg = compose_config(f"model={model}", f"engine={engine}", f"train.batch_size={rows}", f"train.seq_len={seq}",
                         f"train.label_sparsity={variant == 'sparse'}", "model.dropout=0", "data.packing=false")
    spec = get_model(cfg.model.name)
    layout = build_layout(cfg, build_plan(cfg.model, cfg.parallel), spec, torch.device("cpu"))
    if engine == "ort":
        from plugins.engines.ort.engine import install

        install(layout.parts, spec, Path(transform) / "ort", cfg.engine, None, torch.device("cpu"), 0)
    settings = StepSettings.of(cfg)  # repacks padded rows where the layout allows (torch, no pipeline)
    if variant == "dense" or engine == "ort":
        settings = StepSettings(settings.grad_clip, None, microbatches=1, repack_to=0)
    return cfg, layout, [build_optimizer(cfg.optimizer, p) for p in layout.parts], settings


def steps_of(state, kind: str, args: dict, first: int, n: int) -> list[float]:
    cfg, layout, optimizers, settings = state
    probe, times = MemoryProbe(torch.device("cpu")), []
    for step in range(first, first + n):
        b = batch(kind, cfg.train.batch_size, cfg.train.seq_len, cfg.model.vocab_size, args["masked"],
                  args["density"], step)
        times.append(train_step(layout, optimizers, b, step, 1e-4, settings, probe)["step_time_s"])
    return times


def transform_dir(model: str, tmp: Path, rows: int, seq: int) -> str:
    """engine=ort's graphs: the DAG run once in-process (one step), its transform stage's output."""
    from orchestrator.run import orchestrate

    args = ["cluster=debug", "tracking=none", "engine=ort", f"model={model}", "train.steps=1", "train.progress=false",
            "train.log_every=0", f"train.batch_size={rows}", f"train.seq_len={seq}", "model.dropout=0"]
    report = orchestrate(compose_config(*args, runs_dir=tmp / "runs"), tmp / "run", args)
    return str(tmp / "runs" / "cache" / "transform" / report.results["transform"].key)


def one(spec: list) -> None:
    model, engine, variant, kind, rows, seq, transform, args = spec
    torch.set_num_threads(args["threads"])
    steps_of(setup(model, engine, variant, rows, seq, transform), kind, args, 0, args["steps"])
    print_peak()


def main(argv: list[str]) -> None:
    spec = one_spec(argv)
    if spec is not None:
        return one(spec)
    a = arguments(argv, __doc__)
    args = {"masked": float(a.get("masked", 0.7)), "density": float(a.get("density", 0.5)),
            "steps": int(a.get("steps", 3)), "threads": int(a.get("threads", 2))}
    rows, seq, rounds = int(a.get("batch", 4)), int(a.get("seq", 256)), int(a.get("rounds", 3))
    engines, models = a.get("engines", "torch,ort").split(","), a.get("models", "gpt_small,gpt2_124m").split(",")
    short = {m: positions for m in models if (positions := compose_config(f"model={m}").model.max_seq_len) < seq}
    if short:  # before anything runs: a row longer than a model's positions has no position embedding to read
        print(f"seq={seq} is longer than the positions of {', '.join(f'{m} ({n})' for m, n in short.items())}; "
              f"fix: seq={min(short.values())}, or models= without {', '.join(short)}", file=sys.stderr)
        sys.exit(2)
    torch.set_num_threads(args["threads"])
    print(f"batch {rows}x{seq}, {args['threads']} thread(s); masked: {args['masked']:.0%} of labels ignored; "
          f"padded: {args['density']:.0%} of positions real")
    print("| model | engine | batch | dense ms/step | sparse ms/step | tokens/s sparse/dense | peak GB dense | "
          "peak GB sparse |\n|---|---|---|---|---|---|---|---|")
    for model in models:
        with tempfile.TemporaryDirectory() as tmp:
            for engine in engines:
                transform = transform_dir(model, Path(tmp), rows, seq) if engine == "ort" else ""
                states = {v: setup(model, engine, v, rows, seq, transform) for v in VARIANTS}
                for kind in ("masked", "padded"):
                    times, ratios = {v: [] for v in VARIANTS}, []
                    for r in range(rounds):
                        for v in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
                            times[v].append(statistics.median(steps_of(states[v], kind, args, r * 10, args["steps"])))
                        ratios.append(times["dense"][-1] / times["sparse"][-1])
                    peaks = {v: peak_gb(__file__, [model, engine, v, kind, rows, seq, transform, args])
                             for v in VARIANTS}
                    print(f"| {model} | {engine} | {kind} | {statistics.median(times['dense']) * 1e3:,.0f} | "
                          f"{statistics.median(times['sparse']) * 1e3:,.0f} | {statistics.median(ratios):.2f}x "
                          f"({min(ratios):.2f}-{max(ratios):.2f}) | {peaks['dense']:.2f} | {peaks['sparse']:.2f} |",
                          flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
