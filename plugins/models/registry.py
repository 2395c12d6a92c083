"""The model registry: a model is an entry (ModelSpec) that bundles everything the stages need to know about it.

Model files import this module and register themselves; `plugins.models` imports the built-in model files.
Third-party packages add theirs through the `orchestrator.models` entry-point group (each entry point is a
callable that calls `register_model`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from common.problem import Problem, divisors
from common.registry import Registry
from storage.weights import tie_groups


def vocab_rows(model_cfg) -> int:
    """Rows of the token embedding and the head: model.vocab_size rounded up to a multiple of model.pad_vocab_to."""
    pad = getattr(model_cfg, "pad_vocab_to", None) or 1
    return -(-model_cfg.vocab_size // pad) * pad


@dataclass(frozen=True)
class Partition:
    """How one parameter is laid out across hp ranks (the record ONNX Runtime's Megatron checkpoints keep)."""
    style: str                 # colwise | rowwise | vocab | replicate
    axis: Optional[int]        # the partitioned axis of the weight, None when replicated


@dataclass(frozen=True)
class EngineUnit:
    """A part of a block an engine may run itself: its core is the shard-local compute up to a row-parallel
    matmul (under tensor parallelism: input replicated, output a partial sum); `bias` (a parameter name in
    the block) is added after the reduction."""
    name: str
    core: Callable[[nn.Module], nn.Module]
    """block -> a module computing the core from the block's own parameters (names relative to the block)."""
    bias: Optional[str]


@dataclass(frozen=True)
class ModelSpec:
    build: Callable[[Any], nn.Module]
    """cfg.model -> module (on the current default device; built on the meta device for plans and layouts, then
    split, sharded and materialised: init_weights gives the values)."""
    init_weights: Callable[[nn.Module, Any, int], None]
    """(module, cfg.model, seed) -> None: deterministic, layout-independent initialisation of every parameter and
    buffer. Parameters may be shards of any layout (DTensors): each takes its part of the full value (set_full)."""
    apply_memory: Callable[[nn.Module, int], nn.Module]
    """(module, memory level) -> module with activation recomputation applied."""
    partition: Callable[[str], Partition]
    """parameter name -> its hp partition (Megatron plan)."""
    split: Callable[[nn.Module, list[int], bool, bool], nn.Module]
    """(module, global layer ids, has embedding, has head) -> the module pruned to one pipeline stage."""
    blocks: Callable[[nn.Module], list[nn.Module]]
    """module -> its repeated blocks (units of data-parallel sharding)."""
    parallelize: Callable[[nn.Module, Any, Any], nn.Module]
    """(module, hp DeviceMesh, cfg.parallel) -> the module with tensor parallelism applied (in place)."""
    units: tuple[EngineUnit, ...]
    """the units of a block (blocks(module)[i].engine, when set, is called as engine(unit name, block, x))."""
    block_inputs: Callable[[Any, int, int], tuple]
    """(cfg.model, batch, seq) -> example inputs of a block (for exporting its units)."""
    loss: Callable[..., torch.Tensor]
    """(outputs, labels) -> summed loss over non-ignored labels."""
    example_inputs: Callable[[Any, int, int], tuple]
    """(cfg.model, batch, seq) -> positional example inputs for tracing/export."""
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    dynamic_axes: dict[str, dict[int, str]]
    set_attention: Optional[Callable[[nn.Module, str], None]] = None
    """(module, "sdpa" | "flex" | "math") -> None: the attention kernel (fused scaled-dot-product; FlexAttention for
    rows of whole documents; or the reference math)."""


MODELS: Registry[ModelSpec] = Registry("model.name", "orchestrator.models")
register_model, model_names, get_model = MODELS.register, MODELS.names, MODELS.get


def check(cfg) -> list:
    """The model's rules: a registered family whose heads split d_model, and sequences it can hold."""

    m, t = cfg.model, cfg.train
    problems = []
    if m.name not in model_names():
        problems.append(Problem("model.name", m.name, "the model must be registered in plugins/models",
                                f"one of: {', '.join(model_names())}"))
    if m.d_model % m.n_heads:
        problems.append(Problem("model.n_heads", m.n_heads, f"model.d_model={m.d_model} must be divisible by "
                                "model.n_heads (each head gets d_model/n_heads dimensions)",
                                f"model.n_heads in {{{', '.join(map(str, divisors(m.d_model)[:8]))}}}"))
    head_dim = m.d_model // m.n_heads
    if m.name == "llama" and not m.d_model % m.n_heads and head_dim % 2:
        even = [h for h in divisors(m.d_model) if (m.d_model // h) % 2 == 0][-3:]
        problems.append(Problem("model.n_heads", m.n_heads, f"the rotary embedding turns pairs of a head's "
                                f"dimensions: model.d_model/n_heads={head_dim} must be even",
                                f"model.n_heads in {{{', '.join(map(str, even))}}}" if even else
                                f"model.d_model={m.d_model + m.n_heads}"))
    kv = m.get("n_kv_heads")
    if kv and m.n_heads % kv:
        problems.append(Problem("model.n_kv_heads", kv, f"grouped-query attention shares each key/value head among "
                                f"model.n_heads/n_kv_heads query heads: model.n_heads={m.n_heads} must be divisible "
                                "by it", f"model.n_kv_heads in {{{', '.join(map(str, divisors(m.n_heads)))}}}"))
    if m.get("rope_scaling") == "llama3" and m.rope_high_freq_factor <= m.rope_low_freq_factor:
        problems.append(Problem("model.rope_high_freq_factor", m.rope_high_freq_factor, "llama3 rotary scaling "
                                "blends the frequencies between the two factors' wavelengths: model.rope_high_freq_"
                                f"factor must exceed model.rope_low_freq_factor={m.rope_low_freq_factor}",
                                f"model.rope_high_freq_factor={4 * m.rope_low_freq_factor} (Llama 3.1's ratio)"))
    if cfg.export.sample_seq > m.max_seq_len:
        problems.append(Problem("export.sample_seq", cfg.export.sample_seq, f"the export traces sequences of this "
                                f"length; the model holds positions up to model.max_seq_len={m.max_seq_len}",
                                f"export.sample_seq={min(16, m.max_seq_len)}"))
    if t.seq_len > m.max_seq_len:
        problems.append(Problem("train.seq_len", t.seq_len, f"sequences cannot be longer than model.max_seq_len="
                                f"{m.max_seq_len}", f"train.seq_len={m.max_seq_len}"))
    return problems


_INITS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "kaiming_uniform_",
          "kaiming_normal_", "xavier_uniform_", "xavier_normal_", "orthogonal_")


def build_on_meta(spec: ModelSpec, model_cfg) -> nn.Module:
    """The model's structure without memory or values (names, shapes, ties), for plans. torch.nn.init is skipped
    while it is built (the idea of transformers' no_init_weights): values of meta tensors mean nothing, and torch
    runs each init of one through its Python reference kernels, importing TorchDynamo and sympy (~1 s at first)."""
    saved = {name: getattr(nn.init, name) for name in _INITS}
    try:
        for name in _INITS:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        with torch.device("meta"):
            return spec.build(model_cfg)
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def materialise(module: nn.Module, device: torch.device) -> nn.Module:
    """Storage on `device` for a module built on the meta device, after it was split and sharded: only what this
    rank holds is allocated (TorchTitan's order: meta init, parallelize, to_empty, init_weights). Values are
    undefined until init_weights or a checkpoint fills them. A plain tied parameter is given a new Parameter per
    module by to_empty (DTensors are swapped in place): the ties are made again."""
    ties = [(alias, names[0]) for names, _ in tie_groups(module) for alias in names[1:]]
    module.to_empty(device=device)
    for alias, canonical in ties:
        owner, leaf = _owner(module, alias)
        setattr(owner, leaf, module.get_parameter(canonical))
    return module


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (module.get_submodule(path) if path else module), leaf
