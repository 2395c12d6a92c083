"""What preference tuning costs, three ways:

  head   the label-sparse head's per-row log-probabilities (a DPO step's input: its backward computes each chunk's
         logits again) against the SFT loss through the same head, forward and backward over the same labelled
         positions, alternating in one process
  step   a DPO train step (runtime/step.py: forward, backward, clipping, AdamW) with the reference log-probabilities
         cached (read with the batch: objective.reference=cached) against the same step with the reference model
         online (a frozen copy of the model beside the policy, one more forward of the batch's rows: the train stage's
         objective.reference=online), alternating rounds in one process on a model config; each variant's peak RSS
         alone in a fresh process
  sweep  a 4-point beta sweep (`-m objective.beta=...`) through the orchestrator on the walk-through's tiny Llama and
         arithmetic pairs: the reference stage runs for the first point and is a cache hit for the others; the rows
         it scores against those an online reference would score (every step's and evaluation's rows, each point)

    python benchmarks/preference.py [part=head,step,sweep] [rows=8] [seq_len=512] [learned=0.5] [d_model=768]
                                    [vocab=50257] [chunk=1024] [rounds=5] [threads=0]
                                    [model=gpt2_124m] [batch=4] [seq=256] [steps=3]      (step)
                                    [betas=0.05,0.1,0.2,0.5] [sweep_steps=20]           (sweep)

head's sizes default to gpt2_124m's head and a batch of 8 rows (4 pairs) whose completions are half of each row;
step's to gpt2_124m, 2 pairs of 256 tokens, half learned. threads=0 keeps torch's own count.
"""
from __future__ import annotations

import json
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.support.cli import arguments  # noqa: E402
from benchmarks.support.fresh import one_spec, peak_gb, print_peak  # noqa: E402

VARIANTS = ("cached", "online")


def head(a: dict) -> None:
    import torch

    from plugins.models.head_loss import IGNORED, head_loss, row_logprobs
    from plugins.objectives.dpo import pair_losses

    rows, seq_len, d, vocab = int(a.get("rows", 8)), int(a.get("seq_len", 512)), int(a.get("d_model", 768)), \
        int(a.get("vocab", 50257))
    chunk, rounds, learned = int(a.get("chunk", 1024)), int(a.get("rounds", 5)), float(a.get("learned", 0.5))
    if rows % 2:
        sys.exit(f"error: rows={rows}: preference pairs take an even number of rows (chosen, rejected)")
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, seq_len, d, generator=g, requires_grad=True)
    weight = (torch.randn(vocab, d, generator=g) * 0.02).requires_grad_()
    labels = torch.randint(0, vocab, (rows, seq_len), generator=g)
    labels[:, :int(seq_len * (1 - learned))] = IGNORED  # the prompt: not learned
    reference = -torch.rand(rows, generator=g, dtype=torch.float64) * 100

    def sft() -> None:
        head_loss(hidden, weight, labels, vocab, chunk).backward()

    def dpo() -> None:
        loss, _ = pair_losses(row_logprobs(hidden, weight, labels, vocab, chunk), reference, 0.1, "sigmoid")
        loss.backward()

    times: dict[str, list[float]] = {"sft": [], "dpo": []}
    for _ in range(rounds + 1):  # the first round warms up
        for name, step in (("sft", sft), ("dpo", dpo)):
            hidden.grad = weight.grad = None
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    positions = int((labels != IGNORED).sum())
    sft_s, dpo_s = (statistics.median(times[k][1:]) for k in ("sft", "dpo"))
    print(f"head {vocab} x {d}, {rows} rows x {seq_len}, {positions:,} labelled positions, chunk {chunk}, "
          f"{torch.get_num_threads()} thread(s), median of {rounds}")
    print(f"  sft loss (gradients in the forward)       {sft_s * 1e3:8.1f} ms")
    print(f"  dpo per-row log-probs (backward recomputes) {dpo_s * 1e3:6.1f} ms   {dpo_s / sft_s:.2f}x the sft head")
    print(f"  peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:,.0f} MB "
          f"(weights and their gradient {2 * vocab * d * 4 / 2**20:,.0f} MB)")


