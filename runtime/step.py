"""One optimizer step over the global batch, and what it reads (resolved once per run)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Optional

import torch

from runtime.evaluate import policy_scores
from runtime.optim import set_lr
from runtime.precision import LossScaler


@dataclass(frozen=True)
class StepSettings:
    """What a step reads, resolved once: config lookups cost microseconds each in the hot loop."""
    grad_clip: float            # inf: measure the norm, clip nothing
    dropout_seed: Optional[int]  # reseed per step (resume-exact dropout masks); None when there is no dropout
    skip_nonfinite: bool = False  # check every step's gradient norm (one read per step) and drop non-finite ones
    microbatches: int = 1
    repack_to: int = 0           # padded rows: each rank packs its rows' real tokens into as few rows as hold them,
    #                              as wide as a multiple of this (0: rows keep their shape: a pipeline, ORT,
    #                              compiled graphs and FlexAttention's compiled kernel want one shape)

    @staticmethod
    def of(cfg, one_shape: bool = False) -> "StepSettings":
        """one_shape: the engine's graphs take one input shape (plugins/engines: EngineSpec.one_shape)."""
        p = cfg.parallel
        repacks = not cfg.data.packing and padding_kept(cfg, one_shape) is None
        return StepSettings(cfg.train.grad_clip if cfg.train.grad_clip > 0 else math.inf,
                            cfg.train.seed if cfg.model.dropout > 0 else None, cfg.train.nonfinite == "skip",
                            p.microbatches, math.lcm(8, p.hp if p.sequence_parallel else 1) if repacks else 0)


def padding_kept(cfg, one_shape: bool) -> Optional[str]:
    """Why padded rows (data.packing=false) reach the blocks padded in this layout; None: each rank packs its
    rows' real tokens into fewer rows with a document mask (plugins/data/packing.repack), so that padding never
    reaches the blocks. The kinds that keep them want one input shape every step, or take no mask."""
    if not cfg.data.get("balance_ranks", True):
        return "data.balance_ranks=false"
    if cfg.parallel.pp > 1:
        return "a pipeline's stages exchange activations of one shape (parallel.pp > 1)"
    if one_shape:
        return f"engine={cfg.engine.name}'s graphs take one input shape and no document mask"
    if cfg.triton.enabled:
        return "compiled blocks (triton.enabled) are compiled for one shape"
    if cfg.triton.attention == "flex":
        return "FlexAttention's compiled kernel (triton.attention=flex) wants one shape"
    return None


def train_step(layout, optimizers, batch, step: int, lr: float, s: StepSettings, probe,
               scaler: Optional[LossScaler] = None) -> dict:
    """One optimizer step over the global batch (this rank's share of it). Returns the step's record with the loss
    and the gradient norm still on the device (runtime.metrics.MetricsWindow reads them back, many steps at once):
    nothing here waits for the GPU, except fp16's overflow check."""
    scaler = scaler or LossScaler(enabled=False)
    t0 = time.perf_counter()
    if s.dropout_seed is not None:
        torch.manual_seed(s.dropout_seed + step)  # dropout masks depend on the step only
    for opt in optimizers:
        set_lr(opt, lr)
    # the loss is a mean over the whole batch's labels (an objective of rows: over what it counts, a preference
    # objective's pairs), however it is split
    objective = layout.runner.objective
    n_labels = objective.count(batch, policy_scores(layout, s.repack_to)) if objective is not None else \
        max(batch.n_labels, 1)
    probe.start_step()
    loss_scale = scaler.scale
    inputs, labels, documents, counts = layout.rank_inputs(batch, s.repack_to, s.microbatches,
                                                           rows_kept=objective is not None)
    loss = layout.runner.train_step(inputs, labels, n_labels, loss_scale, documents, counts,
                                    layout.local_batch(batch.row_inputs))
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
    if objective is not None:  # the objective's measures (rewards, log-probabilities), read back with the loss
        row["objective"] = layout.objective_metrics(n_labels)
    if layout.timeline is not None:
        row["pipeline_idle_fraction"] = layout.timeline.idle_fraction()
    if layout.coords.dp_size > 1 and batch.real is not None:  # the straggler's share: 1 when ranks are balanced
        row["rank_tokens_max_over_mean"] = layout.rank_token_spread(batch.real)
    return row
