"""train: the training loop, resumable from its latest complete checkpoint.

Everything a step depends on is a function of the step number (batch, learning rate, dropout seed) or is
in the checkpoint (parameters, optimizer state), so a run killed at any moment and resumed produces the
same losses as one that never stopped.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Optional

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from plugins import checkpoint as ckpt
from plugins.data import build_batcher, data_fingerprint
from plugins.evaluate import eval_loss
from plugins.fsio import atomic_write_json, link_tree, read_json, remove_tree
from plugins.metrics import MemoryProbe, MetricsLog, plot_loss_curve
from plugins.models import get_model
from plugins.optim import build_optimizer, lr_factor, set_lr
from stages.base import Resources, Stage, StageContext

WARMUP_STEPS_EXCLUDED = 3  # first steps of an attempt are slower (allocator, caches): not in tokens/s


def train(ctx: StageContext) -> None:
    cfg, t = ctx.cfg, ctx.cfg.train
    if ctx.world_size > 1:
        raise NotImplementedError("multi-rank training is not available in this version (validation should "
                                  "have rejected parallel layouts with more than one rank)")
    plan = read_json(ctx.inputs["transform"] / "partition_plan.json")
    spec = get_model(cfg.model.name)
    model = spec.build(cfg.model)
    spec.init_weights(model, cfg.model, t.seed)
    spec.apply_memory(model, cfg.memory.level)
    optimizer = build_optimizer(cfg.optimizer, model)
    batcher = build_batcher(cfg)
    device = next(model.parameters()).device

    checkpoints = ctx.scratch / "checkpoints"
    history = MetricsLog(ctx.scratch / "metrics.jsonl")
    start = _restore(ctx, model, optimizer, checkpoints) if t.resume else _start_fresh(ctx)
    earlier = history.truncate(after_step=start)
    for row in earlier:  # an interrupted attempt's curve, so this run's record is complete
        ctx.tracker.log_metrics(_numeric(row), step=row["step"])

    meta = {"trainer": {"world_size": ctx.world_size, **{k: plan["layout"][k] for k in ("dp", "hp", "pp")},
                        "optimizer": cfg.optimizer.name, "seed": t.seed},
            "config_key": ctx.key, "partition_plan": plan}

    def save(step: int) -> None:
        history.sync()
        ckpt.save(ckpt.step_dir(checkpoints, step), model, optimizer, {**meta, "step": step})
        ckpt.prune(checkpoints, keep=max(t.keep_checkpoints, 1))

    probe = MemoryProbe(device)
    settings = StepSettings.of(cfg)
    lrs = [cfg.optimizer.lr * lr_factor(cfg.optimizer, step, t.steps) for step in range(t.steps)]
    steps, eval_every, log_every, checkpoint_every = t.steps, t.eval_every, t.log_every, t.checkpoint_every
    timed_tokens, timed_s = 0, 0.0
    with _progress(ctx, steps, start) as progress:
        task = progress.add_task("train", total=steps, completed=start, loss=float("nan"))
        for step in range(start, steps):
            row = train_step(model, spec.loss, optimizer, batcher.train_batch(step), step, lrs[step], settings, probe)
            done = step + 1
            if step - start >= WARMUP_STEPS_EXCLUDED:
                timed_tokens += row["tokens"]
                timed_s += row["step_time_s"]
            if done == steps or (eval_every and done % eval_every == 0):
                row["eval_loss"] = eval_loss(model, spec.loss, batcher, t.eval_batches)
            row["time"] = time.time()  # wall clock after all of the step's bookkeeping (for throughput audits)
            history.append(row)
            ctx.tracker.log_metrics(_numeric(row), step=done)
            progress.update(task, completed=done, loss=row["loss"])
            if log_every and (done % log_every == 0 or done == steps):
                progress.console.print(_line(row, steps), soft_wrap=True)
            if done == steps or (checkpoint_every and done % checkpoint_every == 0):
                save(done)
    history.close()

    if start == t.steps:  # an earlier attempt finished training and saved its last checkpoint
        ctx.log.info("training had already reached step %d: publishing its results", t.steps)
    final = ckpt.step_dir(checkpoints, t.steps)
    link_tree(final, ctx.out / "checkpoint")
    rows = history.rows()
    (ctx.out / "metrics.jsonl").write_text(history.path.read_text())
    last = rows[-1]
    summary = {"steps": t.steps, "resumed_from_step": start, "final_loss": last["loss"],
               "final_eval_loss": last["eval_loss"], "tokens_per_s": timed_tokens / timed_s if timed_s else None,
               "n_parameters": plan["n_parameters"]}
    atomic_write_json(ctx.out / "summary.json", summary)
    png = plot_loss_curve(rows, ctx.out / "loss_curve.png", f"{cfg.model.name} {plan['n_parameters']:,} params")
    ctx.tracker.log_metrics({"final_eval_loss": summary["final_eval_loss"]})
    for artifact in (png, ctx.out / "metrics.jsonl", ctx.out / "summary.json"):
        if artifact:
            ctx.tracker.log_artifact(artifact)


@dataclass(frozen=True)
class StepSettings:
    """What a step reads, resolved once: config lookups cost microseconds each in the hot loop."""
    microbatches: int
    grad_clip: float            # inf: measure the norm, clip nothing
    dropout_seed: Optional[int]  # reseed per step (resume-exact dropout masks); None when there is no dropout

    @staticmethod
    def of(cfg) -> "StepSettings":
        return StepSettings(cfg.parallel.microbatches,
                            cfg.train.grad_clip if cfg.train.grad_clip > 0 else math.inf,
                            cfg.train.seed if cfg.model.dropout > 0 else None)


def train_step(model, loss_fn, optimizer, batch, step: int, lr: float, s: StepSettings, probe: MemoryProbe) -> dict:
    """One optimizer step over the global batch, accumulated over s.microbatches."""
    t0 = time.perf_counter()
    if s.dropout_seed is not None:
        torch.manual_seed(s.dropout_seed + step)  # dropout masks depend on the step only
    set_lr(optimizer, lr)
    n_labels = max(batch.n_labels, 1)  # the loss is a mean over the whole batch's labels, however it is split
    probe.start_step()
    loss_sum = torch.zeros(())
    for inputs, labels in zip(batch.inputs.chunk(s.microbatches), batch.labels.chunk(s.microbatches)):
        probe.sample("pre_forward")
        loss = loss_fn(model(inputs), labels) / n_labels
        probe.sample("post_forward")
        loss.backward()
        probe.sample("post_backward")
        loss_sum += loss.detach()
    params = [p for p in model.parameters() if p.grad is not None]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, s.grad_clip, foreach=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    probe.sample("post_step")
    elapsed = time.perf_counter() - t0
    tokens = batch.inputs.numel()
    return {"step": step + 1, "loss": loss_sum.item(), "grad_norm": grad_norm.item(), "lr": lr,
            "tokens": tokens, "tokens_per_s": tokens / elapsed, "step_time_s": elapsed,
            "input_density": batch.input_density, "label_density": batch.label_density, **probe.metrics()}


def _restore(ctx: StageContext, model, optimizer, checkpoints) -> int:
    found = ckpt.latest(checkpoints)
    if found is None:
        return 0
    step, path, rejected = found
    for problem in rejected:
        ctx.log.warning("skipping a damaged checkpoint: %s", problem)
    ckpt.load(path, model, optimizer)
    ctx.log.info("resuming from the checkpoint of step %d (%s)", step, path)
    ctx.tracker.set_tags({"resumed_from_step": step})
    return step


def _start_fresh(ctx: StageContext) -> int:
    remove_tree(ctx.scratch / "checkpoints")
    (ctx.scratch / "metrics.jsonl").unlink(missing_ok=True)
    return 0


def _numeric(row: dict) -> dict:
    return {k: float(v) for k, v in row.items() if k not in ("step", "time") and isinstance(v, (int, float))}


def _line(row: dict, steps: int) -> str:
    text = (f"step {row['step']:>{len(str(steps))}}/{steps} | loss {row['loss']:.4f} | lr {row['lr']:.2e} | "
            f"grad norm {row['grad_norm']:.3f} | {row['tokens_per_s']:,.0f} tok/s | {row['step_time_s'] * 1e3:.1f} ms")
    if "eval_loss" in row:
        text += f" | eval loss {row['eval_loss']:.4f}"
    return text


def _progress(ctx: StageContext, steps: int, start: int) -> Progress:
    console = Console(force_terminal=ctx.interactive or None, highlight=False)
    return Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("loss {task.fields[loss]:.4f}"), TimeRemainingColumn(),
                    console=console, disable=not ctx.cfg.train.progress, transient=True)


def _progress_hint(scratch) -> str | None:
    found = ckpt.complete_checkpoints(scratch / "checkpoints")
    return f"resumes from step {found[-1][0]}" if found else None


def _summary(out) -> str:
    s = read_json(out / "summary.json")
    tps = f", {s['tokens_per_s']:,.0f} tok/s" if s.get("tokens_per_s") else ""
    return f"loss {s['final_loss']:.4f}, eval {s['final_eval_loss']:.4f}{tps}"


STAGE = Stage(
    name="train",
    run=train,
    after=("transform",),
    reads=("model", "parallel", "optimizer", "memory", "triton", "engine", "data", "train"),
    code=("plugins.models", "plugins.data", "plugins.optim", "plugins.checkpoint", "plugins.metrics"),
    resources=lambda cfg: Resources(tasks=cfg.parallel.dp * cfg.parallel.hp * cfg.parallel.pp),
    fingerprint=data_fingerprint,
    progress=_progress_hint,
    summary=_summary,
)
