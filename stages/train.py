"""train: the training loop on every rank of the layout, resumable from its latest complete checkpoint.

Everything a step depends on is a function of the step number (global batch, learning rate, dropout seed)
or is in the checkpoint (parameters, optimizer state), so a run killed at any moment and resumed produces
the same losses as one that never stopped; and the global batch and the loss normalisation (sum over the
batch's labels / their count) do not depend on the layout, so every layout computes the same losses.
"""
from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from plugins import checkpoint as ckpt
from plugins import preemption
from plugins.data import build_batcher, data_fingerprint
from plugins.kernels import KernelReport, apply_kernels
from plugins.fsio import atomic_write_json, link_tree, read_json, remove_tree
from plugins.metrics import MemoryProbe, MetricsLog, plot_loss_curve, plot_pipeline_timeline
from plugins.models import get_model
from plugins.optim import build_optimizer, lr_factor, set_lr
from plugins.parallel.layout import Layout, build_layout
from plugins.parallel.mesh import pick_device
from stages.base import Resources, Stage, StageContext

WARMUP_STEPS_EXCLUDED = 3  # first steps of an attempt are slower (allocator, caches): not in tokens/s


@dataclass(frozen=True)
class StepSettings:
    """What a step reads, resolved once: config lookups cost microseconds each in the hot loop."""
    grad_clip: float            # inf: measure the norm, clip nothing
    dropout_seed: Optional[int]  # reseed per step (resume-exact dropout masks); None when there is no dropout

    @staticmethod
    def of(cfg) -> "StepSettings":
        return StepSettings(cfg.train.grad_clip if cfg.train.grad_clip > 0 else math.inf,
                            cfg.train.seed if cfg.model.dropout > 0 else None)


