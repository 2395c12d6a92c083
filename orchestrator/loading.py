"""`orchestrator.load(path)`: the trained model of a run, built from the run's own config, in plain PyTorch."""
from __future__ import annotations

from pathlib import Path
from typing import Union

import torch
from omegaconf import OmegaConf

from orchestrator.cache.store import ENTRY_FILE
from storage import consolidate
from storage.fsio import read_json
from plugins.models import get_model
from plugins.models.registry import build_on_meta, materialise
from runtime.optim import build_optimizer


def aggregate_entry(path: Union[str, Path]) -> Path:
    """The aggregate output of a run folder (runs/outputs/<date>/<time>), or the path itself when it is one."""
    path = Path(path).expanduser()
    for candidate in (path, path / "stages" / "aggregate" / "output"):
        if consolidate.exists(candidate) and (candidate / ENTRY_FILE).is_file():
            return candidate.resolve()
    raise FileNotFoundError(f"{path} is neither a run folder whose aggregate stage finished (it would hold "
                            f"stages/aggregate/output/{consolidate.HF}/ or {consolidate.MODEL_FILE}) nor an aggregate "
                            "output: give the folder printed after 'outputs:'")


def load(path: Union[str, Path], optimizer: bool = False):
    """The model of a run (in eval mode), from a run folder or an aggregate output; with optimizer=True, (model,
    optimizer) with the optimizer state, to keep training. The config comes from the run itself. The weights are
    read one tensor at a time (hf/ or model.safetensors, one file or Hugging Face's shards), straight into the
    model."""
    entry = aggregate_entry(path)
    config = OmegaConf.create(read_json(entry / ENTRY_FILE)["material"]["config"])
    spec = get_model(config.model.name)
    model = materialise(build_on_meta(spec, config.model), torch.device("cpu"))  # no initialisation to overwrite
    opt = build_optimizer(config.optimizer, model) if optimizer else None
    consolidate.load(entry, model, opt)
    model.eval()
    return (model, opt) if optimizer else model
