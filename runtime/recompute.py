"""Selective recomputation by operator (memory level 3): TorchTitan's `activation_checkpoint.mode=selective
selective_ac_option=op`, the setting of its published Llama runs.

A layer runs under torch's checkpoint with a policy that keeps the outputs of the costly operators: every other
matmul of the layer (the first, third, ...: half the matmul FLOPs need not be redone), the attention kernel's
output, and a reduce-scatter's (sequence parallelism's collective, which recomputing would repeat). Everything else
(norms, rotary, activations, the other matmuls) is recomputed from the layer's input in backward. It sits between
level 1 (keep only the layer's input: a whole forward recomputed) and level 0 (keep everything).
"""
from __future__ import annotations

from collections import defaultdict

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_aten = torch.ops.aten
MATMULS = {_aten.mm.default, _aten.addmm.default}  # a Linear with a bias runs addmm: counted as TorchTitan's mm
ATTENTION = {getattr(_aten, name).default for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu") if hasattr(_aten, name)}
COLLECTIVES = {torch.ops._c10d_functional.reduce_scatter_tensor.default}


def _policy(counts: dict):
    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"  # the recomputation counts its own matmuls
        if func in MATMULS:
            counts[mode] += 1
            keep = counts[mode] % 2 == 1
        else:
            keep = func in ATTENTION or func in COLLECTIVES
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
    return policy


def op_policy():
    """checkpoint's context_fn: a fresh count per layer call, so the same matmuls are kept in every layer."""
    return create_selective_checkpoint_contexts(_policy(defaultdict(int)))
