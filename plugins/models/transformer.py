"""The decoder-only transformer both model families are made of, shaped for every parallel layout.

- Layers live in a ModuleDict keyed by their global index, so a pipeline stage that keeps layers 4..7 still names
  them `layers.4...`: parameter names are the same in every layout (checkpoints reshard).
- q, k, v are separate Linears and reshapes infer the head count (`view(B, T, -1, hd)`), so column-sharding them
  across hp ranks needs no change to the forward; grouped-query attention repeats each key/value head for the
  query heads it serves, a ratio that tensor parallelism leaves unchanged.
- A stage that does not hold the embedding or the head has them set to None; forward skips what is absent.
- Initialisation draws every parameter from a generator seeded by (seed, name): identical in every layout.
- `model.pad_vocab_to` rounds the embedding and head rows up (Megatron's padding, so hp ranks hold equal shares);
  the padding's logits never count: cut off, or masked to -inf while the logits are vocab-sharded.
- A block is two units, attention and MLP, each ending in a row-parallel projection: an engine may run a unit's
  core (everything up to that projection's matmul, shard-local under tensor parallelism) itself.

gpt.py and llama.py choose the pieces (positions, norm, MLP) and register the families.
"""
from __future__ import annotations

import math
import re
import zlib
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from plugins.models.head_loss import head_loss, row_logprobs
from plugins.models.registry import EngineUnit, ModelSpec, Partition, vocab_rows
from runtime.recompute import op_policy
from runtime.sdpa import document_block_mask, flex
from storage.weights import set_constant, set_full


