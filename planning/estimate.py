"""How much memory a rank of a layout needs, estimated before anything runs.

Per rank (the worst rank of the layout): fp32 parameters, gradients and optimizer state of what the rank holds
(its pipeline stages; its tensor-parallel shards; divided by dp under dp_mode=shard), plus the activations kept for
backward. Activations per token and layer are counted tensor by tensor for this decoder (what autograd saves:
norm inputs, q/k/v, attention output, MLP inputs and hidden units; SDPA keeps no attention matrix, the math kernel
does), times the tokens in flight (one microbatch without a pipeline; up to pp of them at the first stage of
1F1B, every microbatch under GPipe), plus the head's and the loss's on the last stage (`_head_bytes`).
Recomputation (memory level 1, 2, 3) keeps a layer's input (level 1), the unit inputs (level 2), or the layer's input
and the outputs of its costly operators (level 3: `op_kept_per_token`), and one layer's worth during backward.

On a GPU the peak comes at the start of backward, when every activation is alive and no gradient yet (gradients
appear as activations are freed, and the caching allocator gives their blocks to the gradients): parameters +
optimizer state + the larger of activations and gradients (the allocator's peak excludes the CUDA context). On a
CPU what a process frees stays in its heap, so its RSS, what `top` shows and the plan promises, holds activations
and gradients both, and the optimizer step's temporaries on top (half the parameters' bytes, measured), plus the
process itself (torch imported, 0.22 GB) and autograd's and the data pages' share (0.1 GB): at 0.2B parameters the
worst train rank measured 0.98x (pp=8), 0.99x (hp=4) and 0.87x (one process) of this. With data parallelism a
buffer of unsharded gradients that the reduction goes through: the rank's all under replicate, one FSDP unit (a
block, or the root's embedding and head) under shard.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

from plugins.data.packing import document_rows
from plugins.models.lora import in_compute_dtype
from plugins.parallel import world_size
from plugins.parallel.parallelize import split_backward
from plugins.parallel.schedules import SCHEDULES

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# a rank on a CPU: the process itself (torch imported: 0.22 GB of RSS measured before the model exists) and what
# training adds besides tensors (autograd, the allocator's arenas, the data pages read: about 0.1 GB measured)
RUNTIME_CPU = 320 * 2**20
OPTIMIZER_STATES = {"adamw": 2, "sgd": 1}   # fp32 tensors per parameter
# What a checkpoint writes beside the tensors' bytes: DCP's entries (each parameter's tensor and optimizer states, a
# chunk per shard of a split parameter, its step and its settings, format v2) carry 1.6-2.2 KB each (torch.save's
# archive of a step and of the settings, alignment: measured 2026-11-29 on llama_tiny full and LoRA, single and
# megatron_hp2, and gpt_tiny: the plan within -3% and +13% of what was written), and the manifest a line a
# parameter (its partition plan). A LoRA checkpoint of a small model is mostly these: 1.9 MB written for 0.93 MB of
# adapters and their states (the plan said 0.93 MB before).
CHECKPOINT_ENTRY_BYTES = 2000
MANIFEST_BYTES_PER_PARAMETER = 400
STEP_TEMPORARIES = 0.5                       # the optimizer step's temporaries, per parameter byte held (measured)


@dataclass(frozen=True)
class Estimate:
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    runtime: int = 0
    temporaries: int = 0
    cpu: bool = False
    staging: int = 0  # train.async_checkpoint=async: the host copy of the rank's weights and optimizer state
    head: int = 0     # of the activations: the head's and the loss's (the last stage's)
    sparse: bool = False  # train.label_sparsity: the head runs on the labelled positions, in chunks
    reference: int = 0    # objective.reference=online: the frozen reference model's weights beside the policy

    @property
    def total(self) -> int:
        """The peak. On a GPU activations and gradients are not alive at once (see the module's note) and the
        caching allocator reuses the one's blocks for the other; on a CPU freed memory stays in the process's heap,
        so its RSS holds both, and the optimizer step's temporaries on top."""
        if self.cpu:
            return self.parameters + self.optimizer + self.gradients + self.activations + self.temporaries + \
                self.runtime + self.staging + self.reference
        return self.parameters + self.optimizer + max(self.activations, self.gradients) + self.runtime + \
            self.reference

    def describe(self) -> str:
        gb = 2**30
        head = f" (the head and loss {self.head / gb:,.2f}{', labelled positions only' if self.sparse else ''})"
        both = (f"activations {self.activations / gb:,.2f}{head}, gradients {self.gradients / gb:,.2f}, step "
                f"temporaries {self.temporaries / gb:,.2f}") if self.cpu else \
            f"activations {self.activations / gb:,.2f}{head} or gradients {self.gradients / gb:,.2f}"
        # a GPU rank stages a background checkpoint in host memory, beside the device's figure
        staging = "" if not self.staging else f", checkpoint staging {self.staging / gb:,.2f}" if self.cpu else \
            f"; checkpoint staging {self.staging / gb:,.2f} in host memory"
        frozen = f", the reference model {self.reference / gb:,.2f}" if self.reference else ""
        return (f"{self.total / gb:,.2f} GB per rank at its peak (parameters {self.parameters / gb:,.2f}{frozen}, "
                f"optimizer state {self.optimizer / gb:,.2f}, {both}, runtime {self.runtime / gb:,.2f}{staging})")


def _held_by_rank(plan: dict, trained: bool = False, which=None) -> dict[int, int]:
    """Parameter elements each pipeline rank holds (tensor-parallel shards); trained: only those that train (LoRA's
    frozen base has no gradient and no optimizer state); which(name, entry): only those it accepts. A tied copy
    counts where it lives apart from the weight it copies (the last pipeline stage's head); in the stage that holds
    both, the two names are one tensor (gpt2_124m's head, counted twice before, put 0.6 GB too many in the plan of
    one process)."""
    stage_rank = {s["stage"]: s["rank"] for s in plan["pipeline"]}
    held: dict[int, int] = dict.fromkeys(stage_rank.values(), 0)
    for name, p in plan["parameters"].items():
        if trained and not p.get("trainable", True) or which is not None and not which(name, p):
            continue
        n = 1
        for d in p["shard_shape"]:
            n *= d
        stages = set(p["pp_stages"])
        if p.get("tied_to"):
            stages -= set(plan["parameters"][p["tied_to"]]["pp_stages"])
        for rank in {stage_rank[s] for s in stages}:
            held[rank] = held.get(rank, 0) + n
    return held


def activation_bytes_per_token(m, hp: int, sp: bool, compute: int) -> float:
    """Bytes autograd keeps per token for one block (no recomputation), in the compute dtype."""
    h, ff = m.d_model, m.d_ff
    swiglu = m.name == "llama"
    norms = 2 * h / (hp if sp else 1)                # the two norms' inputs (sharded along the sequence with SP)
    inputs = 2 * h                                   # the norms' outputs: the inputs of q/k/v and of fc1 (replicated)
    attention = 5 * h / hp                           # q, k, v, SDPA's output and wo's (contiguous) input
    mlp = (4 * ff if swiglu else 2 * ff) / hp        # fc1 (and fc3) outputs and the activation's
    masks = 2 * h if m.dropout > 0 else 0            # two dropout masks, one byte per element
    return (norms + inputs + attention + mlp) * compute + masks


def op_kept_per_token(m, hp: int, sp: bool) -> float:
    """Elements per token a layer keeps under memory level 3 (runtime/recompute.py): its input, the outputs of the
    first, third, ... of its matmuls in the order they run (q, k, v, the attention's output projection, then fc1,
    fc3 for SwiGLU, fc2; an output projection's is a full-width partial sum under tensor parallelism), the attention
    kernel's output, and with sequence parallelism the two reduce-scatters'."""
    h, kv = m.d_model, m.d_model // m.n_heads * (m.get("n_kv_heads") or m.n_heads)
    matmuls = [h / hp, kv / hp, kv / hp, h] + ([m.d_ff / hp] * (2 if m.name == "llama" else 1)) + [h]
    return h / (hp if sp else 1) + sum(matmuls[::2]) + h / hp + (2 * h / hp if sp else 0)


def estimate(cfg, plan: dict) -> Estimate:
    """The worst rank of the layout in cfg.parallel for the model in cfg.model (plan: build_plan's)."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    held, trained = _held_by_rank(plan), _held_by_rank(plan, trained=True)
    worst = max(held, key=lambda r: (held[r], trained[r]))
    held = held[worst]
    shard = p.dp if p.dp_mode == "shard" else 1
    compute = BYTES.get(cfg.precision.name, 4)
    # peft=lora under bf16/fp16: the frozen Linears of the blocks are stored in the compute dtype (lora.store_frozen)
    halved = _held_by_rank(plan, which=lambda n, q: in_compute_dtype(n, q["shape"], q.get("trainable", True)))
    parameters = (held * 4 - halved.get(worst, 0) * (4 - compute)) // shard
    gradients = trained[worst] * 4 // shard  # peft=lora: the adapters' only
    # data parallelism reduces unsharded gradients through a buffer of their size: the rank's all of them under
    # replicate (one unit), one FSDP unit at a time under shard (a block, or what the root keeps: embedding, head)
    # (what trains only: a frozen weight has no gradient to reduce)
    block = 4 * sum(math.prod(q["shard_shape"]) for name, q in plan["parameters"].items()
                    if name.startswith("layers.0.") and q.get("trainable", True))
    unit = max(block, trained[worst] * 4 - (m.n_layers // p.pp) * block) if p.dp_mode == "shard" else \
        trained[worst] * 4
    reduce_buffer = unit if p.dp > 1 else 0
    if p.dp > 1 and p.dp_mode == "shard" and split_backward(p):  # a zero-bubble schedule: the rank's stages stay
        reduce_buffer += held * compute  # gathered, in the compute dtype, from forward to backward (parallelize.py)
    optimizer = gradients * OPTIMIZER_STATES.get(cfg.optimizer.name, 2)

    seq, hp = t.seq_len, p.hp
    tokens_per_microbatch = t.batch_size // p.dp // p.microbatches * seq
    if p.pp == 1:
        in_flight = 1
    elif SCHEDULES[p.pp_schedule].all_forwards_first:
        in_flight = p.microbatches
    else:  # 1F1B-like: the first stage holds up to pp microbatches (interleaved: per chunk, a little more)
        in_flight = min(p.microbatches, p.pp * (1 if p.pp_chunks == 1 else 2))
    layers = m.n_layers // p.pp
    per_token = activation_bytes_per_token(m, hp, p.sequence_parallel, compute)
    if cfg.triton.attention == "math":  # the attention matrix and its softmax, per head
        per_token += 2 * m.n_heads / hp * seq * compute
    level = cfg.memory.level
    if level == 1:
        # each layer's input (sharded along the sequence with SP), one layer recomputed
        layer_bytes = layers * m.d_model / (hp if p.sequence_parallel else 1) * compute + per_token
    elif level == 2:
        layer_bytes = layers * 4 * m.d_model / hp * compute + per_token  # unit inputs and outputs, one recomputed
    elif level == 3:  # each layer's input and the outputs runtime/recompute.py keeps, one layer recomputed
        layer_bytes = layers * op_kept_per_token(m, hp, p.sequence_parallel) * compute + per_token
    else:
        layer_bytes = layers * per_token
    # rows with their documents (whole documents, or padded rows packed by their rank): SDPA's document mask, a byte
    # per (query, key), shared by a microbatch's layers; FlexAttention's block mask is a few ints per 128 x 128 tile
    mask = seq if document_rows(cfg.data) and cfg.triton.attention != "flex" else 0
    head = _head_bytes(cfg, tokens_per_microbatch, compute)
    activations = int(tokens_per_microbatch * in_flight * (layer_bytes + mask) + head)
    from runtime.machine import ranks_on_cuda

    cpu = not ranks_on_cuda(cfg)[0]  # ranks on GPUs: this machine's, or a SLURM job's that asks for them
    staging = gradients + optimizer if cfg.train.get("async_checkpoint", "disabled") == "async" else 0
    return Estimate(parameters, gradients, optimizer, activations, (RUNTIME_CPU if cpu else 0) + reduce_buffer,
                    int(gradients * STEP_TEMPORARIES) if cpu else 0, cpu, staging, int(head), t.label_sparsity,
                    reference_bytes(cfg, plan, worst) if _online_reference(cfg) else 0)


def _online_reference(cfg) -> bool:
    """A frozen reference model beside the policy: objective.reference=online, unless the policy with its adapters
    off is the reference (plugins/objectives/reference.adapters_are_the_difference)."""
    from plugins.objectives.reference import adapters_are_the_difference, online

    return online(cfg) and not adapters_are_the_difference(cfg)


def reference_bytes(cfg, plan: dict, rank: int = 0) -> int:
    """A rank's share of the reference model of an objective that takes one: the model without LoRA's adapters, in fp32,
    sharded as the policy (the reference stage's weights; the online reference's beside the policy)."""
    base = _held_by_rank(plan, which=lambda name, q: ".lora_" not in name)
    return base.get(rank, max(base.values())) * 4 // (cfg.parallel.dp if cfg.parallel.dp_mode == "shard" else 1)


def _head_bytes(cfg, tokens: int, compute: int) -> float:
    """The last stage's head and loss of one microbatch of `tokens` positions. Dense: the fp32 logits' log-softmax
    and their gradient, every position (vocabulary-sharded under loss parallelism). Label sparsity
    (plugins/models/head_loss.py): one chunk's logits (fp32, and the matmul's output), the labelled positions'
    hidden states and their gradient, and an fp32 gradient buffer of the rank's head shard per microbatch whose
    backward has not run (every microbatch under a schedule that runs all forwards first). Every position counts as
    labelled: the share is the data's, and the chunk bounds what grows with it."""
    from plugins.models.registry import vocab_rows

    p, m, t = cfg.parallel, cfg.model, cfg.train
    if not t.label_sparsity:
        return tokens * 2 * vocab_rows(m) / (p.hp if p.loss_parallel else 1) * 4
    rows = vocab_rows(m) / p.hp  # the sparse head always works on its vocabulary shard
    waiting = p.microbatches if p.pp > 1 and SCHEDULES[p.pp_schedule].all_forwards_first else 1
    return min(tokens, t.loss_chunk) * rows * (4 + compute) + tokens * m.d_model * (4 + compute) + \
        waiting * rows * m.d_model * 4


