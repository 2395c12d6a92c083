"""train.init_from's rules: a complete checkpoint of a model with this model's parameters (any layout, written by
this project), or `hf:<folder>`, a Hugging Face folder of a supported architecture with model.*'s sizes."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from common.problem import Problem
from storage import hf
from storage.fsio import read_json

# Folders that an earlier phase of the experiment writes (orchestrator/phases.py), with what writes them: a later
# phase is checked and planned before they exist, its model against that phase's (not the folder's files).
PROMISED: dict[str, str] = {}


def check(cfg, parameters: dict) -> list[Problem]:
    """parameters: the partition plan's, {name: {"shape": ...}} (what the checkpoint must hold)."""
    path = cfg.train.init_from
    if cfg.train.steps == 0 and not (path or "").startswith(hf.PREFIX):
        return [Problem("train.steps", 0, "train.steps=0 trains nothing: it saves, aggregates and scores the weights "
                        "train.init_from=hf:<folder> holds (a baseline for evaluate.tasks); "
                        + ("a checkpoint of this project is scored by its own run's aggregate" if path else
                           "without it they would be a random initialisation"),
                        "train.init_from=hf:<a Hugging Face folder> to score it as it is, or train.steps=300")]
    if not path:
        return []
    if path.startswith("phase:"):  # made concrete where the experiment has phases (orchestrator/phases.py)
        return [Problem("train.init_from", path, "phase:<name> starts from the model of an earlier phase of an "
                        "experiment, and this run has no phases", "declare the phases (docs/experiments.md), or "
                        "train.init_from=hf:<a folder>")]
    if path.startswith(hf.PREFIX):
        return [] if str(hf.folder_of(path)) in PROMISED else hf_problems(cfg, path)
    from storage.checkpoint import MANIFEST  # torch's DCP: 0.7 s of imports, only when a checkpoint is named

    manifest_path = Path(path) / MANIFEST
    if not manifest_path.is_file():
        return [Problem("train.init_from", path, f"must be a complete checkpoint folder (with {MANIFEST}), e.g. "
                        "runs/cache/checkpoint/<key> or the checkpoint/ folder of a train stage's output",
                        "point it at a checkpoint folder, or remove it (train.init_from=null)")]
    manifest = read_json(manifest_path)
    damaged = _damage(cfg, Path(path), manifest)
    if damaged:
        return [Problem("train.init_from", path, f"the checkpoint does not match its manifest: {damaged}",
                        "copy it again from where it was written, or choose another checkpoint")]
    if manifest.get("peft") and cfg.peft.name == "none":
        return [Problem("train.init_from", path, "the checkpoint holds LoRA adapters, without the base they apply to",
                        "peft=lora to continue them, or train.init_from=hf:<its aggregate's hf/ folder> to fine-tune "
                        "the merged model in full")]
    theirs_opt = manifest.get("trainer", {}).get("optimizer")
    if theirs_opt and theirs_opt != cfg.optimizer.name:
        return [Problem("train.init_from", path, f"the checkpoint holds {theirs_opt}'s state; this run's optimizer "
                        f"is {cfg.optimizer.name}", f"optimizer={theirs_opt} (training goes on with the state it "
                        "saved)")]
    theirs = {n: q["shape"] for n, q in manifest.get("partition_plan", {}).get("parameters", {}).items()}
    ours = {n: q["shape"] for n, q in parameters.items()}
    differ = sorted(n for n in ours.keys() | theirs.keys() if ours.get(n) != theirs.get(n))
    problems = []
    if differ:
        problems.append(Problem("train.init_from", path, f"the checkpoint holds another model: {len(differ)} "
                                f"parameter(s) differ in name or shape, e.g. {differ[0]}: checkpoint "
                                f"{theirs.get(differ[0])}, model {ours.get(differ[0])}",
                                "choose the model= options the checkpoint was trained with"))
    if manifest.get("step", 0) >= cfg.train.steps:
        problems.append(Problem("train.steps", cfg.train.steps, f"train.init_from is at step {manifest.get('step')}: "
                                "training continues up to train.steps", f"train.steps={manifest.get('step', 0) + 100}"))
    return problems