def frequencies(hd: int, theta: float, device, scaling: Optional[tuple] = None) -> torch.Tensor:
    """The rotary embedding's inverse frequencies (hd/2,), fp32. scaling: Llama 3.1's (factor, low_freq_factor,
    high_freq_factor, original context): wavelengths longer than original/low_freq_factor are stretched by factor,
    those shorter than original/high_freq_factor kept, those between blended (Hugging Face's rope_type llama3, the
    same operations in the same order: the same numbers)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd))
    if scaling is None:
        return inv_freq
    factor, low, high, original = scaling
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    between = (wavelen >= original / high) & (wavelen <= original / low)  # transformers: ~(<) * ~(>), the same
    return torch.where(between, blended, scaled)


def rotary(x: torch.Tensor, theta: float, positions: Optional[torch.Tensor] = None,
           scaling: Optional[tuple] = None) -> torch.Tensor:
    """Rotary position embedding of (B, heads, T, head_dim) at positions 0..T-1, or at `positions` (B, T) (the
    rotate-half convention of Hugging Face's Llama: its weights load unchanged). Angles in fp32, as Llama computes
    them. scaling: frequencies' (Llama 3.1's long-context scaling), or None."""
    T, hd = x.shape[-2], x.shape[-1]
    inv_freq = frequencies(hd, theta, x.device, scaling)
    at = torch.arange(T, device=x.device) if positions is None else positions[:, None, :]  # (T) or (B, 1, T)
    angles = at.to(torch.float32)[..., None] * inv_freq
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def document_view(documents: torch.Tensor, kernel: str = "sdpa") -> tuple:
    """What a row of whole documents (data.packing_strategy=bfd) means to attention: documents (B, T) numbers each
    position's document (consecutive runs; padding is a run of its own) -> (mask, positions (B, T), restarting at 0
    at each document). The mask lets a query attend the keys of its own document up to itself: (B, 1, T, T) booleans
    for SDPA and the math kernel, FlexAttention's block mask for kernel flex. With both, a packed row's tokens get
    the losses they would get alone."""
    B, T = documents.shape
    at = torch.arange(T, device=documents.device)
    begins = torch.ones_like(documents, dtype=torch.bool)
    begins[:, 1:] = documents[:, 1:] != documents[:, :-1]
    positions = at - torch.where(begins, at, 0).cummax(dim=1).values
    if kernel == "flex":
        return document_block_mask(documents), positions
    causal = torch.ones(T, T, dtype=torch.bool, device=documents.device).tril()
    return ((documents[:, :, None] == documents[:, None, :]) & causal)[:, None], positions


class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, bias: bool, rope_theta: Optional[float] = None,
                 rope_scaling: Optional[tuple] = None):
        super().__init__()
        self.head_dim = d_model // n_heads
        self.group = n_heads // n_kv_heads      # query heads per key/value head (1: plain multi-head attention)
        self.rope_theta, self.rope_scaling = rope_theta, rope_scaling  # rotary's (scaling: frequencies')
        self.wq = nn.Linear(d_model, n_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * self.head_dim, d_model, bias=bias)
        self.kernel = "sdpa"  # sdpa | flex | math, set by set_attention (triton.attention, resolved)

    def mix(self, x, documents: Optional[tuple] = None):
        """q/k/v projections and causal attention, heads concatenated: the input of the output projection.
        documents: document_view's (mask, positions) of rows of whole documents; None: each row is one sequence."""
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        mask, positions = documents if documents is not None else (None, None)
        if self.rope_theta is not None:
            q = rotary(q, self.rope_theta, positions, self.rope_scaling)
            k = rotary(k, self.rope_theta, positions, self.rope_scaling)
        if self.group > 1:  # each key/value head serves `group` query heads
            k = k.unsqueeze(2).expand(-1, -1, self.group, -1, -1).flatten(1, 2)
            v = v.unsqueeze(2).expand(-1, -1, self.group, -1, -1).flatten(1, 2)
        if self.kernel == "math":  # the reference computation, written out (what SDPA's math backend does)
            scores = (q @ k.transpose(-2, -1)) * self.head_dim ** -0.5
            allowed = mask if mask is not None else torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            y = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v
        elif mask is not None and self.kernel == "flex":  # the mask's visible tiles only (runtime/sdpa.py)
            y = flex(q, k, v, mask)
        elif mask is not None:  # SDPA's kernels that take a mask (on CUDA: memory-efficient; flash takes none)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).reshape(B, T, -1)

    def forward(self, x, documents: Optional[tuple] = None):
        return self.wo(self.mix(x, documents))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(ln1(x)), then + mlp(ln2(x)). The MLP has `hidden(x)` (everything before
    its output projection) and `fc2` (the output projection)."""

    def __init__(self, ln1: nn.Module, attn: Attention, ln2: nn.Module, mlp: nn.Module, dropout: float):
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = ln1, attn, ln2, mlp
        self.drop = nn.Dropout(dropout)
        self.recompute = "none"  # none | layer | selective | op, set by apply_memory (an attribute keeps names stable)
        self.engine = None  # callable (unit name, block, x) -> unit output, set by an engine other than torch

    def _forward(self, x, documents=None):
        x = x + self.drop(self._unit("attention", x, documents))
        return x + self.drop(self._unit("mlp", x, documents))

    def _unit(self, name, x, documents=None):
        if self.engine is not None and documents is not None:  # the plan refuses it before launch
            raise RuntimeError("an engine's exported units take the hidden states only, not a document mask")
        run = self.torch_unit if self.engine is None else (lambda n, h, _: self.engine(n, self, h))
        if self.recompute == "selective" and torch.is_grad_enabled():
            return checkpoint(run, name, x, documents, use_reentrant=False)
        return run(name, x, documents)

    def torch_unit(self, name, x, documents=None):
        return self.attn(self.ln1(x), documents=documents) if name == "attention" else self.mlp(self.ln2(x))

    def forward(self, x, documents: Optional[tuple] = None):
        """documents: document_view's (mask, positions) when rows hold whole documents."""
        if self.recompute == "layer" and torch.is_grad_enabled():
            return checkpoint(self._forward, x, documents, use_reentrant=False)
        if self.recompute == "op" and torch.is_grad_enabled():  # the costly operators' outputs kept (runtime/recompute)
            return checkpoint(self._forward, x, documents, use_reentrant=False, context_fn=op_policy)
        return self._forward(x, documents)


