"""train: the training loop on every rank of the layout, resumable from its latest complete checkpoint.

Everything a step depends on is a function of the step number (global batch, learning rate, dropout seed)
or is in the checkpoint (parameters, optimizer state), so a run killed at any moment and resumed produces
the same losses as one that never stopped; and the global batch and the loss normalisation (sum over the
batch's labels / their count) do not depend on the layout, so every layout computes the same losses.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from storage import checkpoint as ckpt
from runtime import preemption
from storage import hf
from plugins.data import build_batcher
from runtime.kernels import KernelReport, apply_kernels
from storage.fsio import atomic_write_json, link_tree, read_json, remove_tree
from runtime.metrics import MemoryProbe, MetricsLog, plot_loss_curve, plot_pipeline_timeline
from plugins.models import get_model
from plugins.models.registry import vocab_rows
from runtime.optim import build_optimizer, describe_impl, lr_factor, set_lr
from plugins.parallel.layout import Layout, build_layout
from plugins.parallel.mesh import pick_device
from runtime.profiling import StepProfiler
from runtime.precision import LossScaler, build_scaler, configure as configure_precision, mfu, peak_flops
from runtime.sdpa import attention_kernel
from stages.base import Resources, Stage, StageContext

WARMUP_STEPS_EXCLUDED = 3  # first steps of an attempt are slower (allocator, caches): not in tokens/s
FLUSH_EVERY = 50            # metrics are read back from the device at least this often when train.log_every=0


@dataclass(frozen=True)
class StepSettings:
    """What a step reads, resolved once: config lookups cost microseconds each in the hot loop."""
    grad_clip: float            # inf: measure the norm, clip nothing
    dropout_seed: Optional[int]  # reseed per step (resume-exact dropout masks); None when there is no dropout
    skip_nonfinite: bool = False  # check every step's gradient norm (one read per step) and drop non-finite ones

    @staticmethod
    def of(cfg) -> "StepSettings":
        return StepSettings(cfg.train.grad_clip if cfg.train.grad_clip > 0 else math.inf,
                            cfg.train.seed if cfg.model.dropout > 0 else None, cfg.train.nonfinite == "skip")


class Diverged(RuntimeError):
    """Training produced a non-finite loss or gradient norm; the checkpoints written so far are intact."""


def train(ctx: StageContext) -> None:
    cfg, t = ctx.cfg, ctx.cfg.train
    plan = read_json(ctx.inputs["transform"] / "partition_plan.json")
    device = pick_device()
    precision = configure_precision(cfg, device)
    probe = MemoryProbe(device)
    spec = get_model(cfg.model.name)
    layout = build_layout(cfg, plan, spec, device, probe=probe, timeline=cfg.parallel.pp > 1, precision=precision)
    fallbacks = _apply_engine(ctx, layout, spec, device)
    kernels = apply_kernels(layout.parts, spec, cfg.triton, ctx.log, cuda=device.type == "cuda")
    optimizers = [build_optimizer(cfg.optimizer, part, device) for part in layout.parts]
    parts = list(zip(layout.parts, optimizers))
    scaler = build_scaler(cfg)
    batcher = build_batcher(cfg, ctx.inputs["tokenize"] / "tokens")
    control = _control_group(layout)

    checkpoints = ctx.scratch / "checkpoints"
    history = MetricsLog(ctx.scratch / "metrics.jsonl")
    if not t.resume and ctx.is_rank0:
        remove_tree(checkpoints)
        history.path.unlink(missing_ok=True)
    _barrier(layout)
    start = _restore(ctx, layout, parts, checkpoints, t.init_from, scaler)
    if ctx.is_rank0:
        # an interrupted attempt's curve, so that this record is complete; a requeued job logs into the run its
        # first attempt used, which already holds part of it
        logged = ctx.tracker.last_step("loss") or 0
        for row in history.truncate(after_step=start):
            if row["step"] > logged:
                ctx.tracker.log_metrics(_numeric(row), step=row["step"])

    meta = {"trainer": {"world_size": layout.coords.world_size, **{k: plan["layout"][k] for k in ("dp", "hp", "pp")},
                        "dp_mode": plan["layout"]["dp_mode"], "optimizer": cfg.optimizer.name, "seed": t.seed,
                        "precision": precision.name},
            "config_key": ctx.key, "partition_plan": plan}

    def save(step: int) -> None:
        if ctx.is_rank0:
            history.sync()
        ckpt.save(ckpt.step_dir(checkpoints, step), parts, {**meta, "step": step, "loss_scaler": scaler.state_dict()},
                  layout.aliases)
        ckpt.prune(checkpoints, keep=max(t.keep_checkpoints, 1))

    settings = StepSettings.of(cfg)
    lrs = [cfg.optimizer.lr * lr_factor(cfg.optimizer, step, t.steps) for step in range(t.steps)]
    steps, eval_every, log_every, checkpoint_every = t.steps, t.eval_every, t.log_every, t.checkpoint_every
    flush_every = log_every or FLUSH_EVERY
    window = MetricsWindow(layout)
    profiler = StepProfiler(list(t.profile), ctx.is_rank0 or t.profile_ranks == "all", device, ctx.scratch / "profile",
                            ctx.rank)
    timed_tokens, timed_s = 0, 0.0
    skipped_in_a_row = 0
    with _progress(ctx, steps) as progress:
        task = progress.add_task("train", total=steps, completed=start, loss=float("nan"))
        for step in range(start, steps):
            profiler.step_begins(step + 1)
            window.add(train_step(layout, optimizers, batcher.train_batch(step), step, lrs[step], settings, probe,
                                  scaler))
            done = step + 1
            profiler.step_ended(done)
            if profiler.trace is not None:
                _report_profile(ctx, profiler)
            skipped_in_a_row = skipped_in_a_row + 1 if window.rows[-1].get("skipped") else 0
            if step == start and kernels.compiled:  # the first step of an attempt compiles (or loads the cache)
                _report_kernels(ctx, kernels, window.last_step_time())
            # a window ends with the warm-up: its queued GPU work is timed with its own steps, not the timed ones
            warmed_up = done - start == WARMUP_STEPS_EXCLUDED
            evaluating = done == steps or bool(eval_every and done % eval_every == 0)
            saved = done == steps or bool(checkpoint_every and done % checkpoint_every == 0)
            reason = preemption.stop_requested(bool(layout.world), control) if done < steps else None
            stalled = skipped_in_a_row >= t.max_nonfinite_skips
            if evaluating or saved or reason or stalled or warmed_up or done % flush_every == 0:
                rows = window.flush()  # the only read-back from the device outside evaluation and fp16
                diverged = _first_nonfinite(rows) or (rows[-1] if stalled else None)
                if evaluating and not diverged:
                    rows[-1]["eval_loss"] = evaluate(layout, batcher, t.eval_batches)
                for row in rows:
                    if row["step"] - start > WARMUP_STEPS_EXCLUDED:
                        timed_tokens += row["tokens"]
                        timed_s += row["step_time_s"]
                    if ctx.is_rank0:
                        history.append(row)
                        ctx.tracker.log_metrics(_numeric(row), step=row["step"])
                        if log_every and (row["step"] % log_every == 0 or row["step"] == steps):
                            progress.console.print(_line(row, steps), soft_wrap=True)
                if ctx.is_rank0:
                    progress.update(task, completed=done, loss=rows[-1]["loss"])
                if diverged:
                    history.close()
                    raise Diverged(_divergence(diverged, done, skipped_in_a_row, cfg, checkpoints))
            elif ctx.is_rank0:
                progress.update(task, completed=done)
            if saved or reason:
                save(done)
            if reason:
                history.close()
                ctx.tracker.set_tags({"preempted_at_step": done})
                raise preemption.Preempted(done, reason)
    history.close()
    timeline = _gather_timeline(layout)
    peak_mb, growth_mb = layout.reduce(torch.tensor([probe.peak_mb, probe.peak_mb - probe.baseline_mb],
                                                    dtype=torch.float64), dist.ReduceOp.MAX).tolist()
    if not ctx.is_rank0:
        return

    if start == steps:  # an earlier attempt finished training and saved its last checkpoint
        ctx.log.info("training had already reached step %d: publishing its results", steps)
    link_tree(ckpt.step_dir(checkpoints, steps), ctx.out / "checkpoint")
    if (ctx.scratch / "profile").is_dir():  # every rank's traces (they share the scratch folder on one machine)
        link_tree(ctx.scratch / "profile", ctx.out / "profile")
    rows = history.rows()
    (ctx.out / "metrics.jsonl").write_text(history.path.read_text())
    tokens_per_s = timed_tokens / timed_s if timed_s else None
    peak = peak_flops(device, precision.name, cfg.precision.tf32)
    summary = {"steps": steps, "resumed_from_step": start, "final_loss": rows[-1]["loss"],
               "final_eval_loss": rows[-1]["eval_loss"], "tokens_per_s": tokens_per_s,
               "n_parameters": plan["n_parameters"], "layout": plan["layout"], "engine": cfg.engine.name,
               "engine_fallbacks": fallbacks, "compiled": {"blocks": len(kernels.compiled),
                                                           "eager_fallbacks": kernels.fallbacks},
               "precision": precision.name, "tf32": bool(cfg.precision.tf32 and device.type == "cuda"),
               "device": _device_name(device), "mfu": mfu(plan["n_parameters"], tokens_per_s, peak),
               "peak_flops": peak, "peak_memory_mb": peak_mb, "memory_kind": probe.kind,
               "peak_memory_growth_mb": growth_mb,  # the worst rank's: peak minus what it held before the model
               "optimizer_impl": describe_impl(optimizers[0]),
               "attention_kernel": attention_kernel(cfg.model, precision, device, cfg.triton.attention),
               "loss_scaler": scaler.state_dict() if scaler.enabled else None}
    atomic_write_json(ctx.out / "summary.json", summary)
    title = f"{cfg.model.name} {plan['n_parameters']:,} params, dp{layout.coords.dp_size} hp{layout.coords.hp_size} " \
            f"pp{layout.coords.pp_size}, {precision.name}"
    artifacts = [plot_loss_curve(rows, ctx.out / "loss_curve.png", title), ctx.out / "metrics.jsonl",
                 ctx.out / "summary.json"]
    if timeline:
        atomic_write_json(ctx.out / "pipeline_timeline.json", timeline)
        artifacts.append(plot_pipeline_timeline(timeline, ctx.out / "pipeline_timeline.png",
                                                f"{cfg.parallel.pp_schedule}, pp={cfg.parallel.pp}, "
                                                f"{cfg.parallel.microbatches} microbatches (last step)"))
    ctx.tracker.log_metrics({"final_eval_loss": summary["final_eval_loss"], "memory/peak_mb": peak_mb,
                             **({"mfu": summary["mfu"]} if summary["mfu"] is not None else {})})
    ctx.tracker.set_tags({"precision": precision.name, "attention_kernel": summary["attention_kernel"],
                          "optimizer_impl": summary["optimizer_impl"]})
    for artifact in artifacts:
        if artifact:
            ctx.tracker.log_artifact(artifact)


def _first_nonfinite(rows: list[dict]) -> Optional[dict]:
    """The first step whose loss or gradient norm is not finite and whose update was not dropped (stop mode)."""
    return next((r for r in rows if not r.get("skipped") and not (math.isfinite(r["loss"]) and
                                                                  math.isfinite(r["grad_norm"]))), None)


def _divergence(row: dict, done: int, in_a_row: int, cfg, checkpoints: Path) -> str:
    good = ckpt.complete_checkpoints(checkpoints)
    last = f"the checkpoint of step {good[-1][0]} (written before; intact)" if good else "none (no checkpoint yet)"
    what = (f"{in_a_row} steps in a row without a finite gradient (train.max_nonfinite_skips="
            f"{cfg.train.max_nonfinite_skips}), the last at step {row['step']}" if row.get("skipped") else
            f"loss {row['loss']} and gradient norm {row['grad_norm']} at step {row['step']}")
    return (f"training diverged: {what}; stopped at step {done} without saving. Last good checkpoint: {last}. "
            f"Fix: a lower optimizer.lr (now {cfg.optimizer.lr}), gradient clipping (train.grad_clip, now "
            f"{cfg.train.grad_clip}), precision=bf16 or fp32 instead of fp16 (now {cfg.precision.name}), or "
            f"train.nonfinite=skip to drop such steps")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _control_group(layout: Layout):
    """A CPU (gloo) group for the per-step stop flag: a collective on the GPU's stream would make every step wait
    for the device. None for one process; the default group where it is gloo already."""
    if not layout.world or dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo")


def _report_profile(ctx: StageContext, profiler: StepProfiler) -> None:
    """The trace goes with the train output (rank 0's) and to MLflow; the top ops into the log."""
    trace, profiler.trace = profiler.trace, None
    ctx.log.info("profile of steps %d-%d: %s\n%s", profiler.first, profiler.last, trace, profiler.top)
    if ctx.is_rank0:
        ctx.tracker.log_artifact(trace, "profile")


def _report_kernels(ctx: StageContext, kernels: KernelReport, first_step_s: float) -> None:
    metrics = {**kernels.metrics(), "compile/first_step_s": first_step_s}
    ctx.log.info("triton: first step %.1f s (compiled forwards %.1f s); Inductor cache hits %d, misses %d%s",
                 first_step_s, metrics["compile/first_forward_s"], metrics["compile/fx_graph_cache_hits"],
                 metrics["compile/fx_graph_cache_misses"],
                 f"; uncompiled: {', '.join(kernels.fallbacks)}" if kernels.fallbacks else "")
    ctx.tracker.log_metrics(metrics)
    if kernels.fallbacks:
        ctx.tracker.set_tags({f"triton.eager.{name.replace(' ', '_')}": why[:4000]
                              for name, why in kernels.fallbacks.items()})


def _apply_engine(ctx: StageContext, layout: Layout, spec, device) -> dict[str, str]:
    """engine=ort: run every block's units in ONNX Runtime; returns {unit: why it runs on torch instead}."""
    if ctx.cfg.engine.name != "ort":
        return {}
    from plugins.engines.ort.engine import graph_files, install

    ort_dir = ctx.inputs["transform"] / "ort"
    hp_group = layout.mesh.get_group("hp") if layout.coords.hp_size > 1 else None
    fallbacks = install(layout.parts, spec, ort_dir, ctx.cfg.engine, hp_group, device, ctx.rank)
    for unit, why in fallbacks.items():
        ctx.log.warning("engine=ort: unit %s runs on torch (engine.fallback=torch): %s", unit, why)
    ctx.tracker.set_tags({"engine": "ort", **{f"engine.fallback.{u}": why[:4000] for u, why in fallbacks.items()}})
    ctx.tracker.log_metrics({"engine/ort_units": len(spec.units) - len(fallbacks), "engine/fallback_units": len(fallbacks)})
    if ctx.cfg.engine.save_onnx:
        for graph in graph_files(ort_dir):
            ctx.tracker.log_artifact(graph, "onnx")
            ctx.log.info("engine.save_onnx: %s", graph)
    return fallbacks


def train_step(layout: Layout, optimizers, batch, step: int, lr: float, s: StepSettings, probe: MemoryProbe,
               scaler: Optional[LossScaler] = None) -> dict:
    """One optimizer step over the global batch (this rank's share of it). Returns the step's record with the loss
    and the gradient norm still on the device (MetricsWindow reads them back, many steps at once): nothing here
    waits for the GPU, except fp16's overflow check."""
    scaler = scaler or LossScaler(enabled=False)
    t0 = time.perf_counter()
    if s.dropout_seed is not None:
        torch.manual_seed(s.dropout_seed + step)  # dropout masks depend on the step only
    for opt in optimizers:
        set_lr(opt, lr)
    n_labels = max(batch.n_labels, 1)  # the loss is a mean over the whole batch's labels, however it is split
    probe.start_step()
    loss_scale = scaler.scale
    loss = layout.runner.train_step(layout.local_batch(batch.inputs), layout.local_batch(batch.labels), n_labels,
                                    loss_scale)
    grad_norm = layout.sync_and_clip(s.grad_clip, loss_scale)
    finite = scaler.step_ok(grad_norm)
    if finite and s.skip_nonfinite and not scaler.enabled:
        finite = bool(torch.isfinite(grad_norm).item())
    for opt in optimizers:
        if finite:  # an overflowed fp16 step leaves the weights and the optimizer state as they were
            opt.step()
        opt.zero_grad(set_to_none=True)
    probe.sample("post_step")
    row = {"step": step + 1, "loss": loss.detach(), "grad_norm": grad_norm.detach(), "lr": lr,
           "tokens": batch.inputs.numel(), "step_time_s": time.perf_counter() - t0, "time": time.time(),
           "input_density": batch.input_density, "label_density": batch.label_density, **probe.metrics(),
           **scaler.metrics(), **({"skipped": not finite} if scaler.enabled or s.skip_nonfinite else {})}
    if layout.timeline is not None:
        row["pipeline_idle_fraction"] = layout.timeline.idle_fraction()
    return row


class MetricsWindow:
    """Step records whose device values (loss, gradient norm) have not been read back yet. `flush` reads them all
    with one transfer and reduces the window over ranks with two collectives: the loss is a sum of rank
    contributions, the idle share a mean, time and memory the worst rank's.

    Step times add up to the window's wall time, from its first step's start to the device finishing its last.
    A step's own clock is host time: on a GPU the host runs ahead of the device (only a full launch queue stops
    it), and the work still queued when the window is read back would otherwise be in no step (an overstated
    tokens/s and MFU). So `flush` waits for the device and spreads the rest over the window's steps in proportion
    to their host times; on a CPU the rest is what the loop does between steps (the next batch, progress)."""

    DEVICE_KEYS = ("loss", "grad_norm")

    def __init__(self, layout: Layout):
        self.layout = layout
        self.rows: list[dict] = []
        self.started = 0.0  # perf_counter at the start of the window's first step

    def add(self, row: dict) -> None:
        if not self.rows:
            self.started = time.perf_counter() - row["step_time_s"]
        self.rows.append(row)

    def last_step_time(self) -> float:
        return self.rows[-1]["step_time_s"]

    def flush(self) -> list[dict]:
        rows, self.rows = self.rows, []
        if not rows:
            return []
        self._to_wall_time(rows)  # before the ranks compare times: each rank's own
        layout = self.layout
        losses = torch.stack([r["loss"].float() for r in rows])
        norms = torch.stack([r["grad_norm"].float() for r in rows])
        worst_keys = ["step_time_s", *[k for k in rows[0] if k.startswith("memory/")]]
        if layout.world:
            idle = torch.tensor([r.get("pipeline_idle_fraction", 0.0) for r in rows], device=losses.device)
            sums = layout.reduce(torch.stack([losses, idle]))
            losses, idle_mean = sums[0], (sums[1] / layout.coords.world_size).tolist()
            worst = layout.reduce(torch.tensor([[r[k] for k in worst_keys] for r in rows], dtype=torch.float64),
                                  dist.ReduceOp.MAX).tolist()
            for r, w, i in zip(rows, worst, idle_mean):
                r.update(zip(worst_keys, w))
                if "pipeline_idle_fraction" in r:
                    r["pipeline_idle_fraction"] = i
        values = torch.stack([losses.cpu(), norms.cpu()]).tolist()
        for r, loss, norm in zip(rows, *values):
            r["loss"], r["grad_norm"] = loss, norm
            r["tokens_per_s"] = r["tokens"] / r["step_time_s"]
        return rows

    def _to_wall_time(self, rows: list[dict]) -> None:
        _synchronize(self.layout.device)
        host = sum(r["step_time_s"] for r in rows)
        wall = time.perf_counter() - self.started
        if host > 0 and wall > host:
            for r in rows:
                r["step_time_s"] *= wall / host


def evaluate(layout: Layout, batcher, n_batches: int) -> float:
    """Mean next-token loss over the first n_batches held-out batches, computed in the layout."""
    layout.train(False)
    total, count = torch.zeros((), dtype=torch.float64), 0
    for i in range(n_batches):
        batch = batcher.eval_batch(i)
        total += layout.runner.eval_sum(layout.local_batch(batch.inputs), layout.local_batch(batch.labels)).cpu()
        count += batch.n_labels
    layout.train(True)
    return layout.reduce(total).item() / max(count, 1)


def _restore(ctx: StageContext, layout: Layout, parts, checkpoints: Path, init_from: Optional[str],
             scaler: LossScaler) -> int:
    """The step to start from: this run's latest complete checkpoint, else `train.init_from`, else 0.
    Rank 0 chooses (and verifies checksums); every rank loads the same folder. fp16's loss scale continues
    from the checkpoint (one written in another precision has none: the scale starts afresh)."""
    choice = None
    if ctx.is_rank0:
        ckpt.sweep_partials(checkpoints)
        found = ckpt.latest(checkpoints, set_aside=True)
        for problem in found[2] if found else []:
            ctx.log.warning("skipping a damaged checkpoint: %s", problem)
        if found and found[1] is None:
            ctx.log.warning("every checkpoint of this run is damaged (%d set aside): training restarts from %s",
                            len(found[2]), f"train.init_from={init_from}" if init_from else "step 0")
        if found and found[1] is not None:
            choice = str(found[1])
        elif hf.folder_of(init_from):
            choice = init_from
        elif init_from:
            problems = ckpt.verify(Path(init_from))
            if problems:
                raise RuntimeError(f"train.init_from={init_from} is not a complete checkpoint: {'; '.join(problems)}")
            choice = str(Path(init_from).resolve())
    if layout.world:
        box = [choice]
        dist.broadcast_object_list(box, src=0)
        choice = box[0]
    if choice is None:
        return 0
    if hf.folder_of(choice):  # weights only: a fresh optimizer, step 0
        ckpt.load_full_weights(parts, hf.load_state(hf.folder_of(choice), vocab_rows(ctx.cfg.model)), layout.aliases)
        ctx.log.info("starting from the Hugging Face weights in %s", hf.folder_of(choice))
        ctx.tracker.set_tags({"resumed_from_step": 0, "resumed_from": choice})
        return 0
    manifest = ckpt.load(Path(choice), parts, layout.aliases)
    scaler.load_state_dict(manifest.get("loss_scaler"))
    step = manifest["step"]
    written_by = manifest.get("trainer", {})
    ctx.log.info("starting from the checkpoint of step %d (%s; written by dp%s hp%s pp%s)", step, choice,
                 written_by.get("dp"), written_by.get("hp"), written_by.get("pp"))
    ctx.tracker.set_tags({"resumed_from_step": step, "resumed_from": choice})
    return step


def _gather_timeline(layout: Layout) -> Optional[dict]:
    """Every rank's pipeline events of the last step, on rank 0 (a collective: all ranks call it)."""
    if layout.timeline is None:
        return None
    mine = {"rank": layout.coords.pp, "dp": layout.coords.dp, "hp": layout.coords.hp,
            "step_seconds": layout.timeline.step_seconds, "events": layout.timeline.events}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return {"ranks": [g for g in gathered if g["dp"] == 0 and g["hp"] == 0]}


def _barrier(layout: Layout) -> None:
    if layout.world:
        dist.barrier()


def _numeric(row: dict) -> dict:
    return {k: float(v) for k, v in row.items() if k not in ("step", "time") and isinstance(v, (int, float))}


def _line(row: dict, steps: int) -> str:
    text = (f"step {row['step']:>{len(str(steps))}}/{steps} | loss {row['loss']:.4f} | lr {row['lr']:.2e} | "
            f"grad norm {row['grad_norm']:.3f} | {row['tokens_per_s']:,.0f} tok/s | {row['step_time_s'] * 1e3:.1f} ms")
    if "eval_loss" in row:
        text += f" | eval loss {row['eval_loss']:.4f}"
    return text


def _progress(ctx: StageContext, steps: int) -> Progress:
    console = Console(force_terminal=ctx.interactive or None, highlight=False)
    return Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("loss {task.fields[loss]:.4f}"), TimeRemainingColumn(),
                    console=console, disable=not (ctx.cfg.train.progress and ctx.is_rank0), transient=True)