def _damage(cfg, folder: Path, manifest: dict) -> str:
    """The first file that differs from the manifest's table (as the checkpoint's own verify compares them), the
    sha256 at stat speed where the cache remembers the file unchanged (storage/file_hashes.py; nothing is written
    where there is no cache yet)."""
    from storage import file_hashes
    from storage.fsio import verify_file_table

    with file_hashes.remembering_in(cfg.cache_dir):
        problems = verify_file_table(folder, manifest.get("files", {}), digest=file_hashes.sha256)
    return problems[0] if problems else ""


def hf_problems(cfg, path: str) -> list[Problem]:
    """`hf:<folder>` (train.init_from, or the base a LoRA checkpoint names): a folder of model.*'s model."""
    folder = hf.folder_of(path)
    if not folder.is_dir():
        return [Problem("train.init_from", path, f"{folder} is not a folder", "hf:<a save_pretrained folder>")]
    try:
        differ = hf.differences(cfg.model, folder)
    except hf.HFError as e:
        return [Problem("train.init_from", path, str(e), "a GPT-2 or Llama folder, or another starting point")]
    except (KeyError, ValueError) as e:
        return [Problem("train.init_from", path, f"{folder}/config.json cannot be read: {e}", "a save_pretrained folder")]
    if not any(folder.glob("*.safetensors")):
        return [Problem("train.init_from", path, f"{folder} holds no *.safetensors weights",
                        "a folder save_pretrained wrote with its weights (safe_serialization=True, its default)")]
    if not differ:
        return []
    family = differ.pop("name", (None, cfg.model.name))[1]
    fix = " ".join([f"model={'llama_tiny' if family == 'llama' else 'gpt_tiny'}"] if family != cfg.model.name else []
                   + [f"model.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, (_, v) in differ.items()])
    listed = "; ".join(f"model.{k}: ours {a}, theirs {b}" for k, (a, b) in differ.items())
    return [Problem("train.init_from", path, f"the folder holds another model ({family}): {listed}", fix)]


def fingerprint(init_from, cache_dir: Optional[str] = None) -> Optional[str]:
    """What train.init_from is now, for the keys of the stages that start from it: a Hugging Face folder's files
    (names, sizes, modification times), a checkpoint's manifest (its files' checksums), or None (no start). A folder
    in an entry of the cache (cache_dir) is that entry: its stage and key say what it holds (an entry never changes),
    so that a stage starting from another's output is keyed before that output exists (an experiment's phases)."""
    import hashlib

    folder = hf.folder_of(init_from)
    entry = in_entry(folder or init_from, cache_dir)
    if entry:
        return entry
    if folder:
        return hf.stamps(folder)
    if init_from:
        from storage.checkpoint import MANIFEST

        manifest = Path(init_from) / MANIFEST
        return hashlib.sha256(manifest.read_bytes()).hexdigest() if manifest.is_file() else "missing"
    return None


def in_entry(path, cache_dir: Optional[str]) -> Optional[str]:
    """`<stage>/<key>/<the rest>` of a path in a published entry of the cache at cache_dir (None for a path elsewhere,
    or in what may change: a stage's work folder `<key>.work`, its `.damaged` entries). Both resolved: a cache reached
    through a link is the same cache."""
    if not path or not cache_dir:
        return None
    try:
        parts = Path(path).expanduser().resolve().relative_to(Path(cache_dir).expanduser().resolve()).parts
    except ValueError:
        return None
    entry = len(parts) >= 2 and not parts[0].startswith(".") and re.fullmatch(r"[0-9a-f]{16,64}", parts[1])
    return "/".join(parts) if entry else None
