"""The train stage's own step vs a minimal hand-written loop on a CUDA GPU, per precision mode, in ONE process.

Both sides train the same registry model on the same batches (prepared on the CPU and copied to the GPU each
step, as the stage's batcher does) in the same precision:
- stage: `stages.train.train_step` on the layout the stage builds (precision, attention kernel, fused AdamW,
  global-norm clipping, metrics read back every `log_every` steps through the stage's MetricsWindow), compiled
  per block with `runtime.kernels` when the mode compiles (triton=on's default scope);
- hand loop: the batch copied through pinned memory without blocking (as nanoGPT's), forward, loss, backward,
  AdamW(fused=True) step, zero_grad; `torch.autocast` for bf16;
  `torch.compile(model)` when the mode compiles; `loss.item()` every `log_every` steps.
Rounds alternate (stage, loop, loop, stage, ...) after a warm-up round each (compilation included there); each
round is timed between two `torch.cuda.synchronize()`. Printed per mode: tokens/s of both, the ratio
stage / loop (median over rounds), MFU (6 x parameters x tokens/s over the GPU's dense peak for the mode) and
peak allocated memory.

    python benchmarks/gpu.py [model=gpt2_124m] [batch=16] [seq=1024] [steps=20] [rounds=6]
                             [modes=fp32,tf32,bf16,bf16+compile] [log_every=20] [device=cuda]
                             [overrides='model.dropout=0;triton.scope=model']
    python benchmarks/gpu.py documents=1 [model=gpt2_124m] [batch=8] [seq=2048] [steps=10] [rounds=3]

documents=1 measures the document mask instead (rows of whole documents, data.packing_strategy=bfd): the stage's
step in bf16 on rows of chat-like documents (log-normal lengths, median 300 tokens) with FlexAttention
(triton.attention=flex, what auto picks on a GPU) and with SDPA's dense mask (triton.attention=sdpa), beside the
same rows attended causally across documents (SDPA's flash kernel: the wrong loss, the speed to match). Printed:
tokens/s, the ratio to the causal rows, peak allocated memory.

`overrides` (config overrides separated by `;`) apply to both sides: what a setting such as dropout or the
compile scope costs is read as the ratio between two runs of the script.

Without a CUDA GPU it exits with status 2 and says so (`device=cpu` runs the same comparison on the CPU, to
try the script itself on a small model; its figures say nothing about GPUs).
"""
from __future__ import annotations

import logging
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.support.cli import arguments  # noqa: E402

from omegaconf import OmegaConf  # noqa: E402

from plugins.data import build_batcher  # noqa: E402
from runtime.metrics import MemoryProbe  # noqa: E402
from plugins.models import get_model  # noqa: E402
from runtime.optim import build_optimizer, describe_impl  # noqa: E402
from plugins.parallel.layout import build_layout  # noqa: E402
from planning.partition import build_plan  # noqa: E402
from runtime.precision import LossScaler, mfu, of as precision_of, peak_flops  # noqa: E402
from runtime.sdpa import attention_kernel  # noqa: E402
from runtime.metrics import MetricsWindow  # noqa: E402
from runtime.step import StepSettings, train_step  # noqa: E402
from orchestrator.config.compose import compose_config  # noqa: E402

MODES = {  # mode -> (precision, tf32, compile)
    "fp32": ("fp32", False, False), "tf32": ("fp32", True, False),
    "bf16": ("bf16", False, False), "bf16+compile": ("bf16", False, True),
}
NO_CUDA = ("benchmarks/gpu.py measures GPU training speed and needs a CUDA GPU, but torch.cuda.is_available() is "
           "False on this machine. Run it where a GPU is (e.g. `python benchmarks/gpu.py` on the cluster), or "
           "`python benchmarks/gpu.py device=cpu model=gpt_tiny seq=128` to try the script itself on the CPU.")


def config(model: str, batch: int, seq: int, mode: str, log_every: int, overrides: tuple[str, ...] = ()):
    precision, tf32, compiled = MODES[mode]
    cfg = compose_config(f"model={model}", f"train.batch_size={batch}", f"train.seq_len={seq}",
                         f"precision={precision}", f"precision.tf32={str(tf32).lower()}",
                         f"train.log_every={log_every}", "data=synthetic", *(["triton=on"] if compiled else []),
                         *(o for o in overrides if compiled or not o.startswith("triton.")))
    OmegaConf.update(cfg, "model.max_seq_len", max(seq, cfg.model.max_seq_len))
    return cfg