def available_bytes(cfg) -> tuple[int, str]:
    """What one rank may use, and where the figure comes from."""
    import psutil

    from planning.devices import device_of

    device = device_of(cfg.cluster.get("device"))
    if device is not None:  # declared: what the ranks will hold, wherever the plan is made
        return int(device.memory_gib * 2**30), f"{device.what}'s memory (cluster.device={cfg.cluster.device})"
    if cfg.cluster.name == "slurm":
        gb = cfg.cluster.get("mem_per_task_gb")
        return (int(gb * 2**30), "cluster.mem_per_task_gb") if gb else (0, "unknown on SLURM (cluster.mem_per_task_gb)")
    import torch

    if torch.cuda.is_available():
        return torch.cuda.mem_get_info()[1], f"{torch.cuda.get_device_name()}'s memory"
    ranks = world_size(cfg.parallel)
    return psutil.virtual_memory().available // ranks, f"available RAM / {ranks} rank(s)"


def host_bytes(cfg) -> tuple[int, str]:
    """What a one-process stage (export, aggregate) may use, and where the figure comes from: host memory, not a
    GPU's (those stages work on the CPU)."""
    import psutil

    if cfg.cluster.name == "slurm":
        gb = cfg.cluster.get("mem_per_task_gb")
        return (int(gb * 2**30), "cluster.mem_per_task_gb") if gb else (0, "unknown on SLURM (cluster.mem_per_task_gb)")
    return psutil.virtual_memory().available, "available RAM"


