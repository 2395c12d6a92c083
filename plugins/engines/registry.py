"""The engine registry: who executes each block's shard-local compute. An engine is a spec of what the stages and
the layout ask of it; `torch` (the model's own forward) is the spec's defaults, `ort` (plugins/engines/ort) fills
them in. Third-party packages add theirs through the `orchestrator.engines` entry-point group (with a conf/engine
option and a schema of their own for the keys they read), as models and data sources do."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from common.problem import Problem
from common.registry import Registry


@dataclass(frozen=True)
class EngineSpec:
    check: Callable[[Any], list[Problem]] = lambda cfg: []
    """the whole cfg -> what this engine cannot honour, refused before launch."""
    prepare: Optional[Callable[..., None]] = None
    """the transform stage: (cfg, partition plan, export folder, a folder of its own, log, tracker) -> what it runs
    (graphs built, checked and written there). None: nothing to prepare."""
    build: Optional[Callable[..., tuple]] = None
    """each rank of the train stage: (model spec, the prepared folder, cfg.engine, hp process group, device, rank) ->
    (the engine, {unit: why it runs on torch instead})."""
    apply: Optional[Callable[..., None]] = None
    """(module, model spec, engine) -> the module's blocks run their compute on the engine."""
    report: Optional[Callable[..., None]] = None
    """each rank of the train stage: (stage context, model spec, fallbacks, the prepared folder) -> logs and tags."""
    one_shape: bool = False
    """its prepared graphs take one input shape: a rank's padded rows keep theirs (not repacked to their tokens)."""
    reshard_after_forward: bool = True
    """FSDP2 may free the gathered parameters after the forward (False: the engine holds them until the backward)."""
    mixed_precision: bool = True
    """it trains in bf16/fp16 (precision=auto may choose them); False: fp32 graphs only."""
    eval_rtol: float = 1e-5
    """the aggregate's evaluation of the full checkpoint against the train stage's (other kernels round otherwise)."""


ENGINES: Registry[EngineSpec] = Registry("engine.name", "orchestrator.engines")
register_engine, engine_names, get_engine = ENGINES.register, ENGINES.names, ENGINES.get
register_engine("torch", EngineSpec())


def check(cfg) -> list[Problem]:
    """A registered engine, then its own rules."""
    if cfg.engine.name not in engine_names():
        return [Problem("engine.name", cfg.engine.name, "no engine of that name is registered (built in, or added by "
                        "an installed package's `orchestrator.engines` entry point)",
                        f"engine.name= one of {', '.join(engine_names())}, e.g. engine.name=torch")]
    return get_engine(cfg.engine.name).check(cfg)
