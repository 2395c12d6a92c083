"""train: the training loop on every rank of the layout, resumable from its latest complete checkpoint.

Everything a step depends on is a function of the step number (global batch, learning rate, dropout seed)
or is in the checkpoint (parameters, optimizer state), so a run killed at any moment and resumed produces
the same losses as one that never stopped; and the global batch and the loss normalisation (sum over the
batch's labels / their count) do not depend on the layout, so every layout computes the same losses.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from plugins.data import build_batcher
from plugins.data.preview import passes_line
from plugins.data.packing import whole_documents
from plugins.data.corpus import TOKENIZER_DIR
from plugins.data.tokenizer import CARRIED
from planning.partition import without_adapters
from plugins.engines import get_engine
from plugins.models import get_model
from plugins.models.lora import adapters_off, is_adapter
from plugins.models.registry import vocab_rows
from plugins.objectives import loss_of, objective_of
from plugins.objectives.providers import row_inputs_of
from plugins.objectives.reference import (ReferenceRows, adapters_are_the_difference, cached, needs_reference,
                                         reference_values)
from plugins.parallel import world_size
from plugins.parallel.layout import build_layout
from plugins.parallel.mesh import pick_device
from runtime import preemption
from runtime.cadence import Cadence
from runtime.checkpointer import Checkpointer, adopt, load_reference, progress_hint
from runtime.evaluate import eval_loss, held_out_nll, objective_set, row_logps
from runtime.metrics import MemoryProbe, MetricsLog, MetricsWindow, numeric, step_line
from runtime.optim import build_optimizer, lr_factor
from runtime.precision import build_scaler
from runtime.profiling import StepProfiler
from runtime.step import StepSettings, train_step
from runtime.train_report import (Diverged, divergence, first_nonfinite, gather_timeline, progress, report_kernels,
                                  report_profile, write_summary)
from stages.base import Resources, Stage, StageContext
from storage import adapters, hf, init_from
from storage.fsio import link_tree, read_json


def train(ctx: StageContext) -> None:
    cfg, t = ctx.cfg, ctx.cfg.train
    plan = read_json(ctx.inputs["transform"] / "partition_plan.json")
    device = pick_device()
    probe = MemoryProbe(device)
    spec = get_model(cfg.model.name)
    prepared = ctx.inputs["transform"] / cfg.engine.name  # what the transform stage prepared for the engine, if any
    objective = loss_of(cfg)  # None: next-token cross-entropy
    layout = build_layout(cfg, plan, spec, device, probe=probe, timeline=cfg.parallel.pp > 1,
                          prepared=prepared, log=ctx.log, objective=objective)
    engine = get_engine(cfg.engine.name)
    if engine.report is not None:
        engine.report(ctx, spec, layout.engine_fallbacks, prepared)
    optimizers = [build_optimizer(cfg.optimizer, part, device) for part in layout.parts]
    scaler = build_scaler(cfg)
    batcher = build_batcher(cfg, ctx.inputs["tokenize"] / "tokens",
                            row_inputs_of(objective_of(cfg).row_inputs, _reference(ctx, layout, device)))
    if ctx.is_rank0:  # said by the plan too where the tokenize stage ran before it
        for line in passes_line(cfg, ctx.inputs["tokenize"] / "tokens"):
            ctx.log.info("%s", line)
    control = preemption.control_group(layout.world)

    history = MetricsLog(ctx.scratch / "metrics.jsonl")
    meta = {"trainer": {"world_size": layout.coords.world_size, **{k: plan["layout"][k] for k in ("dp", "hp", "pp")},
                        "dp_mode": plan["layout"]["dp_mode"], "optimizer": cfg.optimizer.name, "seed": t.seed,
                        "precision": cfg.precision.name},
            "config_key": ctx.key, "partition_plan": plan}
    if cfg.peft.name != "none":  # the checkpoints hold what trains: the adapters, applied to this base
        base = adapters.base_of(t.init_from)  # a continued LoRA checkpoint's base is the one it names
        meta["peft"] = {"config": OmegaConf.to_container(cfg.peft, resolve=True), "base": {"init_from": base,
                                                           "stamps_sha256": hf.stamps(hf.folder_of(base))}}
    if needs_reference(cfg):  # a run continued from these checkpoints compares with the same reference
        meta["reference"] = {"init_from": adapters.reference_of(cfg)}
    checkpointer = Checkpointer(ctx, layout, list(zip(layout.parts, optimizers)), scaler, meta, history,
                                vocab_rows(cfg.model), is_adapter if cfg.peft.name == "lora" else None)
    if not t.resume:
        checkpointer.forget()
        if ctx.is_rank0:
            history.path.unlink(missing_ok=True)
    if layout.world:
        dist.barrier()
    start = checkpointer.restore()
    if ctx.is_rank0:
        # an interrupted attempt's curve, so that this record is complete; a requeued job logs into the run its
        # first attempt used, which already holds part of it
        logged = ctx.tracker.last_step("loss") or 0
        for row in history.truncate(after_step=start):
            if row["step"] > logged:
                ctx.tracker.log_metrics(numeric(row), step=row["step"])

    settings, when = StepSettings.of(cfg, engine.one_shape), Cadence.of(cfg, start)
    window = MetricsWindow(layout)
    profiler = StepProfiler(list(t.profile), ctx.is_rank0 or t.profile_ranks == "all", device, ctx.scratch / "profile",
                            ctx.rank)
    timed_tokens, timed_s, skipped_in_a_row = 0, 0.0, 0
    baseline = _baseline(ctx, layout, batcher, checkpointer) if t.steps == 0 else None
    with progress(ctx, t.steps) as bar:
        task = bar.add_task("train", total=t.steps, completed=start, loss=float("nan"))
        for step in range(start, t.steps):
            profiler.step_begins(step + 1)
            window.add(train_step(layout, optimizers, batcher.train_batch(step), step,
                                  cfg.optimizer.lr * lr_factor(cfg.optimizer, step, t.steps), settings, probe,
                                  scaler))
            done = step + 1
            profiler.step_ended(done)
            if profiler.trace is not None:
                report_profile(ctx, profiler)
            skipped_in_a_row = skipped_in_a_row + 1 if window.rows[-1].get("skipped") else 0
            if step == start and layout.kernels.compiled:  # the first step of an attempt compiles (or loads the cache)
                report_kernels(ctx, layout.kernels, window.last_step_time())
            evaluating, saving = when.evaluates(done), when.saves(done)
            reason = preemption.stop_requested(layout.world, control) if done < t.steps else None
            stalled = skipped_in_a_row >= t.max_nonfinite_skips
            if evaluating or saving or reason or stalled or when.warmed_up(done) or when.flushes(done):
                rows = window.flush()  # the only read-back from the device outside evaluation and fp16
                diverged = first_nonfinite(rows) or (rows[-1] if stalled else None)
                if evaluating and not diverged:  # a signal during it stops it within a batch (then saves, below)
                    held_out: dict = {}  # an objective's measures of the held-out examples (pairs' rewards)
                    loss = eval_loss(layout, batcher, t.eval_batches, lambda: preemption.stop_requested(
                        layout.world, control), measures=held_out)
                    if loss is None:
                        reason = reason or preemption.stop_requested(layout.world, control) or "a signal"
                        saving = True
                    else:
                        rows[-1].update({"eval_loss": loss, **{f"eval_{k}": v for k, v in held_out.items()}})
                for row in rows:
                    if when.timed(row["step"]):
                        timed_tokens, timed_s = timed_tokens + row["tokens"], timed_s + row["step_time_s"]
                    if ctx.is_rank0:
                        history.append(row)
                        ctx.tracker.log_metrics(numeric(row), step=row["step"])
                        if when.prints(row["step"]):
                            bar.console.print(step_line(row, t.steps), soft_wrap=True)
                if ctx.is_rank0:
                    bar.update(task, completed=done, loss=rows[-1]["loss"])
                if diverged:
                    history.close()
                    checkpointer.wait()  # one written before the divergence is good
                    raise Diverged(divergence(diverged, done, skipped_in_a_row, cfg, checkpointer.last_good()))
            elif ctx.is_rank0:
                bar.update(task, completed=done)
            if saving or reason:
                checkpointer.save(done, wait=bool(reason) or done == t.steps)
            if reason:
                history.close()
                ctx.tracker.set_tags({"preempted_at_step": done})
                raise preemption.Preempted(done, reason)
    history.close()
    checkpointer.wait()
    # an objective of rows' held-out loss is its own; the aggregate's check of the whole model reads this one
    nll = held_out_nll(layout, batcher, t.eval_batches, ReferenceRows(), settings.repack_to) if objective is not None \
        else None
    timeline = gather_timeline(layout)
    peak_mb, growth_mb = layout.reduce(torch.tensor([probe.peak_mb, probe.peak_mb - probe.baseline_mb],
                                                    dtype=torch.float64), dist.ReduceOp.MAX).tolist()
    if not ctx.is_rank0:
        return

    if start == t.steps:  # an earlier attempt finished training and saved its last checkpoint
        ctx.log.info("training had already reached step %d: publishing its results", t.steps)
    link_tree(checkpointer.last(t.steps), ctx.out / "checkpoint")
    if (ctx.inputs["tokenize"] / TOKENIZER_DIR).is_dir():  # the checkpoint carries the tokenizer its data was
        # made with: data.tokenizer=auto from it reads the same ids (plugins/data/tokenizer.py auto_tokenizer)
        link_tree(ctx.inputs["tokenize"] / TOKENIZER_DIR, ctx.out / "checkpoint" / CARRIED)
    if (ctx.scratch / "profile").is_dir():  # every rank's traces (they share the scratch folder on one machine)
        link_tree(ctx.scratch / "profile", ctx.out / "profile")
    (ctx.out / "metrics.jsonl").write_text(history.path.read_text())
    write_summary(ctx, layout, plan, history.rows(), {
        "start": start, "tokens_per_s": timed_tokens / timed_s if timed_s else None, "peak_mb": peak_mb,
        "growth_mb": growth_mb, "timeline": timeline, "probe": probe,
        "optimizers": optimizers, "kernels": layout.kernels, "fallbacks": layout.engine_fallbacks, "scaler": scaler,
        "documents": whole_documents(cfg.data) is not None, "baseline_eval_loss": baseline,
        "final_eval_nll": nll, "at_reference": objective_of(cfg).at_reference(cfg.objective)})


def _reference(ctx: StageContext, policy, device):
    """An objective that takes the reference model's log-probabilities: the reference stage's (cached), or computed
    for each batch (online) by the policy with its adapters off (peft=lora: no second model) or a frozen reference
    model beside it; None otherwise."""
    cfg = ctx.cfg
    if not needs_reference(cfg):
        return None
    if cached(cfg):
        return reference_values(ctx.inputs["reference"])
    width = StepSettings.of(cfg).repack_to  # rows cut after their longest real run, as the step cuts them
    if adapters_are_the_difference(cfg):
        ctx.log.info("reference model online: the policy with its adapters off")

        def base(batch):
            with adapters_off(policy.parts), objective_set(policy, ReferenceRows()):
                return row_logps(policy, batch, width)
        return base
    frozen = build_layout(*without_adapters(cfg), get_model(cfg.model.name), device, objective=ReferenceRows())
    for part in frozen.parts:
        part.requires_grad_(False)
    ctx.log.info("reference model online: %s", load_reference(frozen, cfg, vocab_rows(cfg.model)))
    return lambda batch: row_logps(frozen, batch, width)


def _baseline(ctx: StageContext, layout, batcher, checkpointer) -> Optional[float]:
    """train.steps=0 (a baseline: the starting weights scored): their held-out loss (train.eval_batches), and those
    weights saved as the checkpoint of step 0, which the stages after train read as any other."""
    t = ctx.cfg.train
    loss = eval_loss(layout, batcher, t.eval_batches) if t.eval_batches else None
    checkpointer.save(0, wait=True)
    if ctx.is_rank0:
        ctx.log.info("train.steps=0: no step; the starting weights (train.init_from=%s) saved as the checkpoint of "
                     "step 0%s", t.init_from, f", their held-out loss {loss:.4f}" if loss is not None else "")
    return loss


def _summary(out) -> str:
    s = read_json(out / "summary.json")
    tps = f", {s['tokens_per_s']:,.0f} tok/s" if s.get("tokens_per_s") else ""
    mfu_text = f", MFU {s['mfu']:.1%}" if s.get("mfu") is not None else ""
    memory = f", peak {s['peak_memory_mb'] / 1024:.1f} GB" if s.get("peak_memory_mb") and s.get("memory_kind") == \
        "cuda" else ""
    if s["final_loss"] is None:  # train.steps=0
        baseline = f", eval {s['final_eval_loss']:.4f}" if s["final_eval_loss"] is not None else ""
        return f"no step (train.steps=0): the starting weights{baseline}"
    rewards = f", reward acc {s['final_eval_rewards/accuracies']:.2f} margin {s['final_eval_rewards/margins']:.4f}" \
        if s.get("final_eval_rewards/accuracies") is not None else ""  # an objective of pairs' own held-out measures
    said = f"; learned nothing: {s['not_learned']}" if s.get("not_learned") else ""
    return f"loss {s['final_loss']:.4f}, eval {s['final_eval_loss']:.4f}{rewards}{tps} ({s.get('precision', 'fp32')}" \
           f"{mfu_text}{memory}){said}"


def _fingerprint(cfg) -> dict:
    """Key material beyond the config and the inputs' keys (the tokenize stage's holds the data): the checkpoint or
    Hugging Face folder a run starts from."""
    return {"init_from": init_from.fingerprint(cfg.train.init_from, cfg.cache_dir)}


STAGE = Stage(
    name="train",
    run=train,
    after=("transform", "tokenize", "reference"),
    optional=("reference",),  # an objective that takes the reference, cached (plugins/objectives/reference.py)
    reads=("model", "parallel", "optimizer", "memory", "precision", "triton", "engine", "data", "train", "peft",
           "objective"),
    resources=lambda cfg: Resources(tasks=world_size(cfg.parallel)),
    fingerprint=_fingerprint,
    starts=True,
    progress=progress_hint,
    lineage=("model", "data", "optimizer", "precision", "train", "peft"),
    adopt=adopt,
    summary=_summary,
)