class StageSide:
    """The train stage's step on its own layout (one process), as stages.train.train runs it."""

    def __init__(self, cfg, device: torch.device, batches):
        self.cfg, self.device, self.batches = cfg, device, batches
        self.spec = get_model(cfg.model.name)
        self.precision = precision_of(cfg, device)
        self.probe = MemoryProbe(device)
        self.layout = build_layout(cfg, build_plan(cfg.model, cfg.parallel), self.spec, device, probe=self.probe,
                                   log=logging.getLogger("bench"))  # compiled as the stage
        self.optimizers = [build_optimizer(cfg.optimizer, p, device) for p in self.layout.parts]
        self.settings, self.scaler = StepSettings.of(cfg), LossScaler(False)
        self.window = MetricsWindow(self.layout)
        self.step = 0

    def run(self, steps: int) -> None:
        for _ in range(steps):
            batch = self.batches[self.step % len(self.batches)]
            self.window.add(train_step(self.layout, self.optimizers, batch, self.step, self.cfg.optimizer.lr,
                                       self.settings, self.probe, self.scaler))
            self.step += 1
            if self.step % self.cfg.train.log_every == 0:
                self.window.flush()

    def describe(self) -> str:
        return (f"optimizer {describe_impl(self.optimizers[0])}, attention "
                f"{attention_kernel(self.cfg.model, self.precision, self.device, self.cfg.triton.attention)}")


class HandLoop:
    """What a user writes in 20 lines."""

    def __init__(self, cfg, device: torch.device, batches):
        spec = get_model(cfg.model.name)
        model = spec.build(cfg.model)
        spec.init_weights(model, cfg.model, cfg.train.seed)
        model.to(device)
        self.model = torch.compile(model) if cfg.triton.enabled else model
        self.loss_fn, self.device, self.batches, self.log_every = spec.loss, device, batches, cfg.train.log_every
        self.opt = torch.optim.AdamW(model.parameters(), lr=cfg.optimizer.lr, betas=tuple(cfg.optimizer.betas),
                                     fused=True)
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision.name)
        self.step = 0

    def run(self, steps: int) -> None:
        for _ in range(steps):
            batch = self.batches[self.step % len(self.batches)]
            x, y = batch.inputs, batch.labels
            if self.device.type == "cuda":  # as nanoGPT's loop does: the host does not wait for the copy
                x, y = (t.pin_memory().to(self.device, non_blocking=True) for t in (x, y))
            with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None):
                logits = self.model(x)
            loss = self.loss_fn(logits, y) / batch.n_labels
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.step += 1
            if self.step % self.log_every == 0:
                loss.item()


def timed(side, steps: int, device: torch.device) -> tuple[float, float]:
    """(seconds, peak MB; 0 on the CPU) of `steps` steps, between two device synchronisations."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    if isinstance(side, StageSide):
        side.probe.peak_mb = 0.0
    t0 = time.perf_counter()
    side.run(steps)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    return seconds, peak_mb(side, device)


def peak_mb(side, device: torch.device) -> float:
    """Allocated CUDA memory at its highest since the last reset (0 on the CPU). The stage's MemoryProbe starts the
    allocator's peak afresh at each phase of a step (its figures are per phase), so the allocator alone would give
    the last phase's peak: the probe's own largest sample counts too."""
    if device.type != "cuda":
        return 0.0
    seen = torch.cuda.max_memory_allocated(device) / 2**20
    return max(seen, side.probe.peak_mb) if isinstance(side, StageSide) else seen


def bench_mode(mode: str, args: dict, device: torch.device) -> dict:
    cfg = config(args["model"], args["batch"], args["seq"], mode, args["log_every"], args["overrides"])
    batcher = build_batcher(cfg)
    batches = [batcher.train_batch(i) for i in range(8)]
    tokens = cfg.train.batch_size * cfg.train.seq_len * args["steps"]
    stage, loop = StageSide(cfg, device, batches), HandLoop(cfg, device, batches)
    n_params = sum(p.numel() for p in loop.model.parameters())
    for side in (stage, loop):  # warm-up: allocator, cuDNN/cuBLAS heuristics, compilation
        timed(side, args["steps"], device)
    times: dict[str, list[float]] = {"stage": [], "loop": []}
    peaks: dict[str, float] = {"stage": 0.0, "loop": 0.0}
    for r in range(args["rounds"]):
        order = (("stage", stage), ("loop", loop)) if r % 2 == 0 else (("loop", loop), ("stage", stage))
        for name, side in order:
            seconds, peak = timed(side, args["steps"], device)
            times[name].append(seconds)
            peaks[name] = max(peaks[name], peak)
    ratios = [b / a for a, b in zip(times["stage"], times["loop"])]  # stage tokens/s over loop tokens/s
    peak = peak_flops(device, cfg.precision.name, cfg.precision.tf32)
    out = {"mode": mode, "ratio": statistics.median(ratios), "describe": stage.describe()}
    for name in ("stage", "loop"):
        tps = tokens / statistics.median(times[name])
        out[name] = {"tokens_per_s": tps, "mfu": mfu(n_params, tps, peak), "peak_mb": peaks[name]}
    return out


def document_batches(cfg, n: int, seed: int = 0, median: int = 300) -> list:
    """Rows of whole documents as the batcher makes them: random tokens, documents of log-normal lengths (`median`
    tokens the median) laid end to end, the label after each document's last token not learned."""
    import numpy as np

    from plugins.data.batcher import Batch

    rng = np.random.default_rng(seed)
    B, T, vocab = cfg.train.batch_size, cfg.train.seq_len, cfg.model.vocab_size
    out = []
    for _ in range(n):
        documents = np.zeros((B, T + 1), dtype=np.int64)
        for r in range(B):
            at, d = 0, 0
            while at < T + 1:
                length = int(np.clip(rng.lognormal(np.log(median), 0.8), 4, T + 1))
                documents[r, at:at + length] = d
                at, d = at + length, d + 1
        tokens = torch.from_numpy(rng.integers(0, vocab, (B, T + 1)))
        labels = tokens[:, 1:].clone()
        labels[torch.from_numpy(documents[:, 1:] != documents[:, :-1])] = -100
        out.append(Batch(tokens[:, :-1].contiguous(), labels, 1.0, float((labels != -100).float().mean()),
                         documents=torch.from_numpy(documents[:, :-1].copy())))
    return out


