"""Resume follows the run, not the key.

A stage's key includes its code and every config key it reads, so that a finished result is reused only when it
would be computed again the same way. An interrupted attempt is another matter: after `git pull` of a fix, or with
another layout once a node is lost, the user wants the same command to go on from the last checkpoint, not from
step 0. So each attempt of a resumable stage (one with a `lineage`) records in its work folder what it computes —
the content of its lineage config paths and the upstream data fingerprints, hashed — and how (its layout, a hash
of its code). When a stage has nothing of its own to resume, the plan looks for attempts with the same lineage
under other keys, and the stage adopts the newest complete checkpoint among them (the stage decides what is
usable and links it in; DCP reshards it into the new layout).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig

from orchestrator.cache.store import Cache
from storage.fsio import atomic_write_json, read_json

ATTEMPT_LINEAGE = "lineage.json"


def lineage_of(stage, config: dict, extras: dict) -> Optional[str]:
    """The hash of what the stage computes (None: not resumable across keys). config: the content of its lineage
    paths; extras: the fingerprints (data files, init_from) of the stages planned so far, this one included."""
    if not stage.lineage or stage.adopt is None:
        return None
    material = {"stage": stage.name, "extras": extras, "config": config}
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()[:20]


def begin(cfg: DictConfig, cache: Cache, ps) -> None:
    """An attempt's folders (the cache's), its lineage record, and the earlier attempt it continues linked in."""
    cache.begin(ps.name, ps.key)
    _record(cache, ps)
    if ps.adopt_from is not None:
        ps.stage.adopt(cfg, ps.adopt_from, cache.scratch(ps.name, ps.key), ps.adopt_from.parent.name[:-len(".work")])


def _record(cache: Cache, ps) -> None:
    """What the attempt computes and how, for later attempts under other keys."""
    if ps.lineage:
        parallel = ps.material["config"].get("parallel") or {}
        atomic_write_json(cache.work(ps.name, ps.key) / ATTEMPT_LINEAGE, {
            "lineage": ps.lineage, "layout": _layout(parallel), "code": _code(ps.material)})


def find(cfg: DictConfig, cache: Cache, stage, key: str, lineage: str, material: dict) -> Optional[tuple[Path, int, str]]:
    """(the earlier attempt's scratch, the step it would continue from, a note for the plan) of the most advanced
    attempt with this lineage under another key; None when there is none."""
    best = None
    for record_path in sorted((cache.root / stage.name).glob(f"*.work/{ATTEMPT_LINEAGE}")):
        other_key = record_path.parent.name[:-len(".work")]
        if other_key == key:
            continue
        try:
            theirs = read_json(record_path)
        except (OSError, ValueError):
            continue
        scratch = cache.scratch(stage.name, other_key)
        if theirs.get("lineage") != lineage or not scratch.is_dir():
            continue
        step = stage.adopt(cfg, scratch, None)
        if step is not None and (best is None or step > best[1]):
            best = (scratch, step, _who(theirs, material))
    if best is None:
        return None
    scratch, step, who = best
    return scratch, step, f"resumes from step {step}, written by {who}"


def _layout(parallel: dict) -> str:
    return " ".join(f"{a}{parallel.get(a, 1)}" for a in ("dp", "hp", "pp"))


def _code(material: dict) -> str:
    """One hash of the sources a stage's key covers."""
    return hashlib.sha256(json.dumps(material["code"], sort_keys=True).encode()).hexdigest()


def _who(theirs: dict, material: dict) -> str:
    ours_layout = _layout(material["config"].get("parallel") or {})
    if theirs.get("layout") != ours_layout:
        return f"layout {theirs.get('layout')}"
    if theirs.get("code") != _code(material):
        return "other code"
    return "another configuration (engine, memory or kernels)"
