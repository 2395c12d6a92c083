"""Gradients across the whole layout: tied copies kept equal, one global norm, one clip.

torch's clip_grad_norm_ sees only the parameters it is given, and with DTensors only their own mesh: with
pipeline stages, or parameters on different meshes, it returns a stage-local or inconsistent norm. Here
every rank sums the squares of its local gradient elements, each divided by how many ranks hold that same
element, and one all-reduce over the world gives the norm of the whole model's gradient.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate


def _local(g: torch.Tensor) -> torch.Tensor:
    return g.to_local() if isinstance(g, DTensor) else g


def reduce_partial_grads(params: list[torch.nn.Parameter]) -> None:
    """Sequence parallelism leaves LayerNorm gradients as Partial(sum) DTensors (one addend per rank).
    Reduce them in place, so that clipping and the optimizer act on the gradient itself, not on a copy."""
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            p.grad = g.redistribute(placements=[Replicate() if pl.is_partial() else pl for pl in g.placements])


def _copies(g: torch.Tensor, ranks_per_stage: int) -> int:
    """How many ranks of a pipeline stage hold this exact local gradient shard."""
    if isinstance(g, DTensor):  # any placement that is not a copy splits it (FSDP's _StridedShard included)
        shards = math.prod(g.device_mesh.size(i) for i, p in enumerate(g.placements)
                           if not (p.is_replicate() or p.is_partial()))
        return max(ranks_per_stage // shards, 1)
    return ranks_per_stage


def clip_grad_norm(named_params: list[tuple[str, torch.nn.Parameter]], max_norm: float, skip: set[str],
                   ranks_per_stage: int, world: bool, loss_scale: float = 1.0) -> torch.Tensor:
    """Clip all gradients by their global norm; returns the norm (before clipping), the same on every rank.

    skip: names of parameters that are extra copies of another (a tied head on the last pipeline stage):
    they are scaled but counted once. world: all-reduce over every rank (False for one process).
    loss_scale: the gradients are those of the loss times this (fp16): the norm is divided by it, and the
    gradients are unscaled and clipped by one multiplication. A norm of inf/nan means a gradient overflowed."""
    reduce_partial_grads([p for _, p in named_params])
    grads = [p.grad for _, p in named_params if p.grad is not None]
    counted = [_local(p.grad) for n, p in named_params if p.grad is not None and n not in skip]
    weights = [1.0 / _copies(p.grad, ranks_per_stage) for n, p in named_params if p.grad is not None and n not in skip]
    if counted:
        # weighted by python floats: torch.tensor(weights, device=cuda) would wait for the GPU (a pageable copy)
        squares = torch._foreach_pow([n.float() for n in torch._foreach_norm(counted, 2)], 2)
        sq = torch.stack(torch._foreach_mul(squares, weights)).sum()
    else:
        sq = torch.zeros((), device=grads[0].device if grads else "cpu")
    if world:
        dist.all_reduce(sq)
    norm = sq.sqrt() / loss_scale if loss_scale != 1 else sq.sqrt()
    if (math.isfinite(max_norm) or loss_scale != 1) and grads:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0) / loss_scale
        torch._foreach_mul_([_local(g) for g in grads], coef)
    return norm


class TiedGradients:
    """Keeps the copies of a tied weight equal (e.g. the embedding used by the first and the last pipeline
    stage): their gradients are summed, over local copies and then across the ranks holding them, and every
    copy receives the sum, as the single shared parameter of a one-process model would.

    Megatron's "embedding group" / ColossalAI's shared module; torch has no API for it."""

    def __init__(self, copies: list[torch.nn.Parameter], group: Optional[dist.ProcessGroup]):
        self.copies, self.group = copies, group

    def sync(self) -> None:
        for c in self.copies:
            # a vocab-parallel embedding's backward leaves a Replicate gradient on a Shard(0) weight (no data
            # parallelism reshards it): take this rank's shard, as the copy on the other stage holds one
            if isinstance(c.grad, DTensor) and isinstance(c, DTensor) and c.grad.placements != c.placements:
                c.grad = c.grad.redistribute(c.device_mesh, c.placements)
        grads = [c.grad for c in self.copies if c.grad is not None]
        if not self.copies or (len(self.copies) == 1 and self.group is None):
            return
        local = [_local(g) for g in grads]
        total = torch.stack(local).sum(0) if local else torch.zeros_like(_local(self.copies[0]))
        if self.group is not None:
            dist.all_reduce(total, group=self.group)
        for c in self.copies:
            if c.grad is None:
                c.grad = torch.zeros_like(c)
            _local(c.grad).copy_(total)
