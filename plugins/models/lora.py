"""LoRA (Hu et al., 2021; `peft`'s LoraModel): low-rank adapters beside a model family's own Linears, the base weights
frozen.

A target Linear keeps its name and its weight (`layers.0.attn.wq.weight` stays what the checkpoints, the Hugging Face
mapping and the ONNX graph know) and gains two parameters beside it, `lora_A` (r x in) and `lora_B` (out x r): its
forward is the Linear's plus dropout(x) A^T B^T * alpha / r, as peft's. Everything else is frozen (requires_grad
False: no gradient, no optimizer state, left out of the checkpoints), except peft.trainable's. The adapters are added
on the meta device before the layout splits and shards the model, so every layout places them as it places the
Linear they sit beside (a pipeline stage holds its blocks' adapters; data parallelism shards them with the rest).

Initial values as peft's: A kaiming-uniform (a = sqrt(5), torch's Linear default), B zero, so the first step's loss
is the base model's. A is drawn in full from a generator of its own name and the seed, then each rank keeps its
shard: the values do not depend on the layout.
"""
from __future__ import annotations

import contextlib
import math
import zlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from storage.weights import set_constant, set_full

ADAPTERS = ("lora_A", "lora_B")
GROUPS = {"attention": ("wq", "wk", "wv", "wo"), "mlp": ("fc1", "fc2", "fc3")}


class LoRALinear(nn.Linear):
    """An nn.Linear with adapters (a module's class is swapped to this one: its parameters and name stay)."""

    rank: int
    scaling: float
    lora_dropout: float  # a probability, not a submodule: tensor parallelism's styles treat every submodule as a Linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        x = F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout > 0 else x
        low = F.linear(x, self.lora_A)
        # (x A^T) B^T * scaling added into the Linear's output in place (out is not saved for backward): peft's
        # `out + lora_B(lora_A(x)) * scaling` makes two more tensors of the output's size per Linear, whose freed
        # blocks a CPU process's heap keeps (gpt2_124m r=16, 4x256: the step's peak 2.93 GB against 1.95 here)
        # (an in-place op autocast leaves alone: B goes to the compute dtype x A^T came out in)
        out.view(-1, out.shape[-1]).addmm_(low.reshape(-1, low.shape[-1]), self.lora_B.to(low.dtype).t(),
                                           alpha=self.scaling)
        return out


@contextlib.contextmanager
def adapters_off(modules: list[nn.Module]) -> Iterator[None]:
    """The modules compute as their base model inside the block (peft's disable_adapter): every adapter's output
    scaled by 0, which adds exactly nothing to its Linear's; their scales back after it."""
    linears = [m for part in modules for m in part.modules() if isinstance(m, LoRALinear)]
    kept = [m.scaling for m in linears]
    for m in linears:
        m.scaling = 0.0
    try:
        yield
    finally:
        for m, scaling in zip(linears, kept):
            m.scaling = scaling


def shard_adapters(model: nn.Module) -> None:
    """After tensor parallelism split the Linears (transformer.parallelize): each adapter as Megatron's LoRA splits
    it. A column-split Linear (weight Shard(0)) keeps B split by output, as torch's ColwiseParallel left it, and A
    whole; a row-split one (weight Shard(1)) has A split by input and B whole (RowwiseParallel leaves both plain).
    Then x A^T is whole (column) or a partial sum (row), and the adapter's output is placed as the Linear's own."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    for module in model.modules():
        if not isinstance(module, LoRALinear) or not isinstance(module.weight, DTensor):
            continue
        mesh, (split,) = module.weight.device_mesh, module.weight.placements
        column = split == Shard(0)
        for name, placement in (("lora_A", Replicate() if column else Shard(1)),
                                ("lora_B", Shard(0) if column else Replicate())):
            full = getattr(module, name)
            if isinstance(full, DTensor):
                full = full.full_tensor() if full.device.type != "meta" else torch.empty(full.shape, device="meta")
            setattr(module, name, nn.Parameter(distribute_tensor(full, mesh, [placement])))


def target_names(peft_cfg) -> set[str]:
    """The Linear names (their last component) peft.targets names: groups expanded."""
    return {n for t in peft_cfg.targets for n in GROUPS.get(t, (t,))}


def targets(model: nn.Module, wanted: set[str]) -> list[tuple[str, nn.Linear]]:
    """The model's Linears of these names (target_names) that get adapters (the head never: it is peft.trainable's
    to train)."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in wanted and not name.endswith("lm_head")]


def apply_lora(model: nn.Module, peft_cfg) -> nn.Module:
    """Adapters on the targets (on whatever device the weights are: the meta device for plans and layouts), every
    other parameter frozen but peft.trainable's."""
    for _, linear in targets(model, target_names(peft_cfg)):
        out_features, in_features = linear.weight.shape
        device = linear.weight.device
        linear.lora_A = nn.Parameter(torch.empty(peft_cfg.rank, in_features, device=device))
        linear.lora_B = nn.Parameter(torch.empty(out_features, peft_cfg.rank, device=device))
        linear.rank, linear.scaling = peft_cfg.rank, peft_cfg.alpha / peft_cfg.rank
        linear.lora_dropout = float(peft_cfg.dropout)
        linear.__class__ = LoRALinear
    for name, p in model.named_parameters():
        p.requires_grad_(is_trained(name, peft_cfg))
    return model


def in_compute_dtype(name: str, shape, trainable: bool) -> bool:
    """Kept in the compute dtype under mixed precision (bf16, fp16): a frozen weight of a block's Linear, LoRA's base,
    which autocast and FSDP2 cast to that dtype in every forward anyway. Half the bytes, and no fp32 master copy, as
    nothing updates it; the adapters (their gradients and AdamW's moments), norms, embeddings and head stay fp32."""
    return not trainable and len(shape) == 2 and name.startswith("layers.")


def store_frozen(model: nn.Module, dtype: torch.dtype) -> None:
    """The parameters in_compute_dtype names, in `dtype` (on the meta device, before the layout places them)."""
    for name, p in list(model.named_parameters()):
        if in_compute_dtype(name, p.shape, p.requires_grad):
            owner, attr = name.rsplit(".", 1)
            setattr(model.get_submodule(owner), attr, nn.Parameter(p.detach().to(dtype), requires_grad=False))


def is_adapter(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in ADAPTERS


def is_trained(name: str, peft_cfg) -> bool:
    """Whether a parameter trains under LoRA: an adapter, or one peft.trainable names."""
    if is_adapter(name):
        return True
    return any(name.endswith(".bias") if t == "bias" else (name == t or name.endswith("." + t))
               for t in peft_cfg.trainable)


def _seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(("lora:" + name).encode())) % (2**63)


def initial_A(name: str, shape: tuple, seed: int) -> torch.Tensor:
    """lora_A's initial value: kaiming-uniform with a = sqrt(5) (torch's and peft's), from its own generator."""
    bound = 1.0 / math.sqrt(shape[1])  # kaiming_uniform_(a=sqrt(5)): gain sqrt(2 / 6), bound gain * sqrt(3 / fan_in)
    g = torch.Generator().manual_seed(_seed(seed, name))
    return torch.rand(shape, generator=g).mul_(2 * bound).sub_(bound)


def init_adapters(model: nn.Module, seed: int) -> None:
    """A as initial_A (each rank its shard), B zero: the model computes what its base does."""
    for name, p in model.named_parameters():
        if name.endswith(".lora_A"):
            set_full(p, initial_A(name, tuple(p.shape), seed).to(p.dtype))
        elif name.endswith(".lora_B"):
            set_constant(p, 0.0)
