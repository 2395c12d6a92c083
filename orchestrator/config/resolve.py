"""`auto` values made concrete, before planning, for the machine the stages will run on: they enter cache keys and
the run's config.yaml as what actually ran.

precision=auto: bf16 where the train stage gets a CUDA GPU with bf16, else fp32 (engine=ort: fp32). On SLURM the
login node's devices say nothing of the compute nodes': GPUs requested (cluster.gpus_per_task) mean bf16 (pick
precision=fp16 or fp32 for GPUs older than Ampere).

data.packing_strategy=auto: bfd for records of prompt_completion or chat, wrapped for text (silently: the plan
says how rows are packed).

data.tokenizer=auto: the tokenizer train.init_from=hf:<folder> ships (the ids its embeddings were trained on),
else bytes (silently: the plan's data line names the tokenizer).

triton.attention=auto: flex (FlexAttention, compiled) where rows hold whole documents and the ranks get CUDA GPUs,
else sdpa (runtime/sdpa.py says why).
"""
from __future__ import annotations

from omegaconf import DictConfig, OmegaConf


def resolve_auto(cfg: DictConfig) -> list[str]:
    """Fill in the config's `auto` values in place; one line per choice made, for the plan."""
    from plugins.data.formats.spec import FORMATS
    from plugins.data.packing import whole_documents
    from plugins.engines import engine_names, get_engine
    from runtime.machine import ranks_on_cuda
    from runtime.precision import auto_precision
    from runtime.sdpa import resolve_attention

    notes = []
    if _resolve_tokenizer(cfg) and cfg.data.tokenizer != "bytes":  # first: the packing reads the tokenizer
        notes.append(f"data.tokenizer=auto: {cfg.data.tokenizer} (train.init_from's own)")
    # rows of whole documents (the same with auto resolved below); of a format not registered, nothing is resolved:
    # this runs before validation, which names the format
    known = (OmegaConf.select(cfg, "data.format") or "text") in FORMATS.names()
    documents = known and whole_documents(cfg.data) is not None
    if known and cfg.data.packing and cfg.data.packing_strategy == "auto":  # what packs the rows decides the rest
        cfg.data.packing_strategy = "bfd" if documents else "wrapped"
    cuda, bf16 = ranks_on_cuda(cfg)
    if cfg.precision.name == "auto":
        # an engine not registered is refused by validation, which runs after this
        mixed = cfg.engine.name not in engine_names() or get_engine(cfg.engine.name).mixed_precision
        name, why = auto_precision(cuda, bf16, cfg.engine.name, mixed)
        cfg.precision.name = name
        notes.append(f"precision=auto: {name} ({why})")
    if cfg.triton.attention == "auto":
        name, why = resolve_attention(cuda, documents)
        cfg.triton.attention = name
        if why:
            notes.append(f"triton.attention=auto: {name} ({why})")
    return notes


def with_tokenizer(cfg: DictConfig) -> DictConfig:
    """cfg, or a copy with data.tokenizer=auto made concrete: what validation is handed where nothing resolved it yet
    (a sweep's points and a tune's trials are checked before each runs; a run resolves it in place, resolve_auto)."""
    import copy

    from plugins.data.tokenizer import AUTO

    if OmegaConf.select(cfg, "data.tokenizer") != AUTO:
        return cfg
    cfg = copy.deepcopy(cfg)
    _resolve_tokenizer(cfg)
    return cfg


def _resolve_tokenizer(cfg: DictConfig) -> bool:
    """data.tokenizer=auto made concrete in place (plugins.data.tokenizer.auto_tokenizer); whether it was auto."""
    from plugins.data.tokenizer import AUTO, auto_tokenizer

    if OmegaConf.select(cfg, "data.tokenizer") != AUTO:
        return False
    cfg.data.tokenizer = auto_tokenizer(OmegaConf.select(cfg, "train.init_from"))
    return True