def _progress_hint(scratch) -> str | None:
    """What the train stage will do with this key's checkpoints (the same verification it runs)."""
    found = ckpt.latest(scratch / "checkpoints")
    if found is None:
        return None
    step, path, damaged = found
    if path is None:
        return f"restarts from step 0: its {len(damaged)} checkpoint(s) are damaged"
    return f"resumes from step {step}" + (f", {len(damaged)} damaged checkpoint(s) set aside" if damaged else "")


def _summary(out) -> str:
    s = read_json(out / "summary.json")
    tps = f", {s['tokens_per_s']:,.0f} tok/s" if s.get("tokens_per_s") else ""
    mfu_text = f", MFU {s['mfu']:.1%}" if s.get("mfu") is not None else ""
    memory = f", peak {s['peak_memory_mb'] / 1024:.1f} GB" if s.get("peak_memory_mb") and s.get("memory_kind") == \
        "cuda" else ""
    return f"loss {s['final_loss']:.4f}, eval {s['final_eval_loss']:.4f}{tps} ({s.get('precision', 'fp32')}" \
           f"{mfu_text}{memory})"


def _fingerprint(cfg) -> dict:
    """Key material beyond the config and the inputs' keys (the tokenize stage's holds the data): the checkpoint or
    Hugging Face folder a run starts from."""
    start = None
    folder = hf.folder_of(cfg.train.init_from)
    if folder:  # the folder's files as they are now (names, sizes, modification times)
        start = hashlib.sha256(json.dumps(sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns)
                                                 for p in folder.iterdir() if p.is_file())).encode()).hexdigest()
    elif cfg.train.init_from:
        manifest = Path(cfg.train.init_from) / ckpt.MANIFEST
        start = hashlib.sha256(manifest.read_bytes()).hexdigest() if manifest.is_file() else "missing"
    return {"init_from": start}


STAGE = Stage(
    name="train",
    run=train,
    after=("transform", "tokenize"),
    reads=("model", "parallel", "optimizer", "memory", "precision", "triton", "engine", "data", "train"),
    resources=lambda cfg: Resources(tasks=cfg.parallel.dp * cfg.parallel.hp * cfg.parallel.pp),
    fingerprint=_fingerprint,
    progress=_progress_hint,
    summary=_summary,
)