def train(ctx: StageContext) -> None:
    cfg, t = ctx.cfg, ctx.cfg.train
    plan = read_json(ctx.inputs["transform"] / "partition_plan.json")
    device = pick_device()
    probe = MemoryProbe(device)
    spec = get_model(cfg.model.name)
    layout = build_layout(cfg, plan, spec, device, probe=probe, timeline=cfg.parallel.pp > 1)
    fallbacks = _apply_engine(ctx, layout, spec, device)
    kernels = apply_kernels(layout.parts, spec, cfg.triton, ctx.log, cuda=device.type == "cuda")
    optimizers = [build_optimizer(cfg.optimizer, part) for part in layout.parts]
    parts = list(zip(layout.parts, optimizers))
    batcher = build_batcher(cfg)

    checkpoints = ctx.scratch / "checkpoints"
    history = MetricsLog(ctx.scratch / "metrics.jsonl")
    if not t.resume and ctx.is_rank0:
        remove_tree(checkpoints)
        history.path.unlink(missing_ok=True)
    _barrier(layout)
    start = _restore(ctx, layout, parts, checkpoints, t.init_from)
    if ctx.is_rank0:
        # an interrupted attempt's curve, so that this record is complete; a requeued job logs into the run its
        # first attempt used, which already holds part of it
        logged = ctx.tracker.last_step("loss") or 0
        for row in history.truncate(after_step=start):
            if row["step"] > logged:
                ctx.tracker.log_metrics(_numeric(row), step=row["step"])

    meta = {"trainer": {"world_size": layout.coords.world_size, **{k: plan["layout"][k] for k in ("dp", "hp", "pp")},
                        "dp_mode": plan["layout"]["dp_mode"], "optimizer": cfg.optimizer.name, "seed": t.seed},
            "config_key": ctx.key, "partition_plan": plan}

    def save(step: int) -> None:
        if ctx.is_rank0:
            history.sync()
        ckpt.save(ckpt.step_dir(checkpoints, step), parts, {**meta, "step": step}, layout.aliases)
        ckpt.prune(checkpoints, keep=max(t.keep_checkpoints, 1))

    settings = StepSettings.of(cfg)
    lrs = [cfg.optimizer.lr * lr_factor(cfg.optimizer, step, t.steps) for step in range(t.steps)]
    steps, eval_every, log_every, checkpoint_every = t.steps, t.eval_every, t.log_every, t.checkpoint_every
    timed_tokens, timed_s = 0, 0.0
    with _progress(ctx, steps) as progress:
        task = progress.add_task("train", total=steps, completed=start, loss=float("nan"))
        for step in range(start, steps):
            row = train_step(layout, optimizers, batcher.train_batch(step), step, lrs[step], settings, probe)
            done = step + 1
            if step == start and kernels.compiled:  # the first step of an attempt compiles (or loads the cache)
                _report_kernels(ctx, kernels, row["step_time_s"])
            if step - start >= WARMUP_STEPS_EXCLUDED:
                timed_tokens += row["tokens"]
                timed_s += row["step_time_s"]
            if done == steps or (eval_every and done % eval_every == 0):
                row["eval_loss"] = evaluate(layout, batcher, t.eval_batches)
            row["time"] = time.time()  # wall clock after all of the step's bookkeeping (for throughput audits)
            if ctx.is_rank0:
                history.append(row)
                ctx.tracker.log_metrics(_numeric(row), step=done)
                progress.update(task, completed=done, loss=row["loss"])
                if log_every and (done % log_every == 0 or done == steps):
                    progress.console.print(_line(row, steps), soft_wrap=True)
            saved = done == steps or (checkpoint_every and done % checkpoint_every == 0)
            if saved:
                save(done)
            reason = preemption.stop_requested(bool(layout.world), device) if done < steps else None
            if reason:
                if not saved:
                    save(done)
                history.close()
                ctx.tracker.set_tags({"preempted_at_step": done})
                raise preemption.Preempted(done, reason)
    history.close()
    timeline = _gather_timeline(layout)
    if not ctx.is_rank0:
        return

    if start == steps:  # an earlier attempt finished training and saved its last checkpoint
        ctx.log.info("training had already reached step %d: publishing its results", steps)
    link_tree(ckpt.step_dir(checkpoints, steps), ctx.out / "checkpoint")
    rows = history.rows()
    (ctx.out / "metrics.jsonl").write_text(history.path.read_text())
    summary = {"steps": steps, "resumed_from_step": start, "final_loss": rows[-1]["loss"],
               "final_eval_loss": rows[-1]["eval_loss"], "tokens_per_s": timed_tokens / timed_s if timed_s else None,
               "n_parameters": plan["n_parameters"], "layout": plan["layout"], "engine": cfg.engine.name,
               "engine_fallbacks": fallbacks, "compiled": {"blocks": len(kernels.compiled),
                                                           "eager_fallbacks": kernels.fallbacks}}
    atomic_write_json(ctx.out / "summary.json", summary)
    title = f"{cfg.model.name} {plan['n_parameters']:,} params, dp{layout.coords.dp_size} hp{layout.coords.hp_size} " \
            f"pp{layout.coords.pp_size}"
    artifacts = [plot_loss_curve(rows, ctx.out / "loss_curve.png", title), ctx.out / "metrics.jsonl",
                 ctx.out / "summary.json"]
    if timeline:
        atomic_write_json(ctx.out / "pipeline_timeline.json", timeline)
        artifacts.append(plot_pipeline_timeline(timeline, ctx.out / "pipeline_timeline.png",
                                                f"{cfg.parallel.pp_schedule}, pp={cfg.parallel.pp}, "
                                                f"{cfg.parallel.microbatches} microbatches (last step)"))
    ctx.tracker.log_metrics({"final_eval_loss": summary["final_eval_loss"]})
    for artifact in artifacts:
        if artifact:
            ctx.tracker.log_artifact(artifact)


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


