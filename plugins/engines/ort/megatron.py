"""Megatron's f and g around shard-local compute (torch keeps the collectives; ORT sees local tensors).

f: identity forward, all-reduce of the input gradient backward (the input of column-parallel compute);
g: all-reduce forward, identity backward (the partial output of row-parallel compute).
torch.distributed.nn.functional.all_reduce is NOT g: it all-reduces in backward too.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class CopyToHP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromHP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone(memory_format=torch.contiguous_format)  # x belongs to the producing graph: reduce a copy
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None
