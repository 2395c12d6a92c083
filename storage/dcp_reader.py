"""A DCP checkpoint read a few tensors at a time by one process: what aggregation streams from.

DCP's metadata lists every entry of the saved state (`model.<name>`, `optim.state.<name>.<leaf>` tensors with
their global shape and dtype; `optim.param_groups.<name>` objects: each parameter's settings), so the full tensors
can be planned before any is read. `read` loads the named entries only: DCP assembles each from the shards every rank wrote,
reading just their bytes, so memory holds what was asked for, never the whole checkpoint.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from storage.checkpoint import expand_settings, quiet_single_process


class _KnownMetadata(FileSystemReader):
    """DCP's file reader, given the checkpoint's metadata instead of reading it: dcp.load reads (unpickles) the
    whole .metadata file on every call, 37 ms at 0.2B (entries for every tensor of every rank), which was half the
    time of reading a 0.2B model's optimizer state 64 MB at a time. A reader per call: the writer threads read at
    once."""

    def __init__(self, path: Path, metadata):
        super().__init__(str(path))
        self._metadata = metadata

    def read_metadata(self, *args, **kwargs):
        return self._metadata


class CheckpointReader:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._metadata = FileSystemReader(str(self.path)).read_metadata()
        self._entries = self._metadata.state_dict_metadata

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
        found = {k[len(prefix):]: v for k, v in state.items()}
        return expand_settings(found) if section == "optim" else found

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
            dcp.load(state, storage_reader=_KnownMetadata(self.path, self._metadata))
