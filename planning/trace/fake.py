"""The fake world a role is traced in: torch's fake process group at the layout's world size, and fake tensors for
the weights, the batch's activations and everything after, with as little of the run's code patched as possible.

Everything runs under one FakeTensorMode(allow_non_fake_inputs=True), so the layout is built and the step runs
through the real code paths (build_layout, runtime.step.train_step). What cannot be fake, and why:
- the model's structure on the meta device and the DeviceMesh are built with the fake mode unset: meta parameters
  made under a fake mode carry a weakref that `to_empty` cannot swap ("Cannot swap t1 because it has weakref
  associated with it"), and the mesh reads its rank map back (`tolist()` of a fake tensor raises
  DataDependentOutputException). Neither holds weights.
- HostOps: host bookkeeping stays real: an op all of whose tensors are real and not on the meta device (counting a
  batch's labels, slicing its rows), and an integer or boolean tensor made from no tensor (arange for positions,
  DTensor's shard offsets, which it reads back with int()). Floating tensors made from nothing (weights, FSDP's
  gather buffers, gradients) stay fake: they are what would take memory.
- the optimizer's kernel (runtime/optim.py chooses fused for nn.Parameters) is chosen from the run's parameter
  types: `to_empty` under a fake mode leaves plain FakeTensors where the run has nn.Parameters, and the choice
  would fall to foreach, whose temporaries the run does not have (a third more on gpt_tiny).
- functional collectives (tensor parallelism's) take a fake mode for a compiler's trace (`_are_we_tracing`) and wait
  at once, where the run wraps their outputs in AsyncCollectiveTensor and waits at first use: told the truth, the
  trace keeps their outputs as long as the run does (megatron_hp2: communication 393 KiB at its peak, 655 real).
- DTensor's sharding propagation makes global-shape fake tensors with `detect_fake_mode() or FakeTensorMode()`:
  under ours it would reuse ours, and the memory tracker would count them; it is given a second fake mode.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def init_fake_world(rank: int, world_size: int) -> None:
    """A process group of `world_size` ranks that this one process plays rank `rank` of: collectives return at once
    with their outputs' shapes (torch.testing's FakeStore; the 'fake' backend registers with it)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if world_size > 1:
        dist.init_process_group(backend="fake", store=FakeStore(), rank=rank, world_size=world_size)


class HostOps(TorchDispatchMode):
    """Runs host bookkeeping for real under the fake mode (see the module's docstring for the rule)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor first turns the op into ops on its local tensors
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if tensors and not any(isinstance(t, FakeTensor) or t.is_meta for t in tensors):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if not tensors and isinstance(out, torch.Tensor) and not out.is_floating_point() and not out.is_meta:
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return out


def _as_run_types(impl_kwargs):
    @functools.wraps(impl_kwargs)
    def choose(impl, params, device):
        with unset_fake_temporarily():
            as_run = [torch.nn.Parameter(torch.empty(0, dtype=p.dtype, device="meta")) if type(p) is FakeTensor
                      else p for p in params]
        return impl_kwargs(impl, as_run, device)
    return choose


def _unfaked(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with unset_fake_temporarily():
            return fn(*args, **kwargs)
    return call


@contextlib.contextmanager
def fake_tensors():
    """The fake mode, entered with HostOps above it; yields the mode (the trackers compare against it)."""
    import torch.distributed.tensor._sharding_prop as sharding_prop
    from plugins.parallel import layout
    from runtime import optim

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    propagation = FakeTensorMode(allow_non_fake_inputs=True)
    import torch.distributed._functional_collectives as funcol

    eager = funcol._are_we_tracing
    funcol._are_we_tracing = lambda: False
    saved = (sharding_prop.detect_fake_mode, layout.build_on_meta, layout.build_mesh, optim._impl_kwargs)
    sharding_prop.detect_fake_mode = lambda *args, **kwargs: propagation
    layout.build_on_meta, layout.build_mesh = _unfaked(saved[1]), _unfaked(saved[2])
    optim._impl_kwargs = _as_run_types(saved[3])
    try:
        with mode, HostOps():
            yield mode
    finally:
        sharding_prop.detect_fake_mode, layout.build_on_meta, layout.build_mesh, optim._impl_kwargs = saved
        funcol._are_we_tracing = eager