def step_flops(cfg, n_parameters: int) -> float:
    """Forward + backward FLOPs of one optimizer step: 6 per parameter and token (every matmul, the head included;
    the embedding lookups are counted too, a small excess) plus attention's scores and weighted sum, 12 * layers *
    d_model * seq per token (PaLM's appendix B)."""
    m, t = cfg.model, cfg.train
    return t.batch_size * t.seq_len * (6.0 * n_parameters + 12.0 * m.n_layers * m.d_model * t.seq_len)


@functools.lru_cache(maxsize=None)
def matmul_rate(device: str, dtype: str, threads: int) -> float:
    """FLOP/s of a square matmul on this machine, measured once per command (about 0.1 s; the best of 8, as a busy
    machine slows some): the best a step's matmuls can do."""
    import time

    import torch

    n = 4096 if device == "cuda" else 1024
    kind = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype] if device == "cuda" \
        else torch.float32  # on a CPU autocast is not used: fp32 it is
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        a = torch.randn(n, n, device=device, dtype=kind)
        b = torch.randn(n, n, device=device, dtype=kind)
        best = float("inf")
        for _ in range(8):  # the first warms the kernel up; the best of the rest
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            a @ b
            if device == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        return 2.0 * n**3 / best
    finally:
        torch.set_num_threads(before)
        if device == "cuda":  # the planning process lives on beside rank 0: its cached blocks go back to the GPU
            a = b = None
            torch.cuda.empty_cache()


