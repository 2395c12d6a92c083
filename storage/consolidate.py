"""The consolidated (aggregated) checkpoint: one full model and its optimizer state, no pickle, in Hugging Face's
sharded safetensors layout (storage.safetensors_shards). The weights are written once, in one of two forms:

  hf/                 a folder transformers loads (model.safetensors or its shards, config.json), when the model has
                      a Hugging Face form (GPT-2, Llama): Hugging Face's names and layout, which `weights` maps back
                      to ours bit for bit (a transpose, a split of GPT-2's fused q/k/v)
  vocab_padding.safetensors
                      beside it, model.pad_vocab_to's rows of the embedding (and untied head): Hugging Face's
                      vocabulary leaves them out, the checkpoint had them
  model.safetensors   (or model-0000i-of-0000N.safetensors + model.safetensors.index.json) otherwise: our names,
                      every weight once (a tied pair once, under the name of the weight it copies)
  optimizer.safetensors, or optimizer-0000i-of-0000N.safetensors + optimizer.safetensors.index.json
      the flattened optimizer state (moments, step counts) as tensors; the param-group settings (lr, betas, ...)
      as JSON in each file's metadata

`write_from_checkpoint` makes them from a sharded DCP checkpoint a few tensors at a time (memory: each writer's
read group and the largest tensor, never the model); `save` from a model in memory. Any plain single-process PyTorch
program loads them: `load(folder, model, optimizer)`, one tensor at a time into the model's own parameters.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Mapping, Optional

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)

from storage import hf
from storage import safetensors_shards as shards
from storage.dcp_reader import CheckpointReader
from storage.fsio import KnownHashes
from storage.weights import load_full
from storage.safetensors_shards import Entry, Reader

MODEL, OPTIMIZER, PADDING = "model", "optimizer", "vocab_padding"  # file stems
HF = "hf"                                    # the Hugging Face folder
MODEL_FILE = "model.safetensors"             # the single-file form
OPTIMIZER_FILE = "optimizer.safetensors"
DEFAULT_SHARD_BYTES = 5 * 10**9              # save_pretrained's max_shard_size="5GB"
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def write_from_checkpoint(folder: Path, source: CheckpointReader, order: list[str], metadata: dict,
                          max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                          inspect: Optional[Callable[[str, torch.Tensor], None]] = None,
                          read_bytes: int = shards.READ_BYTES, model_cfg=None,
                          token_ids: Optional[dict] = None,
                          with_weights: Optional[Callable[[dict], None]] = None,
                          known: Optional[KnownHashes] = None) -> dict:
    """The checkpoint's weights (hf/ + vocab_padding when model_cfg has a Hugging Face form, else model.safetensors)
    and optimizer state as safetensors shards, streamed (read_bytes at a time). The weights and the optimizer state
    are written at once, by a thread each: the reads, the writes and the checks of one overlap the other's.
    with_weights(record so far): called in this thread as soon as the weights are written, while the optimizer state
    (twice their bytes with AdamW) is still being written, so that checks of the weights (the aggregate's eval and
    ONNX model) overlap that write. (The weights written alone first, then the optimizer state beside the checks,
    was no faster on 2 cores: the writers are CPU-bound, the weights' alone at 150 MB/s.) order: parameter names in
    model order (a layer's tensors end up together). inspect(name, tensor) sees every weight. token_ids:
    hf/config.json's eos and pad (hf.write_folder). known: given each safetensors file's sha256, taken as it was
    written. Returns each set's {files, tensors, bytes} (and the Hugging Face form's reason when there is none:
    "hf_note")."""
    shapes = source.tensors("model")

    def read_model(names: list[str]) -> dict[str, torch.Tensor]:
        tensors = source.read("model", names)
        for name, t in tensors.items():
            if inspect:
                inspect(name, t)
        return tensors

    form = hf.folder_plan(model_cfg, shapes) if model_cfg is not None else "no model config given"
    moments, settings = source.tensors("optim"), source.objects("optim")
    with ThreadPoolExecutor(2, thread_name_prefix="aggregate") as pool:
        optimizer = None
        if moments or settings:  # SGD without momentum keeps no tensors, but its settings still make a file
            entries = [Entry(n, *moments[n]) for n in _ordered(moments, order, _param_of_optim_key)]
            optimizer = pool.submit(shards.write, folder, OPTIMIZER, entries, max_shard_bytes,
                                    {"param_groups": json.dumps(_encode(settings))},
                                    lambda group: source.read("optim", [e.name for e in group]), read_bytes, known)
        if isinstance(form, str):
            entries = [Entry(n, *shapes[n]) for n in _ordered(shapes, order, lambda k: k)]
            record = {MODEL: pool.submit(shards.write, folder, MODEL, entries, max_shard_bytes, metadata,
                                         lambda group: read_model([e.name for e in group]), read_bytes,
                                         known).result(),
                      "hf_note": form}
        else:
            record = {HF: pool.submit(hf.write_folder, folder / HF, read_model, shapes, model_cfg, max_shard_bytes,
                                      token_ids, read_bytes, metadata, known).result()}
            if (padding := _padding_entries(shapes, model_cfg.vocab_size, source)):
                record[PADDING] = shards.write(folder, PADDING, padding, DEFAULT_SHARD_BYTES * 1000, known=known)
        _give_back_freed_memory()
        if with_weights is not None:
            with_weights(record)
        if optimizer is not None:
            record[OPTIMIZER] = optimizer.result()
    return record


def _give_back_freed_memory() -> None:
    """glibc keeps what each writer thread freed in that thread's own heap (arena), where the process's later
    steps (the eval, ONNX Runtime's copy of the weights) do not reuse it: without this, their peak sits on top of
    it. malloc_trim returns every arena's free pages; elsewhere than glibc this does nothing."""
    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    if trim is not None:
        trim(0)


def _padding_entries(shapes: dict, vocab: int, source: CheckpointReader) -> list[Entry]:
    """model.pad_vocab_to's rows of the embedding and an untied head (what Hugging Face's folder leaves out)."""
    out = []
    for name in hf.VOCAB_ROWS:
        if name in shapes and shapes[name][0][0] > vocab:
            (rows, width), dtype = shapes[name]
            out.append(Entry(name, (rows - vocab, width), dtype,
                             lambda name=name: source.read("model", [name])[name][vocab:].contiguous()))
    return out


def weights(folder: Path) -> Mapping[str, torch.Tensor]:
    """The aggregated weights under our parameter names, read one tensor at a time, whichever form they were
    written in (model.safetensors, or hf/ and the vocabulary's padding rows)."""
    folder = Path(folder)
    if shards.exists(folder, MODEL):
        return Reader(folder, MODEL)
    padding = Reader(folder, PADDING) if shards.exists(folder, PADDING) else None
    rows = None
    if padding is not None:
        rows = hf.read_config(folder / HF)[1]["vocab_size"] + padding.shape(hf.VOCAB_ROWS[0])[0]
    return hf.load_state(folder / HF, rows, padding)


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
    load_full(model, weights(folder))
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
    return shards.exists(folder, MODEL) or shards.exists(Path(folder) / HF, MODEL)


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
