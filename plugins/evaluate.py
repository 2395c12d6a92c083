"""Held-out loss: the same batches every time, so two evaluations of the same weights agree exactly."""
from __future__ import annotations

import torch


@torch.no_grad()
def eval_loss(model, loss_fn, batcher, n_batches: int) -> float:
    """Mean next-token loss over the first n_batches held-out batches."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for i in range(n_batches):
            batch = batcher.eval_batch(i)
            total += loss_fn(model(batch.inputs), batch.labels).item()
            count += batch.n_labels
    finally:
        model.train(was_training)
    return total / max(count, 1)