STAGE_RUNTIME = 320 * 2**20  # a one-process stage: torch, onnx and ONNX Runtime imported, measured 0.27-0.33 GB
READ_GROUP = 64 * 2**20     # storage.safetensors_shards.READ_BYTES: tensors each aggregate writer holds at once
EXPORT_CHECK = 1.75          # the export check, per byte of the weights it runs with (1.5-1.75x measured)
ORT_COPY = 1.2               # ONNX Runtime checking model.onnx, per byte of its weights (1.15-1.2x measured)
# lm-eval, transformers and datasets imported (0.14 GB measured), the tasks built, and what loading the weights and
# lm-eval's batches hold beside them: gpt2_124m with evaluate.onnx measured 4.75 GB against 4.63 GB without it
EVALUATE_RUNTIME = 384 * 2**20


@dataclass(frozen=True)
class StageCost:
    """What a one-process stage needs: its peak memory (and what makes it), and the bytes it writes."""
    peak: int
    what: str
    writes: int = 0


def _bytes_of(shape: list[int]) -> int:
    return 4 * math.prod(shape)  # fp32


def _saved_states(optimizer) -> tuple[int, int]:
    """(tensors, other objects) an optimizer saves a parameter: AdamW its two moments, its step and its settings;
    SGD its momentum buffer (none without momentum: torch keeps None) and its settings."""
    if optimizer.name == "sgd":
        return (1 if optimizer.get("momentum") else 0), 1
    return OPTIMIZER_STATES.get(optimizer.name, 2), 2


