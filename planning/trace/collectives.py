"""The collectives of a step by kind, group and bytes, counted where they reach the dispatcher: c10d's ops (what
torch.distributed's calls and FSDP2 issue) and the functional collectives (DTensor's redistributions). The same
counter runs on real ranks (gloo) and in the trace, so the two lists compare entry by entry.

A group is named by the mesh dimension it spans (pp, dp, hp), "world" for the default group, else by its size
(a tied embedding's group of first and last stage). Bytes: the largest tensor the op reads or writes (the gathered
buffer of an all-gather, the input of a reduce-scatter, the reduced tensor of an all-reduce).
"""
from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# op name fragments -> kind (c10d's in-place ops and the functional ones say the same things differently)
_KINDS = (("reduce_scatter", "reduce_scatter"), ("all_gather", "all_gather"), ("allgather", "all_gather"),
          ("all_reduce", "all_reduce"), ("allreduce", "all_reduce"), ("broadcast", "broadcast"),
          ("all_to_all", "all_to_all"), ("alltoall", "all_to_all"), ("send", "send"), ("recv", "recv"),
          ("barrier", "barrier"), ("reduce_", "reduce"), ("gather", "gather"), ("scatter", "scatter"))
_NOT_COUNTED = ("wait_tensor", "monitored_barrier", "_wrap_tensor_autograd")  # waits, and autograd's wrapper


def kind_of(func) -> str | None:
    """The collective's kind; None: not a collective."""
    if func.namespace not in ("c10d", "_c10d_functional", "_c10d_functional_autograd"):
        return None
    name = func._schema.name.split("::")[-1]
    if name.startswith(_NOT_COUNTED):
        return None
    return next((kind for fragment, kind in _KINDS if fragment in name), name)


def group_names(mesh) -> dict[str, str]:
    """group_name -> the mesh dimension it spans (only dimensions of more than one rank have collectives)."""
    names = {}
    if dist.is_initialized():
        names[dist.group.WORLD.group_name] = "world"
    if mesh is not None:
        for dim in mesh.mesh_dim_names:
            if mesh.size(mesh.mesh_dim_names.index(dim)) > 1:
                names[mesh.get_group(dim).group_name] = dim
    return names


def _group_of(args, names: dict[str, str]) -> tuple[str, object]:
    """The group's name, and the group (None where not found)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    for a in tree_leaves(args):
        pg = None
        if isinstance(a, str):  # the functional collectives name their group
            try:
                pg = _resolve_process_group(a)
            except (ValueError, RuntimeError, KeyError):
                continue
        elif isinstance(a, torch.ScriptObject):  # c10d's ops take the group boxed
            try:
                pg = dist.ProcessGroup.unbox(a)
            except (RuntimeError, TypeError):
                continue  # a ReduceOp
        if pg is not None:
            return names.get(pg.group_name, f"group of {pg.size()}"), pg
    return "?", None


class CollectiveCounter(TorchDispatchMode):
    """Counts by (kind, group), and a point-to-point op also by its peer (a global rank): a pipeline stage's sends
    and recvs (c10d.send / c10d.recv_, which every isend, irecv and batch_isend_irecv reaches, the peer given as
    the group's rank)."""

    def __init__(self, mesh=None):
        super().__init__()
        self.names = group_names(mesh)
        self.counts: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **kwargs)
        kind = kind_of(func)
        if kind is not None:
            tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            group, pg = _group_of((args, kwargs), self.names)
            peer = None
            if kind in ("send", "recv") and pg is not None and isinstance(args[2], int):
                peer = dist.get_global_rank(pg, args[2])
            entry = self.counts[(kind, group, peer)]
            entry[0] += 1
            entry[1] += max((t.numel() * t.element_size() for t in tensors), default=0)
        return out

    def result(self) -> list[dict]:
        return [{"kind": k, "group": g, "count": c, "bytes": b, **({} if peer is None else {"peer": peer})}
                for (k, g, peer), (c, b) in sorted(self.counts.items(), key=lambda kv: (*kv[0][:2], kv[0][2] or 0))]
