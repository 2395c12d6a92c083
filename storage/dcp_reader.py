"""A DCP checkpoint read a few tensors at a time by one process: what aggregation streams from.

DCP's metadata lists every entry of the saved state (`model.<name>`, `optim.state.<name>.<leaf>` tensors with
their global shape and dtype; `optim.param_groups.<name>.<setting>` objects), so the full tensors can be planned
before any is read. `read` loads the named entries only: DCP assembles each from the shards every rank wrote,
reading just their bytes, so memory holds what was asked for, never the whole checkpoint.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from storage.checkpoint import quiet_single_process


class CheckpointReader:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._entries = FileSystemReader(str(self.path)).read_metadata().state_dict_metadata

    def tensors(self, section: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """{name: (shape, dtype)} of the tensors of a section ("model" or "optim"), names without the section."""
        prefix = f"{section}."
        return {k[len(prefix):]: (tuple(v.size), v.properties.dtype) for k, v in self._entries.items()
                if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)}

    def objects(self, section: str) -> dict[str, Any]:
        """The non-tensor entries of a section (the optimizer's param-group settings), read now."""
        prefix = f"{section}."
        state = {k: None for k, v in self._entries.items() if k.startswith(prefix) and isinstance(v, BytesStorageMetadata)}
        if state:
            self._load(state)
        return {k[len(prefix):]: v for k, v in state.items()}

    def read(self, section: str, names: list[str]) -> dict[str, torch.Tensor]:
        """The full tensors of these entries of a section (assembled from every rank's shards)."""
        state = {}
        for name in names:
            meta = self._entries[f"{section}.{name}"]
            state[f"{section}.{name}"] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        self._load(state)
        return {k[len(section) + 1:]: v for k, v in state.items()}

    def _load(self, state: dict) -> None:
        with quiet_single_process():
            dcp.load(state, checkpoint_id=str(self.path))