def _without_padding(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Logits of the real vocabulary only. Vocab-sharded logits (loss parallelism) keep their padded width, which
    the shards split evenly: the padding's columns become -inf there, so the cross-entropy's softmax gives them 0."""
    from torch.distributed.tensor import DTensor

    if not isinstance(logits, DTensor):
        return logits[..., :vocab]
    local = logits.to_local()
    width = local.shape[-1]
    first = logits.device_mesh.get_local_rank() * width  # the global column of this shard's first logit
    padding = torch.arange(first, first + width, device=local.device) >= vocab
    local = local.masked_fill(padding, float("-inf"))
    return DTensor.from_local(local, logits.device_mesh, logits.placements, run_check=False,
                              shape=logits.shape, stride=logits.stride())


class Decoder(nn.Module):
    """Token embedding (+ learned positions when `wpe` is set), the blocks, a final norm and the vocabulary head."""

    FIRST_STAGE = ("wte", "wpe")   # modules only the first pipeline stage keeps
    LAST_STAGE = ("ln_f", "lm_head")

    def __init__(self, cfg, block: Callable[[], Block], norm: Callable[[], nn.Module], learned_positions: bool):
        super().__init__()
        self.vocab_size, rows = cfg.vocab_size, vocab_rows(cfg)
        self.wte = nn.Embedding(rows, cfg.d_model)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.d_model) if learned_positions else None
        self.drop = nn.Dropout(cfg.dropout)
        self.attention = "sdpa"  # the kernel set_attention gave the blocks: the document view it needs
        self.loss_chunk = 1024   # positions per chunk of the sparse head's loss (train.loss_chunk, set by the layout)
        self.per_row = False     # the sparse head returns each row's summed log-probability and label count instead
        #                          of the summed loss (a preference objective's input: plugins/objectives; the layout)
        self.layers = nn.ModuleDict({str(i): block() for i in range(cfg.n_layers)})
        self.ln_f = norm()
        self.lm_head = nn.Linear(cfg.d_model, rows, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    def forward(self, h, documents: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
                label_count: Optional[int] = None):
        """input_ids (B, T) -> logits (B, T, V); a pipeline stage maps hidden states or ids to its output.
        documents (B, T): each position's document in rows of whole documents (data.packing_strategy=bfd): attention
        stays within a document and positions restart at each (every pipeline stage gets them beside its input).
        labels (B, T) (train.label_sparsity): the stage with the head returns the summed loss of the labelled
        positions instead of logits, the head run on those positions only (plugins/models/head_loss.py); inside
        forward, so that data parallelism's gathered weights and hooks see the head as they see every layer.
        label_count: how many of `labels` count, where the host knows it (head_loss's `count`: no wait on the GPU)."""
        view = None
        if documents is not None and (self.wpe is not None or self.layers):
            view = document_view(documents, self.attention)
        if self.wte is not None:
            x = self.wte(h)
            if self.wpe is not None:
                x = x + self.wpe(view[1] if view is not None else torch.arange(h.shape[1], device=h.device))
            h = self.drop(x)
        for layer in self.layers.values():
            h = layer(h) if view is None else layer(h, documents=view)
        if self.lm_head is not None and labels is not None and self.per_row:
            return row_logprobs(self.ln_f(h), self.lm_head.weight, labels, self.vocab_size, self.loss_chunk)
        if self.lm_head is not None and labels is not None:
            return head_loss(self.ln_f(h), self.lm_head.weight, labels, self.vocab_size, self.loss_chunk,
                             label_count)
        if self.lm_head is not None:
            h = self.lm_head(self.ln_f(h))
            if h.shape[-1] != self.vocab_size:
                h = _without_padding(h, self.vocab_size)
        return h


def _name_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def init_weights(model: nn.Module, cfg, seed: int) -> None:
    """GPT-2 initialisation (norm scales 1, biases 0, weights normal(init_std)); residual projections scaled by
    1/sqrt(2 * n_layers). A random weight is drawn in full from its own generator, then this rank keeps its shard:
    the values do not depend on the layout, and only one full weight exists at a time."""
    resid_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            set_constant(p, 0.0)
        elif re.search(r"ln\w*\.weight$", name):
            set_constant(p, 1.0)
        else:
            # a tied head is called lm_head.weight on a last pipeline stage without the embedding
            canonical = "wte.weight" if cfg.tie_embeddings and name == "lm_head.weight" else name
            g = torch.Generator().manual_seed(_name_seed(seed, canonical))
            std = resid_std if re.search(r"\.(wo|fc2)\.weight$", name) else cfg.init_std
            set_full(p, torch.randn(p.shape, generator=g).mul_(std).to(p.dtype))


def apply_memory(model: nn.Module, level: int) -> nn.Module:
    mode = {0: "none", 1: "layer", 2: "selective", 3: "op"}[level]
    for layer in model.layers.values():
        layer.recompute = mode
    return model


def set_attention(model: nn.Module, kernel: str) -> None:
    model.attention = kernel
    for layer in model.layers.values():
        layer.attn.kernel = kernel


def split(model: Decoder, layers: list[int], first: bool, last: bool) -> Decoder:
    """Prune to one pipeline stage; kept layers keep their global index, so names do not change."""
    keep = {str(i) for i in layers}
    for k in [k for k in model.layers if k not in keep]:
        del model.layers[k]
    for name in (() if first else model.FIRST_STAGE) + (() if last else model.LAST_STAGE):
        setattr(model, name, None)
    return model


class AttentionCore(nn.Module):
    """ln1, attention and the output projection's matmul without its bias: the attention unit's shard-local
    compute (under tensor parallelism a partial sum; the bias is added after the reduction)."""

    def __init__(self, block: Block):
        super().__init__()
        self.ln1, self.attn = block.ln1, block.attn

    def forward(self, x):
        return F.linear(self.attn.mix(self.ln1(x)), self.attn.wo.weight)


class MLPCore(nn.Module):
    """ln2, the MLP and its output projection's matmul without the bias: the MLP unit's shard-local compute."""

    def __init__(self, block: Block):
        super().__init__()
        self.ln2, self.mlp = block.ln2, block.mlp

    def forward(self, x):
        return F.linear(self.mlp.hidden(self.ln2(x)), self.mlp.fc2.weight)


UNITS = (EngineUnit("attention", AttentionCore, "attn.wo.bias"), EngineUnit("mlp", MLPCore, "mlp.fc2.bias"))

COLWISE = ("wq", "wk", "wv", "fc1", "fc3")   # split by output features (heads, MLP hidden units)
ROWWISE = ("wo", "fc2")                      # split by input features: their outputs are partial sums


def block_inputs(cfg, batch: int, seq: int) -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch, seq, cfg.d_model, generator=g),)


