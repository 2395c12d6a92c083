"""The consolidated (aggregated) checkpoint: one full model and its optimizer state, no pickle, in Hugging Face's
sharded safetensors layout (storage.safetensors_shards):

  model.safetensors, or model-0000i-of-0000N.safetensors + model.safetensors.index.json
      every weight once (a tied pair stored once, under the name of the weight it copies)
  optimizer.safetensors, or optimizer-0000i-of-0000N.safetensors + optimizer.safetensors.index.json
      the flattened optimizer state (moments, step counts) as tensors; the param-group settings (lr, betas, ...)
      as JSON in each file's metadata

`write_from_checkpoint` makes it from a sharded DCP checkpoint a few tensors at a time (memory: the writer's read
group and the largest tensor, never the model); `save` from a model in memory. Any plain single-process PyTorch
program loads it: `load(folder, model, optimizer)`, one tensor at a time into the model's own parameters.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Mapping, Optional

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)

from storage import safetensors_shards as shards
from storage.dcp_reader import CheckpointReader
from storage.weights import load_full
from storage.safetensors_shards import Entry, Reader

MODEL, OPTIMIZER = "model", "optimizer"      # file stems
MODEL_FILE = "model.safetensors"             # the single-file form
OPTIMIZER_FILE = "optimizer.safetensors"
DEFAULT_SHARD_BYTES = 5 * 10**9              # save_pretrained's max_shard_size="5GB"
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def write_from_checkpoint(folder: Path, source: CheckpointReader, order: list[str], metadata: dict,
                          max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                          inspect: Optional[Callable[[str, torch.Tensor], None]] = None,
                          read_bytes: int = shards.READ_BYTES) -> dict:
    """The checkpoint's model and optimizer state as safetensors shards, streamed (read_bytes at a time). order:
    parameter names in model order (a layer's tensors end up together). inspect(name, tensor) sees every weight."""
    weights = source.tensors("model")
    model_entries = [Entry(n, *weights[n]) for n in _ordered(weights, order, lambda k: k)]

    def read_model(group: list[Entry]) -> dict[str, torch.Tensor]:
        tensors = source.read("model", [e.name for e in group])
        for name, t in tensors.items():
            if inspect:
                inspect(name, t)
        return tensors

    record = {"model": shards.write(folder, MODEL, model_entries, max_shard_bytes, metadata, read=read_model,
                                    read_bytes=read_bytes)}
    moments, settings = source.tensors("optim"), source.objects("optim")
    if moments or settings:  # SGD without momentum keeps no tensors, but its settings still make a file
        optim_entries = [Entry(n, *moments[n]) for n in _ordered(moments, order, _param_of_optim_key)]
        settings = {"param_groups": json.dumps(_encode(settings))}
        record["optimizer"] = shards.write(folder, OPTIMIZER, optim_entries, max_shard_bytes, settings,
                                           read=lambda group: source.read("optim", [e.name for e in group]),
                                           read_bytes=read_bytes)
    return record


def save(folder: Path, model: nn.Module, optimizer: Optional[torch.optim.Optimizer], metadata: dict,
         max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
    """The same files from a model (and optimizer) in memory."""
    weights = dict(model.named_parameters())  # a tied pair once, under its first name
    shards.write(folder, MODEL, shards.entries_of(weights), max_shard_bytes, metadata)
    if optimizer is not None:
        flat = get_optimizer_state_dict(model, optimizer, options=_OPTIONS)
        tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
        settings = {k: v for k, v in flat.items() if not isinstance(v, torch.Tensor)}
        shards.write(folder, OPTIMIZER, shards.entries_of(tensors), max_shard_bytes,
                     {"param_groups": json.dumps(_encode(settings))})


def load(folder: Path, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """Load weights into model (every parameter must be there, under any name of its tie group) and, if given, the
    optimizer state. Either layout (one file, or shards and their index) and either name of a tied pair."""
    load_full(model, Reader(folder, MODEL))
    if optimizer is not None:
        reader = Reader(folder, OPTIMIZER)
        flat: dict = _decode(json.loads(reader.metadata()["param_groups"]))
        flat.update({k: reader[k] for k in reader})
        # materialise the optimizer's state, then overwrite it with the saved values
        get_optimizer_state_dict(model, optimizer, options=_OPTIONS)
        set_optimizer_state_dict(model, optimizer, flat, options=_OPTIONS)


def tensors(folder: Path, stem: str) -> dict[str, torch.Tensor]:
    """Every tensor of a file set, in memory (tests, small models)."""
    reader = Reader(folder, stem.removesuffix(".safetensors"))
    return {k: reader[k] for k in reader}


def exists(folder: Path) -> bool:
    return shards.exists(folder, MODEL)


def _ordered(names: Mapping[str, object], order: list[str], param_of: Callable[[str], str]) -> list[str]:
    """names sorted by their parameter's place in `order` (unknown ones last, by name)."""
    rank = {n: i for i, n in enumerate(order)}
    return sorted(names, key=lambda k: (rank.get(param_of(k), len(rank)), k))


def _param_of_optim_key(key: str) -> str:
    """"state.layers.0.attn.wq.weight.exp_avg" -> "layers.0.attn.wq.weight"."""
    return key.split(".", 1)[1].rsplit(".", 1)[0]


def _encode(settings: dict) -> dict:
    """JSON has no tuples (Adam's betas are one): keep them apart so they come back as tuples."""
    return {k: {"tuple": list(v)} if isinstance(v, tuple) else v for k, v in settings.items()}


def _decode(settings: dict) -> dict:
    return {k: tuple(v["tuple"]) if isinstance(v, dict) and set(v) == {"tuple"} else v for k, v in settings.items()}