def setup(model: str, variant: str, rows: int, seq: int):
    """The policy's layout and optimizer, the pairs' batch (half of each row learned), and the batch's reference
    source: fixed values (cached), or a frozen reference layout's forward of the rows (online), as the train stage
    builds them."""
    import torch

    from orchestrator.config.compose import compose_config
    from planning.partition import without_adapters
    from plugins.data.batcher import Batch
    from plugins.models import get_model
    from plugins.objectives.dpo import DPOLoss
    from plugins.objectives.reference import ReferenceRows
    from plugins.parallel.layout import build_layout
    from runtime.evaluate import row_logps
    from runtime.optim import build_optimizer
    from runtime.step import StepSettings

    cfg = compose_config(f"model={model}", f"train.batch_size={rows}", f"train.seq_len={seq}", "model.dropout=0",
                         "objective=dpo", "data=preference", "data.paths=[unused.jsonl]")
    spec = get_model(cfg.model.name)
    policy = build_layout(*without_adapters(cfg), spec, torch.device("cpu"), objective=DPOLoss(0.1, "sigmoid"))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (rows, seq + 1), generator=g)
    labels = tokens[:, 1:].clone()
    labels[:, :seq // 2] = -100  # the prompt
    batch = Batch(tokens[:, :-1], labels, 1.0, 0.5, real=torch.full((rows,), seq).numpy())
    if variant == "online":
        frozen = build_layout(*without_adapters(cfg), spec, torch.device("cpu"), objective=ReferenceRows())
        for part in frozen.parts:
            part.requires_grad_(False)
        reference = lambda: row_logps(frozen, batch)  # noqa: E731
    else:
        values = -torch.rand(rows, generator=g, dtype=torch.float64) * 100
        reference = lambda: values  # noqa: E731
    return cfg, policy, [build_optimizer(cfg.optimizer, p) for p in policy.parts], StepSettings.of(cfg), batch, \
        reference


def steps_of(state, first: int, n: int) -> list[float]:
    """Seconds of each step, the reference's forward (online) included."""
    import torch

    from runtime.metrics import MemoryProbe
    from runtime.step import train_step

    cfg, layout, optimizers, settings, batch, reference = state
    probe, times = MemoryProbe(torch.device("cpu")), []
    for step in range(first, first + n):
        t0 = time.perf_counter()
        batch.row_inputs = reference()
        train_step(layout, optimizers, batch, step, 1e-5, settings, probe)
        times.append(time.perf_counter() - t0)
    return times


def one(spec: list) -> None:
    import torch

    model, variant, rows, seq, steps, threads = spec
    torch.set_num_threads(threads)
    steps_of(setup(model, variant, rows, seq), 0, steps)
    print_peak()


def step(a: dict) -> None:
    import torch

    model, rows, seq = a.get("model", "gpt2_124m"), int(a.get("batch", 4)), int(a.get("seq", 256))
    steps, rounds = int(a.get("steps", 3)), int(a.get("rounds", 3))
    threads = int(a.get("threads", 0)) or torch.get_num_threads()
    torch.set_num_threads(threads)
    states = {v: setup(model, v, rows, seq) for v in VARIANTS}
    times, ratios = {v: [] for v in VARIANTS}, []
    for r in range(rounds + 1):  # round 0 warms up
        for v in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
            times[v].append(statistics.median(steps_of(states[v], r * 10, steps)))
        if r:
            ratios.append(times["online"][-1] / times["cached"][-1])
    del states
    peaks = {v: peak_gb(__file__, [model, v, rows, seq, steps, threads]) for v in VARIANTS}
    tokens = rows * seq
    print(f"DPO step on {model}, {rows // 2} pairs x {seq} tokens (half learned), {threads} thread(s), "
          f"median of {rounds} rounds of {steps} steps")
    for v in VARIANTS:
        s = statistics.median(times[v][1:])
        print(f"  reference {v:6s}  {s * 1e3:8,.0f} ms/step  {tokens / s:8,.0f} tokens/s  peak RSS {peaks[v]:.2f} GB")
    print(f"  cached / online: {statistics.median(ratios):.2f}x tokens/s ({min(ratios):.2f}-{max(ratios):.2f}); "
          f"online holds {peaks['online'] - peaks['cached']:+.2f} GB more (the frozen copy)")


def sweep(a: dict) -> None:
    """The orchestrator's -m sweep over beta in a temporary folder; rows counted from what the runs wrote."""
    betas, steps = a.get("betas", "0.05,0.1,0.2,0.5"), int(a.get("sweep_steps", 20))
    batch, eval_batches = 8, 2
    with tempfile.TemporaryDirectory(prefix="preference-sweep-") as tmp:
        work = Path(tmp)
        subprocess.run([sys.executable, str(ROOT / "scripts" / "tiny_chat_model.py"), "tiny-llama", "--pairs",
                        "pairs.jsonl", "--records", "200"], cwd=work, check=True, capture_output=True)
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "orchestrator", "-m", "objective=dpo", f"objective.beta={betas}",
                               "data=preference", "data.paths=[pairs.jsonl]", "model=llama_tiny",
                               "train.init_from=hf:tiny-llama", f"train.steps={steps}", f"train.batch_size={batch}",
                               "train.seq_len=32", f"train.eval_every={steps}", f"train.eval_batches={eval_batches}",
                               "tracking=none", "aggregate.onnx=false"], cwd=work, capture_output=True, text=True,
                              env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "COLUMNS": "200"})
        seconds = time.perf_counter() - t0
        if done.returncode:
            sys.exit(done.stdout[-3000:] + done.stderr[-3000:])
        ran = len(re.findall(r"^│ reference\s+│ ran", done.stdout, re.M))
        hits = len(re.findall(r"^│ reference\s+│ cached", done.stdout, re.M))
        (entry,) = (work / "runs" / "cache" / "reference").iterdir()
        scored = json.loads((entry / "reference.json").read_text())["rows"]
    points = len(betas.split(","))
    online = points * (steps + 2 * eval_batches) * batch  # each step's rows; the evaluation's and the final check's
    print(f"a {points}-point beta sweep ({betas}), {steps} steps of {batch} rows each, in {seconds:.0f} s: the "
          f"reference stage ran {ran}x and was a cache hit {hits}x; it scored {scored:,} rows (every pair of both "
          f"splits, once); an online reference would score about {online:,} rows ({points} points x each step's and "
          f"evaluation's rows)")


def main(argv: list[str]) -> None:
    spec = one_spec(argv)
    if spec is not None:
        return one(spec)
    a = arguments(argv, __doc__)
    if int(a.get("threads", 0)):
        import torch

        torch.set_num_threads(int(a["threads"]))
    parts = {"head": head, "step": step, "sweep": sweep}
    for part in a.get("part", "head,step,sweep").split(","):
        if part not in parts:
            sys.exit(f"error: part={part}: one of {', '.join(parts)}")
        parts[part](a)


if __name__ == "__main__":
    main(sys.argv[1:])
