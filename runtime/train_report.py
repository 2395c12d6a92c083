"""What the train stage tells its reader: the progress bar, the compile and profile reports as they happen, and at
the end summary.json, the loss curve and the pipeline timeline, logged to the tracker."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from runtime.metrics import plot_loss_curve, plot_pipeline_timeline
from runtime.optim import describe_impl
from runtime import precision as mixed
from runtime.precision import mfu, peak_flops
from runtime.sdpa import attention_kernel
from storage.fsio import atomic_write_json


class Diverged(RuntimeError):
    """Training produced a non-finite loss or gradient norm; the checkpoints written so far are intact."""


def first_nonfinite(rows: list[dict]) -> Optional[dict]:
    """The first step whose loss or gradient norm is not finite and whose update was not dropped (stop mode)."""
    return next((r for r in rows if not r.get("skipped") and not (math.isfinite(r["loss"]) and
                                                                  math.isfinite(r["grad_norm"]))), None)


def divergence(row: dict, done: int, in_a_row: int, cfg, last_good: str) -> str:
    what = (f"{in_a_row} steps in a row without a finite gradient (train.max_nonfinite_skips="
            f"{cfg.train.max_nonfinite_skips}), the last at step {row['step']}" if row.get("skipped") else
            f"loss {row['loss']} and gradient norm {row['grad_norm']} at step {row['step']}")
    return (f"training diverged: {what}; stopped at step {done} without saving. Last good checkpoint: {last_good}. "
            f"Fix: a lower optimizer.lr (now {cfg.optimizer.lr}), gradient clipping (train.grad_clip, now "
            f"{cfg.train.grad_clip}), precision=bf16 or fp32 instead of fp16 (now {cfg.precision.name}), or "
            f"train.nonfinite=skip to drop such steps")


CHANCE = 0.5  # a preference objective's reward accuracy by chance: which completion wins is a coin's toss


def not_learned(rows: list[dict], at_reference: Optional[float] = None) -> Optional[str]:
    """Why a run's held-out measures say it learned nothing (None: they say it learned, or cannot say): its last
    held-out loss no lower than its value at the reference (at_reference: a preference objective's, log 2 for DPO)
    or, without one, than at its first evaluation; a held-out reward accuracy at chance or below. Not a failure:
    said beside the result, so that a sweep's best point is not mistaken for a gain."""
    evals = [r for r in rows if r.get("eval_loss") is not None]
    if not evals:
        return None
    last, why = evals[-1], []
    if at_reference is not None and last["eval_loss"] >= at_reference:
        why.append(f"its held-out loss {last['eval_loss']:.4f} is no lower than at the reference model "
                   f"({at_reference:.4f})")
    elif at_reference is None and len(evals) > 1 and last["eval_loss"] >= evals[0]["eval_loss"]:
        why.append(f"its held-out loss {last['eval_loss']:.4f} is no lower than at its first evaluation "
                   f"({evals[0]['eval_loss']:.4f}, step {evals[0]['step']})")
    accuracy = last.get("eval_rewards/accuracies")
    if accuracy is not None and accuracy <= CHANCE:
        why.append(f"its held-out reward accuracy {accuracy:.2f} is at chance ({CHANCE})")
    return "; ".join(why) or None


def progress(ctx, steps: int) -> Progress:
    console = Console(force_terminal=ctx.interactive or None, highlight=False)
    return Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("loss {task.fields[loss]:.4f}"), TimeRemainingColumn(),
                    console=console, disable=not (ctx.cfg.train.progress and ctx.is_rank0), transient=True)


def report_profile(ctx, profiler) -> None:
    """The trace goes with the train output (rank 0's) and to MLflow; the top ops into the log."""
    trace, profiler.trace = profiler.trace, None
    ctx.log.info("profile of steps %d-%d: %s\n%s", profiler.first, profiler.last, trace, profiler.top)
    if ctx.is_rank0:
        ctx.tracker.log_artifact(trace, "profile")


def report_kernels(ctx, kernels, first_step_s: float) -> None:
    metrics = {**kernels.metrics(), "compile/first_step_s": first_step_s}
    ctx.log.info("triton: first step %.1f s (compiled forwards %.1f s); Inductor cache hits %d, misses %d%s",
                 first_step_s, metrics["compile/first_forward_s"], metrics["compile/fx_graph_cache_hits"],
                 metrics["compile/fx_graph_cache_misses"],
                 f"; uncompiled: {', '.join(kernels.fallbacks)}" if kernels.fallbacks else "")
    ctx.tracker.log_metrics(metrics)
    if kernels.fallbacks:
        ctx.tracker.set_tags({f"triton.eager.{name.replace(' ', '_')}": why[:4000]
                              for name, why in kernels.fallbacks.items()})


