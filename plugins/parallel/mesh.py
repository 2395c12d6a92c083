"""The rank's place in the layout: one DeviceMesh with dims (pp, dp, hp)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from plugins.parallel import world_size

DIMS = ("pp", "dp", "hp")


@dataclass(frozen=True)
class Coordinates:
    pp: int = 0
    dp: int = 0
    hp: int = 0
    pp_size: int = 1
    dp_size: int = 1
    hp_size: int = 1

    @property
    def world_size(self) -> int:
        return self.pp_size * self.dp_size * self.hp_size


def build_mesh(parallel, device: torch.device) -> tuple[Optional[DeviceMesh], Coordinates]:
    """The mesh of a multi-rank layout (None for one process) and this rank's coordinates in it."""
    sizes = (parallel.pp, parallel.dp, parallel.hp)
    if sizes == (1, 1, 1):
        return None, Coordinates()
    if not dist.is_initialized() or dist.get_world_size() != world_size(parallel):
        raise RuntimeError(f"layout pp{parallel.pp} x dp{parallel.dp} x hp{parallel.hp} needs "
                           f"{world_size(parallel)} initialised ranks")
    mesh = init_device_mesh(device.type, sizes, mesh_dim_names=DIMS)
    coords = Coordinates(*(mesh.get_local_rank(d) for d in DIMS), *sizes)
    return mesh, coords


def pick_device() -> torch.device:
    """CUDA (one device per local rank) when present, else CPU.

    The local rank indexes the GPUs this process sees. Where every rank of a node sees all of them (cluster=local,
    SLURM's --gpus-per-node), that is its own GPU; where SLURM binds GPUs per task (--gpus-per-task, which
    cluster.gpus_per_task asks for), each rank sees only its own, as device 0, and `cuda:LOCAL_RANK` would be an
    invalid device ordinal on every rank but the first of a node. The remainder serves both."""
    import os

    if torch.cuda.is_available():
        index = int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")
