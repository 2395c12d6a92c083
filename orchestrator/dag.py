"""Planning: order the stages, compute each one's content key, and look it up in the cache.

A stage's key is the hash of what determines its output: the content of the config subtrees it reads
(keys marked `content=False` in the schema left out), its upstream stages' keys, the source of every project
module the stage reaches through its imports (orchestrator/cache/code_keys.py), and any extra fingerprint (e.g. of the data files). Equal keys mean
equal outputs, so an unchanged stage is never run twice and a sweep shares what its points have in common.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf

from orchestrator.cache.store import Cache
from orchestrator.cache.code_keys import code_material
from orchestrator.cache import resume
from stages.base import Resources, Stage

KEY_LENGTH = 20


@dataclass
class PlannedStage:
    stage: Stage
    key: str
    cached: bool
    resources: Resources
    material: dict = field(repr=False)
    note: Optional[str] = None          # e.g. "resumes from step 200"
    damage: list[str] = field(default_factory=list)   # why the cached entry was not reused
    lineage: Optional[str] = None       # what an attempt computes, whatever the key (orchestrator/cache/resume.py)
    adopt_from: Optional[Path] = None   # an interrupted attempt under another key this one continues
    resumes_at: Optional[int] = None    # the step its own or the adopted attempt's checkpoint continues from

    @property
    def name(self) -> str:
        return self.stage.name


def content_view(node: Any) -> Any:
    """Plain data of a config node, without the keys its schema marks as not affecting outputs."""
    if isinstance(node, DictConfig):
        schema = OmegaConf.get_type(node)
        skip = {f.name for f in dataclasses.fields(schema) if not f.metadata.get("content", True)} \
            if dataclasses.is_dataclass(schema) else set()
        return {k: content_view(node[k]) for k in node.keys() if k not in skip}
    if isinstance(node, ListConfig):
        return [content_view(node[i]) for i in range(len(node))]
    return node


def _without(node: Any, parts: list[str]) -> None:
    """Remove the field at `parts` from a plain view, in every item of the lists on the way."""
    if isinstance(node, list):
        for item in node:
            _without(item, parts)
    elif isinstance(node, dict) and parts:
        if len(parts) == 1:
            node.pop(parts[0], None)
        else:
            _without(node.get(parts[0]), parts[1:])


def stage_key(cfg: DictConfig, stage: Stage, input_keys: dict[str, str]) -> tuple[str, dict]:
    config = {path: content_view(OmegaConf.select(cfg, path, throw_on_missing=True)) for path in stage.reads}
    for ignored in stage.ignores:
        read = next(r for r in stage.reads if ignored.startswith(r + "."))
        _without(config[read], ignored[len(read) + 1:].split("."))
    material = {
        "stage": stage.name,
        "config": config,
        "inputs": {name: input_keys[name] for name in stage.after},
        "code": code_material(stage.module),
        "extra": stage.fingerprint(cfg) if stage.fingerprint else None,
    }
    digest = hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()
    return digest[:KEY_LENGTH], material


def keys(cfg: DictConfig, stages: list[Stage]) -> dict[str, str]:
    """Each stage's key, the cache unread and nothing written (an experiment's later phase names an earlier phase's
    output by its key before it exists: orchestrator/phases.py)."""
    found: dict[str, str] = {}
    for s in ordered(cfg, stages):
        found[s.name] = stage_key(cfg, s, found)[0]
    return found


def plan(cfg: DictConfig, stages: list[Stage], cache: Cache) -> list[PlannedStage]:
    """Stages in dependency order, each with its key and whether the cache already holds its output (the stages this
    config runs: a stage's `enabled`)."""
    keys: dict[str, str] = {}
    extras: dict[str, Any] = {}
    planned = []
    for s in ordered(cfg, stages):
        key, material = stage_key(cfg, s, keys)
        keys[s.name], extras[s.name] = key, material["extra"]
        cached, damage = cache.hit(s.name, key, checksums=cfg.cache_verify != "size", set_aside=not cfg.dry_run,
                                   full=cfg.cache_verify == "full")
        note = ("damaged entry set aside" if not cfg.dry_run else "damaged entry will be set aside") if damage else None
        scratch = cache.scratch(s.name, key)
        own = s.progress(scratch) if not cached and s.progress and scratch.is_dir() else None
        lineage = resume.lineage_of(s, {path: content_view(OmegaConf.select(cfg, path)) for path in s.lineage},
                                    dict(extras))
        earlier = resume.find(cfg, cache, s, key, lineage, material) if not cached and lineage else None
        if earlier and own and (s.adopt(cfg, scratch, None) or 0) >= earlier[1]:
            earlier = None  # its own checkpoints are as far along
        note = "; ".join(n for n in (note, earlier[2] if earlier else own) if n) or None
        planned.append(PlannedStage(s, key, cached, s.resources(cfg), material, note, damage, lineage,
                                    earlier[0] if earlier else None,
                                    earlier[1] if earlier else getattr(own, "step", None)))
    return planned


def ordered(cfg: DictConfig, stages: list[Stage]) -> list[Stage]:
    """The stages this config runs (a stage's `enabled`), in dependency order."""
    stages = [s for s in stages if s.enabled(cfg)]
    running = {s.name for s in stages}  # an optional upstream the config does not run is no upstream
    stages = [dataclasses.replace(s, after=tuple(u for u in s.after if u in running or u not in s.optional))
              if s.optional else s for s in stages]
    by_name = {s.name: s for s in stages}
    for s in stages:
        missing = [u for u in s.after if u not in by_name]
        if missing:
            raise ValueError(f"stage {s.name} runs after unknown stage(s) {missing}")
    in_order, seen = [], set()

    def visit(s: Stage, trail: tuple[str, ...]) -> None:
        if s.name in trail:
            raise ValueError(f"stage dependencies form a cycle: {' -> '.join(trail + (s.name,))}")
        if s.name in seen:
            return
        for up in s.after:
            visit(by_name[up], trail + (s.name,))
        seen.add(s.name)
        in_order.append(s)

    for s in stages:
        visit(s, ())
    return in_order