def blocks(model: Decoder) -> list[nn.Module]:
    """The repeated units (data-parallel wrapping, recomputation and compilation go per block)."""
    return list(model.layers.values())


def parallelize(model: Decoder, hp_mesh, parallel) -> Decoder:
    """Megatron-style tensor parallel over hp_mesh (TorchTitan's plan).

    q/k/v and MLP-in projections are column-parallel, attention-out and MLP-out row-parallel; the token embedding
    is vocab-parallel (rows) and so is the head (its output columns), which keeps a tied pair on the same Shard(0)
    layout. With sequence parallelism the residual stream between blocks is sharded along the sequence (entered at
    the global first block, so the embeddings stay replicated); with loss parallelism the logits stay vocab-sharded
    for loss_parallel()'s cross-entropy.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    sp, lp = parallel.sequence_parallel, parallel.loss_parallel
    residual = Shard(1) if sp else Replicate()
    plan = {}
    if model.wte is not None:
        plan["wte"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    for i, layer in model.layers.items():
        pre = f"layers.{i}."
        for name, module in layer.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in COLWISE:
                plan[pre + name] = ColwiseParallel()
            elif leaf in ROWWISE:
                plan[pre + name] = RowwiseParallel(output_layouts=residual)
        if sp:
            to_full = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            plan.update({pre + "ln1": SequenceParallel(), pre + "ln2": SequenceParallel(),
                         pre + "attn": to_full, pre + "mlp": to_full})
    if sp and "0" in model.layers:
        plan["layers.0"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                              use_local_output=True)
    if model.lm_head is not None:
        if sp:
            plan["ln_f"] = SequenceParallel()
        plan["lm_head"] = ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1) if lp else Replicate(),
                                          use_local_output=not lp)
    tied = model.wte is not None and model.lm_head is not None and model.lm_head.weight is model.wte.weight
    parallelize_module(model, hp_mesh, plan)
    if tied:  # parallelize_module replaces each module's weight and silently unties them
        model.lm_head.weight = model.wte.weight
    return model


# LoRA's adapters (plugins/models/lora.py) follow their Linear: a column-split one's B is split by output as its weight
# (A whole), a row-split one's A by input (B whole)
_COLWISE = re.compile(rf"\.({'|'.join(COLWISE)})\.(weight|bias|lora_B)$")
_ROWWISE = re.compile(rf"\.({'|'.join(ROWWISE)})\.(weight|lora_A)$")
_VOCAB = re.compile(r"^(wte|lm_head)\.weight$")


def partition(name: str) -> Partition:
    """Megatron's plan: q/k/v and MLP-in split by output (column), attention-out and MLP-out by input (row),
    token embedding and head split by vocabulary rows; everything else replicated."""
    if _COLWISE.search(name):
        return Partition("colwise", 0)
    if _ROWWISE.search(name):
        return Partition("rowwise", 1)
    if _VOCAB.search(name):
        return Partition("vocab", 0)
    return Partition("replicate", None)


def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy over labels != -100 (the caller divides by the global label count,
    which keeps the loss identical however the batch is split across microbatches and ranks)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                           ignore_index=-100, reduction="sum")


def example_inputs(cfg, batch: int, seq: int) -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, cfg.vocab_size, (batch, seq), generator=g),)


def decoder_spec(build: Callable) -> ModelSpec:
    """The registry entry of a family built from these pieces."""
    return ModelSpec(
        build=build, init_weights=init_weights, apply_memory=apply_memory, partition=partition, split=split,
        blocks=blocks, parallelize=parallelize, units=UNITS, block_inputs=block_inputs, loss=loss,
        example_inputs=example_inputs, input_names=("input_ids",), output_names=("logits",),
        dynamic_axes={"input_ids": {0: "batch", 1: "sequence"}, "logits": {0: "batch", 1: "sequence"}},
        set_attention=set_attention)
