"""Held-out loss: the same batches every time, so two evaluations of the same weights agree exactly."""
from __future__ import annotations

import contextlib
from typing import Callable, Iterable

import torch
from torch import nn


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


@torch.no_grad()
def eval_loss_by_piece(pieces: Iterable[Callable[[], nn.Module]], loss_fn, batcher, n_batches: int,
                       autocast=contextlib.nullcontext, tokens_per_chunk: int = 2**16) -> float:
    """eval_loss's number for a model too big to hold: `pieces` make its parts in order (the embedding, each block,
    the head), each with its weights; every part runs on the batches' hidden states and is dropped before the next
    is made. The same operations in the same order as the whole model's forward, so the same result, with one
    part's weights and the hidden states of a chunk of batches (at most tokens_per_chunk tokens, at least one batch)
    in memory. Over several chunks the parts are made again for each."""
    batches = [batcher.eval_batch(i) for i in range(n_batches)]
    makers = list(pieces)
    total, count = 0.0, 0
    for chunk in _chunks(batches, tokens_per_chunk):
        hidden = [b.inputs for b in chunk]
        for i, make in enumerate(makers):
            piece = make().eval()
            with autocast():
                if i < len(makers) - 1:
                    hidden = [piece(h) for h in hidden]
                else:  # the head: the logits of one batch at a time
                    for h, b in zip(hidden, chunk):
                        total += loss_fn(piece(h), b.labels).item()
                        count += b.n_labels
            del piece
    return total / max(count, 1)


def _chunks(batches: list, tokens: int) -> list[list]:
    """Consecutive batches grouped to at most `tokens` tokens a group (a larger batch alone)."""
    chunks: list[list] = [[]]
    used = 0
    for b in batches:
        if chunks[-1] and used + b.inputs.numel() > tokens:
            chunks.append([])
            used = 0
        chunks[-1].append(b)
        used += b.inputs.numel()
    return chunks
