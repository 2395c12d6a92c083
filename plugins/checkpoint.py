"""Sharded checkpoints with torch.distributed.checkpoint (DCP): atomic, verifiable, any layout loads any.

A checkpoint is a folder `step_NNNNNNN/` holding DCP's files and a `manifest.json`, written last:
  every rank writes its shards into `.step_NNNNNNN.partial/`; after a barrier rank 0 records every file's
  size and sha256 in the manifest, fsyncs and renames the folder into place. A folder without a manifest,
  or whose files do not match it, is never taken for a checkpoint.

The state is {"model": ..., "optim": ...} keyed by parameter names (optimizer state flattened), so the
pipeline/tensor/data-parallel layout that wrote it does not matter to the one that reads it.
"""
from __future__ import annotations

import re
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from plugins.fsio import (atomic_write_json, file_table, publish_dir, read_json, remove_tree,
                          verify_file_table)

MANIFEST = "manifest.json"
FORMAT = "orchestrator-dcp-v1"
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:07d}"


@contextmanager
def _quiet_single_process():
    """DCP warns on every call without a process group that it "assumes" one process: that is our intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _is_rank0() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def training_state(model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> dict:
    """The DCP state of a model and its optimizer (fresh tensors to load into, or current values to save)."""
    state = {"model": get_model_state_dict(model, options=_OPTIONS)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer, options=_OPTIONS)
    return state


def apply_training_state(model: nn.Module, optimizer: Optional[torch.optim.Optimizer], state: dict) -> None:
    set_model_state_dict(model, state["model"], options=_OPTIONS)
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"], options=_OPTIONS)


def save(path: Path, model: nn.Module, optimizer: Optional[torch.optim.Optimizer], meta: dict) -> Path:
    """Write a complete checkpoint at `path` (every rank calls this). Returns path."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial")
    if _is_rank0():
        remove_tree(partial)
        if path.exists():  # a complete checkpoint of this step exists already: keep it, it is identical
            raise FileExistsError(f"checkpoint {path} exists")
    _barrier()
    with _quiet_single_process():
        dcp.save(training_state(model, optimizer), checkpoint_id=str(partial))
    _barrier()
    if _is_rank0():
        manifest = {"format": FORMAT, **meta, "files": file_table(partial, exclude=(MANIFEST,))}
        atomic_write_json(partial / MANIFEST, manifest)
        publish_dir(partial, path)
    _barrier()
    return path


def load(path: Path, model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> dict:
    """Load a checkpoint into model (and optimizer) in whatever layout they are; returns its manifest."""
    manifest = read_manifest(path)
    state = training_state(model, optimizer)
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=str(path))
    apply_training_state(model, optimizer, state)
    return manifest


def read_manifest(path: Path) -> dict:
    manifest_path = Path(path) / MANIFEST
    if not manifest_path.is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint: {MANIFEST} is missing")
    manifest = read_json(manifest_path)
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: unknown checkpoint format {manifest.get('format')!r} (expected {FORMAT})")
    return manifest


def verify(path: Path, checksums: bool = True) -> list[str]:
    """Problems with the checkpoint at path (empty list: complete and intact)."""
    try:
        manifest = read_manifest(path)
    except (FileNotFoundError, ValueError) as e:
        return [str(e)]
    return verify_file_table(Path(path), manifest["files"], checksums=checksums)


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under root, oldest first (partial folders are ignored)."""
    found = []
    if Path(root).is_dir():
        for p in Path(root).iterdir():
            m = _STEP_DIR.match(p.name)
            if m and p.is_dir() and (p / MANIFEST).is_file():
                found.append((int(m.group(1)), p))
    return sorted(found)


def latest(root: Path, checksums: bool = True) -> Optional[tuple[int, Path, list[str]]]:
    """The newest checkpoint under root that verifies, with the problems of newer ones that did not."""
    rejected = []
    for step, path in reversed(complete_checkpoints(root)):
        problems = verify(path, checksums=checksums)
        if not problems:
            return step, path, rejected
        rejected.append(f"{path.name}: {'; '.join(problems)}")
    return None


def prune(root: Path, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints and any partial leftovers (rank 0 only)."""
    if not _is_rank0():
        return
    for _, path in complete_checkpoints(root)[:-keep] if keep > 0 else []:
        remove_tree(path)
    for p in Path(root).glob(".step_*.partial"):
        remove_tree(p)