def _chunks(p: dict) -> int:
    """The pieces a parameter's tensors are saved in: one a shard of a split parameter (hp), else one."""
    return max(1, math.prod(p["shape"]) // max(1, math.prod(p.get("shard_shape") or p["shape"])))


def stage_costs(cfg, plan: dict, onnx: Optional[bool] = None) -> dict[str, StageCost]:
    """Peak memory and bytes written of the stages around training (each one process; planning.estimate.estimate
    covers a train rank). The terms follow what each stage holds:
      export     the weights its check runs with (the model's own up to CHECK_WEIGHTS_BYTES, else a two-layer
                 twin's: the graph itself is traced on the meta device) in torch and in ONNX Runtime;
      checkpoint nothing that grows with the model (files are hashed and linked, streamed);
      aggregate  ONNX Runtime's copy of the weights for the ONNX model's check (aggregate.onnx), else the larger of
                 two writers' (the weights', the optimizer state's) read groups, each with the tensors made of it
                 (Hugging Face's layout) and one being read back, and one piece of the piece-by-piece evaluation
                 (one block's weights, the eval batches' hidden states, one batch's logits); the checks (the ONNX
                 model's, the evaluation) run beside the optimizer state's writer, whose read group they add to;
    plus STAGE_RUNTIME each. onnx: whether the aggregate makes the ONNX model (default: aggregate.onnx)."""
    params = plan["parameters"]
    weights = sum(_bytes_of(p["shape"]) for p in params.values() if not p["tied_to"])
    saved = [p for p in params.values() if not p["tied_to"] and p.get("trainable", True)]  # (peft=lora: adapters)
    trained = sum(_bytes_of(p["shape"]) for p in saved)
    states, objects = _saved_states(cfg.optimizer)
    entries = sum((1 + states) * _chunks(p) + objects for p in saved)
    checkpoint = trained * (1 + states) + entries * CHECKPOINT_ENTRY_BYTES + \
        len(params) * MANIFEST_BYTES_PER_PARAMETER  # what trains (peft=lora: adapters), in DCP's entries
    largest = max(_bytes_of(p["shape"]) for p in params.values())
    block = sum(_bytes_of(p["shape"]) for name, p in params.items() if name.startswith("layers.0."))
    m, t = cfg.model, cfg.train
    from plugins.models.registry import vocab_rows

    from runtime.evaluate import piece_budgets

    chunk, head = piece_budgets(m.d_model, vocab_rows(m))
    hidden = min(t.eval_batches, max(1, chunk // (t.batch_size * t.seq_len))) * t.batch_size * t.seq_len
    pieces = 2 * block + hidden * m.d_model * 4 * 2 + min(head, t.batch_size * t.seq_len) * vocab_rows(m) * 8
    writer = READ_GROUP + 2 * largest  # the optimizer state's writer, which goes on beside the checks of the weights
    streaming = max(2 * writer, pieces + writer)
    onnx = int(ORT_COPY * weights) + writer if (cfg.aggregate.onnx if onnx is None else onnx) else 0
    from plugins.onnx.exporter import CHECK_WEIGHTS_BYTES

    checked = weights if weights <= CHECK_WEIGHTS_BYTES else weights - max(m.n_layers - 2, 0) * block
    costs = {
        "export": StageCost(STAGE_RUNTIME + int(EXPORT_CHECK * checked), "the model checked in ONNX Runtime"
                            if checked == weights else "a two-layer twin checked in ONNX Runtime; the graph traced "
                                                       "on the meta device"),
        "checkpoint": StageCost(STAGE_RUNTIME, "files hashed and linked, streamed", checkpoint),
        "aggregate": StageCost(STAGE_RUNTIME + max(onnx, streaming),
                               "ONNX Runtime's copy of the weights" if onnx > streaming else
                               "two writers' read groups, or one block of the piece-by-piece evaluation beside one",
                               weights + checkpoint - trained + (weights if onnx else 0)),
    }
    if cfg.evaluate.tasks:
        costs["evaluate"] = evaluate_cost(cfg, weights)
    return costs


def evaluate_cost(cfg, weights: int) -> StageCost:
    """The evaluate stage: lm-eval's hf model (the weights in fp32, as it loads them), one batch's logits and their
    log-softmax over the model's longest sequence (evaluate.batch_size x model.max_seq_len x the vocabulary), and
    with evaluate.onnx ONNX Runtime's copy of the weights beside the hf model (it scores the same batches)."""
    from plugins.models.registry import vocab_rows

    ev = cfg.evaluate
    logits = 2 * ev.batch_size * cfg.model.max_seq_len * vocab_rows(cfg.model) * 4
    onnx = int(ORT_COPY * weights) if ev.onnx else 0
    what = "the weights in fp32 and a batch's logits" + (", and ONNX Runtime's copy of the weights" if onnx else "")
    return StageCost(STAGE_RUNTIME + EVALUATE_RUNTIME + weights + logits + onnx, what)
