"""Sharded checkpoints with torch.distributed.checkpoint (DCP): atomic, verifiable, any layout loads any.

A checkpoint is a folder `step_NNNNNNN/` holding DCP's files and a `manifest.json`, written last:
  every rank writes its shards into `.step_NNNNNNN.partial/`; after a barrier rank 0 records every file's
  size and sha256 in the manifest, fsyncs and renames the folder into place. A folder without a manifest,
  or whose files do not match it, is never taken for a checkpoint.

The state is {"model": ..., "optim": ...} keyed by parameter names (optimizer state flattened), so the
pipeline/tensor/data-parallel layout that wrote it does not matter to the one that reads it.
"""
from __future__ import annotations

import os
import re
import threading
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Mapping, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from storage.dcp_writer import HashingWriter, gather_hashes, quick_handoff
from storage.weights import load_full
from storage.fsio import (atomic_write_json, file_table, kept_aside, publish_dir, read_json, remove_tree,
                          verify_file_table)

MANIFEST = "manifest.json"
FORMAT = "orchestrator-dcp-v2"  # v2: each parameter's optimizer settings one entry (group_settings)
FLAT_SETTINGS = "orchestrator-dcp-v1"  # each setting of each parameter an entry of its own: still read
# frozen parameters (LoRA's base weights: train.init_from's, read from there) are not a checkpoint's: it holds what
# trains, and names the base it applies to
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=True)
# set_model_state_dict is strict about frozen parameters even so: the state given is every entry training_state
# names (each looked up), so nothing trained is left out by not being strict
_LOADING = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=True, strict=False)


def _trained(module: nn.Module, state: dict) -> dict:
    """A module's state without its frozen parameters: get_model_state_dict keeps a frozen weight's tied copy (a
    head tied to a frozen embedding) under the copy's name."""
    frozen = {n for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in state.items() if k not in frozen}
_STEP_DIR = re.compile(r"^step_(\d+)$")
SINGLE_PROCESS = "torch.distributed is disabled"  # DCP's warning on every call without a process group


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:07d}"


@contextmanager
def quiet_single_process():
    """DCP warns on every call without a process group that it "assumes" one process: that is our intent. The
    filter, once set, stays: warnings.catch_warnings would swap the process's filters under the other threads that
    call DCP (a background save's writer, the aggregate's writers)."""
    if not any(f[1] is not None and f[1].pattern == SINGLE_PROCESS for f in warnings.filters):
        warnings.filterwarnings("ignore", message=SINGLE_PROCESS)
    yield


def _barrier(group: Optional[dist.ProcessGroup] = None) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group=group)


def _is_rank0() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


Parts = list[tuple[nn.Module, Optional[torch.optim.Optimizer]]]


def _canonical_optim_key(key: str, aliases: dict[str, str]) -> str:
    """"state.lm_head.weight.exp_avg" -> "state.wte.weight.exp_avg" when lm_head.weight is a tied copy."""
    section, rest = key.split(".", 1)
    fqn, leaf = rest.rsplit(".", 1)
    return f"{section}.{aliases.get(fqn, fqn)}.{leaf}"


SETTINGS = "param_groups."  # the optimizer's flattened settings: param_groups.<parameter>.<setting>


def group_settings(optim: dict) -> dict:
    """An optimizer state's settings, one entry a parameter: `param_groups.<name>` = ((setting, value), ...) (a tuple
    without tensors, which DCP writes as one object) instead of an entry per setting. torch's flattened optimizer
    state gives every parameter its group's eleven AdamW settings as entries of their own: 1,463 of a 133-parameter
    model's 1,859 entries, each planned, gathered to rank 0, pickled and written apart (a save of 428k parameters
    took 0.5-0.7 s of CPU, 0.26-0.33 s grouped). A setting held as a tensor stays an entry of its own."""
    grouped: dict = {}
    settings: dict[str, list] = {}
    for k, v in optim.items():
        if k.startswith(SETTINGS) and not isinstance(v, torch.Tensor):
            name, setting = k[len(SETTINGS):].rsplit(".", 1)
            settings.setdefault(SETTINGS + name, []).append((setting, v))
        else:
            grouped[k] = v
    return {**grouped, **{k: tuple(sorted(pairs)) for k, pairs in settings.items()}}