def bench_documents(args: dict, device: torch.device) -> None:
    """The document mask's cost: the stage's bf16 step with FlexAttention and with SDPA's dense mask, beside the
    same rows attended causally across their documents."""
    from dataclasses import replace

    print(f"{'rows':<34} {'tok/s':>10} {'/causal':>8} {'peak':>7}")
    causal_tps = None
    for name, attention, with_documents in (("causal across documents (sdpa)", "sdpa", False),
                                            ("documents, flex", "flex", True),
                                            ("documents, sdpa dense mask", "sdpa", True)):
        if attention == "flex" and device.type != "cuda":
            print(f"{name:<34} {'(CUDA only: no backward on a CPU)':>27}")
            continue
        cfg = config(args["model"], args["batch"], args["seq"], "bf16", args["log_every"])
        OmegaConf.update(cfg, "triton.attention", attention)
        batches = document_batches(cfg, 4)
        if not with_documents:
            batches = [replace(b, documents=None) for b in batches]
        side = StageSide(cfg, device, batches)
        timed(side, args["steps"], device)  # warm-up: FlexAttention compiles here
        runs = [timed(side, args["steps"], device) for _ in range(args["rounds"])]
        tps = cfg.train.batch_size * cfg.train.seq_len * args["steps"] / statistics.median(r[0] for r in runs)
        causal_tps = causal_tps or tps
        print(f"{name:<34} {tps:>10,.0f} {tps / causal_tps:>8.3f} {max(r[1] for r in runs) / 1024:>6.1f}G",
              flush=True)
        del side
        if device.type == "cuda":
            torch.cuda.empty_cache()


def main(argv: list[str]) -> int:
    args = arguments(argv, __doc__)
    device = torch.device(args.get("device", "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    documents = args.get("documents", "0") == "1"
    opts = {"model": args.get("model", "gpt2_124m"), "batch": int(args.get("batch", 8 if documents else 16)),
            "seq": int(args.get("seq", 2048 if documents else 1024)),
            "steps": int(args.get("steps", 10 if documents else 20)),
            "rounds": int(args.get("rounds", 3 if documents else 6)), "log_every": int(args.get("log_every", 20)),
            "overrides": tuple(o for o in args.get("overrides", "").split(";") if o)}
    modes = args.get("modes", ",".join(MODES)).split(",")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (figures say nothing about GPUs)"
    print(f"{name}, torch {torch.__version__}; {opts['model']}, batch {opts['batch']} x {opts['seq']}; "
          f"{opts['rounds']} alternating rounds of {opts['steps']} steps after a warm-up round"
          f"{'; ' + ' '.join(opts['overrides']) if opts['overrides'] else ''}", flush=True)
    if documents:
        bench_documents(opts, device)
        return 0
    print(f"{'mode':<13} {'stage tok/s':>12} {'loop tok/s':>12} {'stage/loop':>10} {'stage MFU':>9} {'loop MFU':>9} "
          f"{'stage peak':>11} {'loop peak':>10}  stage runs")
    for mode in modes:
        r = bench_mode(mode, opts, device)
        s, lp = r["stage"], r["loop"]

        def pct(x):
            return f"{x:.1%}" if x is not None else "-"

        def gb(mb):
            return f"{mb / 1024:.1f}GB" if mb else "-"

        print(f"{mode:<13} {s['tokens_per_s']:>12,.0f} {lp['tokens_per_s']:>12,.0f} {r['ratio']:>10.3f} "
              f"{pct(s['mfu']):>9} {pct(lp['mfu']):>9} {gb(s['peak_mb']):>11} {gb(lp['peak_mb']):>10}  "
              f"{r['describe']}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print("goal: stage/loop >= 0.97 in every mode; bf16+compile MFU >= 40% on an H100")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
