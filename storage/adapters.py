"""A LoRA checkpoint read as a whole model, and written as the folder `peft` loads.

A LoRA run's checkpoint holds what trained (the adapters, peft.trainable's weights, their optimizer state) and names
the base it applies to (train.init_from's Hugging Face folder; `base_of`: a run that continues the checkpoint, in any
layout, starts from the base it names). `MergedSource` reads like the checkpoint's own
reader (storage.dcp_reader.CheckpointReader: tensors, objects, read) but gives the whole model's weights: each base
weight from the folder, the checkpoint's where it trained, the adapters folded in where the weight has them
(W + B A * alpha / r, peft's merge_and_unload); the optimizer state is the checkpoint's. So the aggregate writes,
checks and exports the merged model as it does any other, a few tensors at a time.

`write_peft_folder` writes `adapter_config.json` and `adapter_model.safetensors` with peft's names for the base's
modules (`base_model.model.<module>.lora_A.weight`), what `peft.PeftModel.from_pretrained(base, folder)` loads.
GPT-2's q, k and v are one module there (c_attn, a Conv1D): their adapters become one of rank 3r (A stacked, B
block-diagonal, alpha tripled so that alpha / r holds), the same function exactly.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Mapping, Optional

import torch
from safetensors.torch import save_file

from storage import hf
from storage.fsio import UMASK, atomic_write_json, fsync_dir, read_json
from storage.hf import GPT2_CONV, LLAMA_NAMES

PEFT = "peft"
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def base_of(init_from: Optional[str]) -> Optional[str]:
    """The base (`hf:<folder>`) a LoRA run's adapters apply to: train.init_from where it names a Hugging Face folder;
    where it names a LoRA checkpoint (its adapters continued, in this run's layout), the base its manifest names;
    None where it names neither (no init_from, a full fine-tune's checkpoint, no folder)."""
    if not init_from or hf.folder_of(init_from):
        return init_from or None
    from storage.checkpoint import MANIFEST  # torch's DCP, only when a checkpoint is named

    manifest = Path(init_from) / MANIFEST
    return read_json(manifest).get("peft", {}).get("base", {}).get("init_from") if manifest.is_file() else None


def reference_of(cfg) -> Optional[str]:
    """Where an objective's reference model is read from: the one the run that wrote train.init_from's checkpoint
    had (its manifest's `reference`: a continued run optimises what it started optimising, not against the weights
    it reached); else, with peft=lora, the base its adapters apply to (base_of), else train.init_from; None:
    train.seed's initialisation."""
    kept = continued_reference(cfg.train.init_from)
    if kept is not None:
        return kept["init_from"]
    return base_of(cfg.train.init_from) if cfg.peft.name == "lora" else cfg.train.init_from


def continued_reference(init_from: Optional[str]) -> Optional[dict]:
    """The reference a checkpoint's run compared with ({"init_from": ...} in its manifest), None where it names no
    checkpoint or its run had no reference model."""
    if not init_from or hf.folder_of(init_from):
        return None
    from storage.checkpoint import MANIFEST  # torch's DCP, only when a checkpoint is named

    manifest = Path(init_from) / MANIFEST
    found = read_json(manifest).get("reference") if manifest.is_file() else None
    return found if isinstance(found, dict) and "init_from" in found else None


def base_folder(init_from: Optional[str]) -> Path:
    """The folder of base_of(init_from) (a LoRA run's, checked before launch: it exists)."""
    return hf.folder_of(base_of(init_from))


def merged(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float) -> torch.Tensor:
    """The weight with its adapters folded in (peft's merge_and_unload): W + B A * alpha / r, computed in fp32."""
    return (weight.float() + (lora_B.float() @ lora_A.float()) * scaling).to(weight.dtype)


def adapters_of(names) -> dict[str, tuple[str, str]]:
    """weight name -> its (lora_A, lora_B) names, for the weights among `names` whose adapters are there."""
    found = set(names)
    return {f"{m.group(1)}.weight": (n, f"{m.group(1)}.lora_B") for n in found
            if (m := re.match(r"(.*)\.lora_A$", n)) and f"{m.group(1)}.lora_B" in found}


class MergedSource:
    """The whole model of a LoRA checkpoint: base weights (`base`, ours by name, read when asked) with the
    checkpoint's trained tensors and merged adapters; `shapes`: every weight's (shape, dtype), ours by name."""

    def __init__(self, checkpoint, base: Mapping[str, torch.Tensor], shapes: dict, scaling: float):
        self.checkpoint, self.base, self.shapes, self.scaling = checkpoint, base, shapes, scaling
        self.trained = checkpoint.tensors("model")
        self.adapters = adapters_of(self.trained)

    def tensors(self, section: str) -> dict:
        return self.shapes if section == "model" else self.checkpoint.tensors(section)

    def objects(self, section: str) -> dict:
        return self.checkpoint.objects(section)

    def read(self, section: str, names: list[str]) -> dict[str, torch.Tensor]:
        if section != "model":
            return self.checkpoint.read(section, names)
        own = self.checkpoint.read("model", [n for n in names if n in self.trained] +
                                   [a for n in names if n in self.adapters for a in self.adapters[n]])
        out = {}
        for name in names:
            t = own[name] if name in self.trained else self.base[name]
            if name in self.adapters:
                t = merged(t, *(own[a] for a in self.adapters[name]), self.scaling)
            out[name] = t
        return out


def _modules(model_cfg) -> dict[str, str]:
    """Our Linear names (in a block) -> the Hugging Face module they are part of."""
    if model_cfg.name == "gpt":
        return {**{mine: theirs for theirs, mine in GPT2_CONV.items()}, "attn.wq": "attn.c_attn",
                "attn.wk": "attn.c_attn", "attn.wv": "attn.c_attn"}
    return {mine: theirs for theirs, mine in LLAMA_NAMES.items()}


def write_peft_folder(folder: Path, checkpoint, peft_cfg, model_cfg, base: str) -> dict:
    """The adapters as peft's folder (peft_cfg: the run's peft section; base: the base model's folder)."""
    trained = checkpoint.tensors("model")
    pairs = adapters_of(trained)
    tensors = checkpoint.read("model", [n for pair in pairs.values() for n in pair])
    block = "transformer.h" if model_cfg.name == "gpt" else "model.layers"
    modules, out, ranks = _modules(model_cfg), {}, {}
    grouped: dict[str, list[tuple[str, torch.Tensor, torch.Tensor]]] = {}
    for weight, (a, b) in sorted(pairs.items()):
        m = re.match(r"layers\.(\d+)\.(.*)\.weight$", weight)
        theirs = f"{block}.{m.group(1)}.{modules[m.group(2)]}"
        grouped.setdefault(theirs, []).append((m.group(2), tensors[a], tensors[b]))
    for theirs, parts in grouped.items():
        if theirs.endswith("c_attn"):  # q, k, v: one adapter of their ranks together, B block-diagonal
            order = {"attn.wq": 0, "attn.wk": 1, "attn.wv": 2}
            rows = parts[0][2].shape[0]
            A = torch.cat([p[1] for p in sorted(parts, key=lambda p: order[p[0]])], 0)
            B = torch.zeros(3 * rows, A.shape[0], dtype=A.dtype)
            col = 0
            for name, _, b in sorted(parts, key=lambda p: order[p[0]]):
                B[order[name] * rows:(order[name] + 1) * rows, col:col + b.shape[1]] = b
                col += b.shape[1]
            ranks[theirs] = A.shape[0]
        else:
            ((_, A, B),) = parts
        out[f"base_model.model.{theirs}.lora_A.weight"] = A.contiguous()
        out[f"base_model.model.{theirs}.lora_B.weight"] = B.contiguous()
    leaves = sorted({t.rsplit(".", 1)[-1] for t in grouped})
    rank_pattern = {t: r for t, r in ranks.items() if r != peft_cfg.rank}
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
              "r": peft_cfg.rank, "lora_alpha": peft_cfg.alpha, "lora_dropout": peft_cfg.dropout,
              "target_modules": leaves, "bias": "none", "fan_in_fan_out": model_cfg.name == "gpt",
              "rank_pattern": rank_pattern,
              "alpha_pattern": {t: peft_cfg.alpha * r / peft_cfg.rank for t, r in rank_pattern.items()},
              "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
              "modules_to_save": None, "layers_to_transform": None}
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / (WEIGHTS + ".partial")
    save_file(out, str(partial), metadata={"format": "pt"})
    os.chmod(partial, 0o666 & ~UMASK)  # safetensors creates its file 0600: the mode any other file of the run gets
    partial.replace(folder / WEIGHTS)
    atomic_write_json(folder / CONFIG, config)
    fsync_dir(folder)
    return {"tensors": len(out), "bytes": (folder / WEIGHTS).stat().st_size, "target_modules": leaves}