def expand_settings(optim: dict) -> dict:
    """group_settings undone: `param_groups.<name>.<setting>` entries again (a flat state passes unchanged)."""
    flat: dict = {}
    for k, v in optim.items():
        if k.startswith(SETTINGS) and isinstance(v, tuple) and all(
                isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str) for pair in v):
            flat.update({f"{k}.{setting}": value for setting, value in v})
        else:
            flat[k] = v
    return flat


def training_state(parts: Parts, aliases: Optional[dict[str, str]] = None, grouped: bool = True) -> dict:
    """The DCP state of this rank's modules and optimizers, keyed by parameter name (optimizer state
    flattened; its settings one entry a parameter unless not `grouped`: FLAT_SETTINGS checkpoints). A tied copy
    is keyed by the weight it copies, so a layout that holds two copies (first and last pipeline stage) and one
    that holds one shared weight write and read the same entries."""
    aliases = aliases or {}
    model: dict = {}
    optim: dict = {}
    for module, optimizer in parts:
        for k, v in _trained(module, get_model_state_dict(module, options=_OPTIONS)).items():
            model.setdefault(aliases.get(k, k), v)
        if optimizer is not None:
            for k, v in get_optimizer_state_dict(module, optimizer, options=_OPTIONS).items():
                optim.setdefault(_canonical_optim_key(k, aliases), v)
    if grouped:
        optim = group_settings(optim)
    return {"model": model, **({"optim": optim} if any(o is not None for _, o in parts) else {})}


def apply_training_state(parts: Parts, state: dict, aliases: Optional[dict[str, str]] = None) -> None:
    """Copy loaded values into every module and optimizer (each tied copy gets the canonical entry)."""
    aliases = aliases or {}
    optim = expand_settings(state.get("optim", {}))
    for module, optimizer in parts:
        own = _trained(module, get_model_state_dict(module, options=_OPTIONS))
        set_model_state_dict(module, {k: state["model"][aliases.get(k, k)] for k in own}, options=_LOADING)
        if optimizer is not None:
            own = get_optimizer_state_dict(module, optimizer, options=_OPTIONS)
            set_optimizer_state_dict(module, optimizer, {k: optim[_canonical_optim_key(k, aliases)]
                                                         for k in own}, options=_OPTIONS)


def save(path: Path, parts: Parts, meta: dict, aliases: Optional[dict[str, str]] = None) -> Path:
    """Write a complete checkpoint at `path` (every rank calls this). Returns path."""
    path = Path(path)
    partial = _begin(path)
    state = training_state(parts, aliases)
    writer = HashingWriter(partial)
    try:
        with quiet_single_process():
            dcp.save(state, storage_writer=writer)
    except (OSError, RuntimeError, CheckpointException) as e:  # DCP's own exception is a BaseException
        remove_tree(partial)  # never leave a half-written folder (or a full disk) behind
        raise _explained(e, path, state_bytes(state)) from e
    _publish(partial, path, meta, writer)
    return path


class PendingSave:
    """A checkpoint DCP writes in the background (dcp.async_save: the state was copied to host memory before
    training went on). A thread of its own then publishes it exactly as `save` does (every rank's files written,
    then rank 0 records their checksums in the manifest and renames the folder into place), so that hashing runs
    beside training too. It counts only once published: until then the folder is `.step_N.partial`, which a crash
    leaves and a restart sweeps away."""

    def __init__(self, path: Path, partial: Path, meta: dict, writer: HashingWriter, future, needed: int,
                 group: Optional[dist.ProcessGroup]):
        self.path, self.partial, self.meta, self.future, self.needed = path, partial, meta, future, needed
        self.writer, self.group, self.error = writer, group, None
        self.began, self.seconds = time.monotonic(), 0.0  # the write and its publication, once published
        # a daemon: a process that dies with a write in flight must not wait for its peers at exit
        self.publisher = threading.Thread(target=self._publish, name=f"publish {path.name}", daemon=True)
        self.publisher.start()

    def _publish(self) -> None:
        try:
            self.future.result()
            _publish(self.partial, self.path, self.meta, self.writer, self.group)
            self.seconds = time.monotonic() - self.began
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            self.error = e
        finally:
            quick_handoff.end()

    def finish(self) -> Path:
        """Wait until the checkpoint is published (every rank calls this). Returns its path."""
        self.publisher.join()
        if self.error is not None:
            remove_tree(self.partial)
            raise _explained(self.error, self.path, self.needed) from self.error
        return self.path