def gather_timeline(layout) -> Optional[dict]:
    """Every rank's pipeline events of the last step, on rank 0 (a collective: all ranks call it)."""
    if layout.timeline is None:
        return None
    mine = {"rank": layout.coords.pp, "dp": layout.coords.dp, "hp": layout.coords.hp,
            "step_seconds": layout.timeline.step_seconds, "events": layout.timeline.events}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return {"ranks": [g for g in gathered if g["dp"] == 0 and g["hp"] == 0]}


def write_summary(ctx, layout, plan: dict, rows: list[dict], run: dict) -> dict:
    """summary.json, the pictures and the tracker's final metrics and tags (rank 0). run: start, tokens_per_s,
    peak_mb, growth_mb, timeline, the probe, the optimizers, the kernels, the engine fallbacks and whether rows
    held whole documents."""
    cfg, device = ctx.cfg, layout.device
    precision = mixed.of(cfg, device)
    peak = peak_flops(device, precision.name, cfg.precision.tf32)
    last = rows[-1] if rows else {"loss": None, "eval_loss": run.get("baseline_eval_loss")}  # none: train.steps=0
    summary = {"steps": cfg.train.steps, "resumed_from_step": run["start"], "final_loss": last["loss"],
               "final_eval_loss": last["eval_loss"], "tokens_per_s": run["tokens_per_s"],
               "n_parameters": plan["n_parameters"], "layout": plan["layout"], "engine": cfg.engine.name,
               "engine_fallbacks": run["fallbacks"], "compiled": {"blocks": len(run["kernels"].compiled),
                                                                  "eager_fallbacks": run["kernels"].fallbacks},
               "precision": precision.name, "tf32": bool(cfg.precision.tf32 and device.type == "cuda"),
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "mfu": mfu(plan["n_parameters"], run["tokens_per_s"], peak), "peak_flops": peak,
               "peak_memory_mb": run["peak_mb"], "memory_kind": run["probe"].kind,
               "peak_memory_growth_mb": run["growth_mb"],  # the worst rank's: peak minus what it held before the model
               "optimizer_impl": describe_impl(run["optimizers"][0]),
               "attention_kernel": attention_kernel(cfg.model, precision, device, cfg.triton.attention,
                                                    run.get("documents", False)),
               "loss_scaler": run["scaler"].state_dict() if run["scaler"].enabled else None,
               # objective=dpo: the held-out pairs' measures, and their next-token loss (their eval loss is the pairs')
               **{f"final_{k}": v for k, v in last.items() if k.startswith(("eval_rewards/", "eval_logps/"))},
               **({"final_eval_nll": run["final_eval_nll"]} if run.get("final_eval_nll") is not None else {}),
               "not_learned": not_learned(rows, run.get("at_reference"))}
    atomic_write_json(ctx.out / "summary.json", summary)
    if summary["not_learned"]:
        ctx.log.warning("learned nothing: %s", summary["not_learned"])
    c = layout.coords
    shape = f"dp{c.dp_size} hp{c.hp_size} pp{c.pp_size}"
    title = f"{cfg.model.name} {plan['n_parameters']:,} params, {shape}, {precision.name}"
    artifacts = [plot_loss_curve(rows, ctx.out / "loss_curve.png", title), ctx.out / "metrics.jsonl",
                 ctx.out / "summary.json"]
    if run["timeline"]:
        atomic_write_json(ctx.out / "pipeline_timeline.json", run["timeline"])
        artifacts.append(plot_pipeline_timeline(run["timeline"], ctx.out / "pipeline_timeline.png",
                                                f"{cfg.parallel.pp_schedule}, pp={cfg.parallel.pp}, "
                                                f"{cfg.parallel.microbatches} microbatches (last step)"))
    ctx.tracker.log_metrics({"memory/peak_mb": run["peak_mb"],
                             **{k: summary[k] for k in ("final_eval_loss", "mfu") if summary[k] is not None}})
    ctx.tracker.set_tags({"precision": precision.name, "attention_kernel": summary["attention_kernel"],  # what ran
                          "optimizer_impl": summary["optimizer_impl"], "engine": cfg.engine.name,
                          "device": summary["device"], "layout": shape,
                          **({"not_learned": summary["not_learned"][:4000]} if summary["not_learned"] else {})})
    for artifact in artifacts:
        if artifact:
            ctx.tracker.log_artifact(artifact)
    return summary
