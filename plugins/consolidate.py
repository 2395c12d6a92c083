"""The consolidated (aggregated) checkpoint: one full model and its optimizer state, no pickle.

  model.safetensors      every weight once (tied weights stored once, restored tied)
  optimizer.safetensors  the flattened optimizer state (moments, step counts) as tensors; the param-group
                         settings (lr, betas, ...) as JSON in the file's metadata

Any plain single-process PyTorch program can load it: `load(folder, model, optimizer)`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open
from safetensors.torch import load_model, save_file, save_model
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def save(folder: Path, model: nn.Module, optimizer: Optional[torch.optim.Optimizer], metadata: dict) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_model(model, str(folder / MODEL_FILE), metadata={k: str(v) for k, v in metadata.items()})
    if optimizer is not None:
        flat = get_optimizer_state_dict(model, optimizer, options=_OPTIONS)
        tensors = {k: v.contiguous() for k, v in flat.items() if isinstance(v, torch.Tensor)}
        settings = {k: v for k, v in flat.items() if not isinstance(v, torch.Tensor)}
        save_file(tensors, str(folder / OPTIMIZER_FILE), metadata={"param_groups": json.dumps(_encode(settings))})


def load(folder: Path, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """Load weights into model (strict: every parameter must be present) and, if given, optimizer state."""
    folder = Path(folder)
    load_model(model, str(folder / MODEL_FILE), strict=True)
    if optimizer is not None:
        flat: dict = {}
        with safe_open(str(folder / OPTIMIZER_FILE), framework="pt") as f:
            flat.update(_decode(json.loads(f.metadata()["param_groups"])))
            for k in f.keys():
                flat[k] = f.get_tensor(k)
        # materialise the optimizer's state, then overwrite it with the saved values
        get_optimizer_state_dict(model, optimizer, options=_OPTIONS)
        set_optimizer_state_dict(model, optimizer, flat, options=_OPTIONS)


def tensors(folder: Path, file: str) -> dict[str, torch.Tensor]:
    with safe_open(str(Path(folder) / file), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _encode(settings: dict) -> dict:
    """JSON has no tuples (Adam's betas are one): keep them apart so they come back as tuples."""
    return {k: {"tuple": list(v)} if isinstance(v, tuple) else v for k, v in settings.items()}


def _decode(settings: dict) -> dict:
    return {k: tuple(v["tuple"]) if isinstance(v, dict) and set(v) == {"tuple"} else v for k, v in settings.items()}
