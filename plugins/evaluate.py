"""Held-out loss: the same batches every time, so two evaluations of the same weights agree exactly."""
from __future__ import annotations

import contextlib

import torch


@torch.no_grad()
def eval_loss(model, loss_fn, batcher, n_batches: int, autocast=contextlib.nullcontext) -> float:
    """Mean next-token loss over the first n_batches held-out batches (forwards in the `autocast` context)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for i in range(n_batches):
            batch = batcher.eval_batch(i)
            with autocast():
                logits = model(batch.inputs)
            total += loss_fn(logits, batch.labels).item()
            count += batch.n_labels
    finally:
        model.train(was_training)
    return total / max(count, 1)