def train_step(layout: Layout, optimizers, batch, step: int, lr: float, s: StepSettings, probe: MemoryProbe) -> dict:
    """One optimizer step over the global batch (this rank's share of it), metrics reduced over ranks."""
    t0 = time.perf_counter()
    if s.dropout_seed is not None:
        torch.manual_seed(s.dropout_seed + step)  # dropout masks depend on the step only
    for opt in optimizers:
        set_lr(opt, lr)
    n_labels = max(batch.n_labels, 1)  # the loss is a mean over the whole batch's labels, however it is split
    probe.start_step()
    loss = layout.runner.train_step(layout.local_batch(batch.inputs), layout.local_batch(batch.labels), n_labels)
    grad_norm = layout.sync_and_clip(s.grad_clip)
    for opt in optimizers:
        opt.step()
        opt.zero_grad(set_to_none=True)
    probe.sample("post_step")
    elapsed = time.perf_counter() - t0
    memory = probe.metrics()
    if layout.world:  # the loss is a sum of rank contributions; time and memory are the worst rank's
        idle = layout.timeline.idle_fraction() if layout.timeline else 0.0
        sums = layout.reduce(torch.stack([loss.float().cpu(), torch.tensor(idle)]))
        loss, idle = sums[0], sums[1].item() / layout.coords.world_size
        worst = layout.reduce(torch.tensor([elapsed, *memory.values()], dtype=torch.float64), dist.ReduceOp.MAX)
        elapsed, memory = worst[0].item(), dict(zip(memory, worst[1:].tolist()))
    tokens = batch.inputs.numel()
    row = {"step": step + 1, "loss": loss.item(), "grad_norm": grad_norm.item(), "lr": lr,
           "tokens": tokens, "tokens_per_s": tokens / elapsed, "step_time_s": elapsed,
           "input_density": batch.input_density, "label_density": batch.label_density, **memory}
    if layout.timeline is not None:
        row["pipeline_idle_fraction"] = idle
    return row


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


def _restore(ctx: StageContext, layout: Layout, parts, checkpoints: Path, init_from: Optional[str]) -> int:
    """The step to start from: this run's latest complete checkpoint, else `train.init_from`, else 0.
    Rank 0 chooses (and verifies checksums); every rank loads the same folder."""
    choice = None
    if ctx.is_rank0:
        found = ckpt.latest(checkpoints)
        if found is not None:
            for problem in found[2]:
                ctx.log.warning("skipping a damaged checkpoint: %s", problem)
            choice = str(found[1])
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
    manifest = ckpt.load(Path(choice), parts, layout.aliases)
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
    found = ckpt.complete_checkpoints(scratch / "checkpoints")
    return f"resumes from step {found[-1][0]}" if found else None


def _summary(out) -> str:
    s = read_json(out / "summary.json")
    tps = f", {s['tokens_per_s']:,.0f} tok/s" if s.get("tokens_per_s") else ""
    return f"loss {s['final_loss']:.4f}, eval {s['final_eval_loss']:.4f}{tps}"


def _fingerprint(cfg) -> dict:
    """Key material beyond the config: the data files, and the checkpoint a run starts from."""
    start = None
    if cfg.train.init_from:
        manifest = Path(cfg.train.init_from) / ckpt.MANIFEST
        start = hashlib.sha256(manifest.read_bytes()).hexdigest() if manifest.is_file() else "missing"
    return {"data": data_fingerprint(cfg), "init_from": start}


STAGE = Stage(
    name="train",
    run=train,
    after=("transform",),
    reads=("model", "parallel", "optimizer", "memory", "triton", "engine", "data", "train"),
    code=("plugins.models", "plugins.data", "plugins.optim", "plugins.checkpoint", "plugins.metrics",
          "plugins.parallel", "plugins.engines", "plugins.preemption", "plugins.kernels"),
    resources=lambda cfg: Resources(tasks=cfg.parallel.dp * cfg.parallel.hp * cfg.parallel.pp),
    fingerprint=_fingerprint,
    progress=_progress_hint,
    summary=_summary,
)