def save_async(path: Path, parts: Parts, meta: dict, aliases: Optional[dict[str, str]] = None,
               group: Optional[dist.ProcessGroup] = None) -> PendingSave:
    """Start writing a checkpoint at `path` and return once the state is copied to host memory (every rank calls
    this). `group`: a gloo process group of its own (the writer's collectives run beside training's)."""
    path = Path(path)
    partial = _begin(path)
    state = training_state(parts, aliases)
    needed, writer = state_bytes(state), HashingWriter(partial)
    quick_handoff.begin()  # until published (PendingSave._publish)
    try:
        with quiet_single_process():  # the writer stages too: a copy of the state in host memory
            future = dcp.async_save(state, storage_writer=writer, process_group=group)
    except (OSError, RuntimeError, CheckpointException) as e:
        quick_handoff.end()
        remove_tree(partial)
        raise _explained(e, path, needed) from e
    return PendingSave(path, partial, meta, writer, future, needed, group)


def _begin(path: Path) -> Path:
    """The partial folder a save of `path` writes into, emptied (every rank, after rank 0 prepared it)."""
    partial = path.with_name(f".{path.name}.partial")
    if _is_rank0():
        remove_tree(partial)
        if path.exists():  # a complete checkpoint of this step exists already: keep it, it is identical
            raise FileExistsError(f"checkpoint {path} exists")
    _barrier()
    return partial


def _publish(partial: Path, path: Path, meta: dict, writer: HashingWriter,
             group: Optional[dist.ProcessGroup] = None) -> None:
    """Once every rank's files are written: rank 0 records them in the manifest, with the checksums each rank took
    as it wrote them, and renames the folder into place."""
    written = gather_hashes(writer, group)
    if _is_rank0():
        manifest = {"format": FORMAT, **meta, "files": file_table(partial, exclude=(MANIFEST,), known=written)}
        atomic_write_json(partial / MANIFEST, manifest)
        publish_dir(partial, path)
    _barrier(group)


def state_bytes(state: dict) -> int:
    """Bytes of the tensors in a (nested) state: roughly what a checkpoint of it takes on disk."""
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state
        return local.numel() * local.element_size()
    return 0


def _explained(error: BaseException, path: Path, needed: int) -> BaseException:
    """DCP reports a full disk as `[enforce fail at inline_container.cc:...] . unexpected pos ...`, or as a
    CheckpointException holding each rank's traceback: say so. Any other DCP failure becomes a RuntimeError (a
    BaseException would slip past every `except Exception` that reports a failed stage)."""
    import errno
    import shutil

    free = shutil.disk_usage(path.parent).free if path.parent.exists() else 0
    text = str(error)
    if getattr(error, "errno", None) == errno.ENOSPC or "unexpected pos" in text or "No space left" in text or \
            free < needed:
        said = next((line.strip() for line in text.splitlines() if "unexpected pos" in line or "No space" in line),
                    (text.splitlines() or [""])[0])[:200]
        disk = path.parent.absolute()
        while not os.path.ismount(disk) and disk != disk.parent:
            disk = disk.parent
        return OSError(errno.ENOSPC, f"no space left on the device to write the checkpoint {path}: {free / 2**20:,.1f} "
                                     f"MB free on the disk mounted at {disk}, about {needed / 2**20:,.1f} MB needed by "
                                     f"this rank (DCP said: {said}); "
                                     "the partial folder was removed. Free space or move cache_dir, then run the same "
                                     "command to continue")
    if isinstance(error, CheckpointException):
        return RuntimeError(f"writing the checkpoint {path} failed: {text[:2000]}")
    return error


