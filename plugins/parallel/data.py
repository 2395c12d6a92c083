"""Data parallelism with FSDP2: `replicate` (DDP-like: whole parameters everywhere, gradients all-reduced)
or `shard` (fully sharded: parameters, gradients and optimizer state split across dp ranks). Plain DDP does
not compose with DTensor tensor parallelism; both FSDP2 forms do."""
from __future__ import annotations

from torch import nn


def apply_dp(module: nn.Module, dp_mesh, mode: str, blocks: list[nn.Module],
             reshard_after_forward: bool = True, mp_policy=None) -> nn.Module:
    """FSDP2 averages gradients over dp ranks; the runners scale each rank's backward loss by dp so the
    average is the sum the global-mean loss needs (a divide factor of 1 would need PREMUL_SUM, which gloo
    does not have).

    reshard_after_forward=False keeps each block's gathered parameters until its backward: needed when an
    engine (ONNX Runtime) holds pointers to them from forward to backward, which FSDP's free-and-regather
    would invalidate. mp_policy: FSDP2's MixedPrecisionPolicy (the compute dtype of bf16/fp16 runs)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp_policy = mp_policy or MixedPrecisionPolicy()
    if mode == "shard":
        from torch.distributed.fsdp import fully_shard

        for block in blocks:  # per block, so only one block's full weights exist at a time
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
        fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
    elif mode == "replicate":
        from torch.distributed._composable.replicate_with_fsdp import replicate

        replicate(module, mesh=dp_mesh, mp_policy=mp_policy)
    else:
        raise ValueError(f"parallel.dp_mode={mode!r}: use replicate or shard")
    return module


def set_gradient_sync(modules: list[nn.Module], enabled: bool) -> None:
    """Skip the dp gradient reduction for all but the last microbatch of a step (accumulate locally)."""
    for m in modules:
        if hasattr(m, "set_requires_gradient_sync"):
            m.set_requires_gradient_sync(enabled)