def load_full_weights(parts: Parts, weights: Mapping[str, torch.Tensor], aliases: Optional[dict[str, str]] = None,
                      leave=None) -> None:
    """Load full (unsharded) weights, keyed by our parameter names, into this rank's modules in whatever layout
    they are: each keeps what it holds (its pipeline stage; its tensor- and data-parallel shards). `weights` may
    read each tensor when asked (storage.hf.Weights): only the rank's own parameters are read, one at a time."""
    for module, _ in parts:
        load_full(module, weights, aliases, leave)


def load(path: Path, parts: Parts, aliases: Optional[dict[str, str]] = None) -> dict:
    """Load a checkpoint into this rank's modules (and optimizers) in whatever layout they are, whatever
    layout wrote it; returns its manifest."""
    manifest = read_manifest(path)
    state = training_state(parts, aliases, grouped=manifest["format"] != FLAT_SETTINGS)
    with quiet_single_process():
        dcp.load(state, checkpoint_id=str(path))
    apply_training_state(parts, state, aliases)
    return manifest


def read_manifest(path: Path) -> dict:
    manifest_path = Path(path) / MANIFEST
    if not manifest_path.is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint: {MANIFEST} is missing")
    manifest = read_json(manifest_path)
    if manifest.get("format") not in (FORMAT, FLAT_SETTINGS):
        raise ValueError(f"{path}: unknown checkpoint format {manifest.get('format')!r} (expected {FORMAT})")
    return manifest


def verify(path: Path, checksums: bool = True, digest=None) -> list[str]:
    """Problems with the checkpoint at path (empty list: complete and intact). digest: how a file is hashed
    (fsio.verify_file_table's; e.g. a stage's KnownHashes.sha256, so that its cache entry reuses the hashes)."""
    try:
        manifest = read_manifest(path)
    except (FileNotFoundError, ValueError) as e:
        return [str(e)]
    return verify_file_table(Path(path), manifest["files"], checksums=checksums, digest=digest)


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under root, oldest first (partial folders are ignored)."""
    return [(step, p) for step, p in _step_dirs(root) if (p / MANIFEST).is_file()]


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    found = []
    if Path(root).is_dir():
        for p in Path(root).iterdir():
            m = _STEP_DIR.match(p.name)
            if m and p.is_dir():
                found.append((int(m.group(1)), p))
    return sorted(found)


def latest(root: Path, checksums: bool = True, set_aside: bool = False, aside: Optional[Path] = None
           ) -> Optional[tuple[int, Path, list[str]]]:
    """The newest checkpoint under root that verifies, with the problems of newer ones that did not (a step folder
    without a manifest included: a save that never finished). set_aside: move those to `aside` (default
    root/.damaged/; named in the problems, with their size), so that the run that resumes from an older checkpoint
    can save their steps again."""
    rejected = []
    for step, path in reversed(_step_dirs(root)):
        problems = verify(path, checksums=checksums)
        if not problems:
            return step, path, rejected
        where = f" (set aside as {_set_aside(path, aside or path.parent / '.damaged')})" if set_aside else ""
        rejected.append(f"{path.name}: {'; '.join(problems)}{where}")
    return None if not rejected else (0, None, rejected)


def _set_aside(path: Path, aside: Path) -> str:
    """Keep a damaged checkpoint for inspection, out of the way of new saves (and of the attempt's scratch folder,
    which publishing deletes)."""
    import time

    target = aside / f"{path.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    target.parent.mkdir(parents=True, exist_ok=True)
    path.rename(target)
    return kept_aside(target)


def sweep_partials(root: Path) -> None:
    """Remove the half-written folders a crash mid-save left (rank 0 only)."""
    if _is_rank0():
        for p in Path(root).glob(".step_*.partial"):
            remove_tree(p)


def prune(root: Path, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints and any partial leftovers (rank 0 only)."""
    if not _is_rank0():
        return
    for _, path in complete_checkpoints(root)[:-keep] if keep > 0 else []:
        remove_tree(path)
    for p in Path(root).glob(".step_*.partial"):
        remove_tree(p)
