"""How a run trains: its layout (`parallel`), optimizer, memory and precision, kernels (`triton`), engine,
the train loop, and what the export, transform and aggregate stages make of it; the plan's calibration."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from omegaconf import MISSING

from orchestrator.config.schema.keys import (key, PP_SCHEDULES, MAX_STEPS, MAX_SEED, MAX_LAYERS, MAX_TOKENS,
                                             MAX_RANKS, MAX_THREADS, FP16, COMPILED, TOKEN_LOSS)


@dataclass
class ParallelConfig:
    dp: int = key(1, "data-parallel degree", min=1, max=MAX_RANKS)
    hp: int = key(1, "horizontal (Megatron tensor) parallel degree", min=1, max=MAX_RANKS)
    pp: int = key(1, "pipeline-parallel degree (stages across ranks)", min=1, max=MAX_RANKS)
    dp_mode: str = key("replicate", "replicate: DDP-like; shard: FSDP2, parameters/grads/optimizer state sharded",
                       choices=("replicate", "shard"))
    microbatches: int = key(1, "microbatches per step: gradient accumulation, and pipeline microbatches when pp > 1", min=1,
                            max=MAX_TOKENS)
    pp_schedule: str = key("1f1b", "pipeline schedule", choices=PP_SCHEDULES)
    pp_chunks: int = key(1, "model chunks (virtual stages) per pipeline rank; interleaved/V schedules need >= 2", min=1,
                         max=MAX_LAYERS)
    sequence_parallel: bool = key(False, "shard LayerNorm/dropout activations along the sequence across hp ranks")
    loss_parallel: bool = key(False, "vocab-parallel cross-entropy: logits stay sharded across hp ranks")


@dataclass
class OptimizerConfig:
    name: str = key(MISSING, "optimizer (the names runtime/optim.py's OPTIMIZERS builds)")
    lr: float = key(1e-3, "peak learning rate", min=0.0)
    weight_decay: float = key(0.0, "decoupled weight decay, applied to weight matrices and embeddings (not biases or norms)", min=0.0)
    warmup_steps: int = key(0, "linear warm-up steps from 0 to lr", min=0, max=MAX_STEPS)
    schedule: str = key("cosine", "learning-rate decay after warm-up", choices=("cosine", "constant"))
    min_lr_ratio: float = key(0.1, "final lr of the cosine decay, as a fraction of lr", min=0.0, max=1.0,
                              read_when=("optimizer.schedule", ("cosine",)))
    impl: str = key("auto", "kernel: fused or foreach where torch offers it (auto picks the fastest available: "
                            "one tensor at a time for DTensors on a CPU)", choices=("auto", "fused", "foreach", "for_loop"))


@dataclass
class AdamWConfig(OptimizerConfig):
    name: str = key("adamw", "optimizer (the names runtime/optim.py's OPTIMIZERS builds)")
    betas: List[float] = key([0.9, 0.95], "Adam beta1, beta2")
    eps: float = key(1e-8, "Adam epsilon", min=0.0)


@dataclass
class SGDConfig(OptimizerConfig):
    name: str = key("sgd", "optimizer (the names runtime/optim.py's OPTIMIZERS builds)")
    momentum: float = key(0.9, "momentum factor", min=0.0, max=1.0)
    nesterov: bool = key(False, "Nesterov momentum")


@dataclass
class MemoryConfig:
    level: int = key(0, "activation memory optimisation: 0 none, 1 recompute each layer, "
                        "2 selective recompute (attention and MLP internals), 3 selective recompute by operator "
                        "(every other matmul's and the attention kernel's outputs kept: TorchTitan's op policy)",
                     choices=(0, 1, 2, 3))


@dataclass
class PrecisionConfig:
    name: str = key("auto", "compute precision: auto (bf16 on a CUDA GPU that has it, else fp32; the plan says which), "
                            "fp32, bf16 (master weights and optimizer state fp32, compute bf16), fp16 (as bf16, plus "
                            "dynamic loss scaling)", choices=("auto", "fp32", "bf16", "fp16"))
    tf32: bool = key(False, "on a GPU, let fp32 matmuls and convolutions use TF32 tensor cores (about 2.7x on an H100; "
                            "10-bit mantissa products)")
    # at most 2**32 (Megatron-LM's first scale): a larger one overflows, and each halving costs a skipped step (from
    # 1e300, a thousand of them: a short run trains nothing and fails after its stages ran)
    init_scale: float = key(65536.0, "fp16: the first loss scale (halved on every overflow)", min=1.0, max=2**32,
                            read_when=FP16)
    growth_interval: int = key(2000, "fp16: finite steps after which the loss scale doubles", min=1,
                               read_when=FP16)


@dataclass
class TritonConfig:
    enabled: bool = key(False, "compile the model with torch.compile (Triton kernels on GPU, C++ on CPU)")
    mode: str = key("default", "compile mode; max-autotune is the analogue of ORT's kernel tuning switch",
                    choices=("default", "reduce-overhead", "max-autotune"), read_when=COMPILED)
    scope: str = key("blocks", "blocks: compile each transformer block (composes with hp/pp); model: whole model",
                     choices=("blocks", "model"), read_when=COMPILED)
    fullgraph: bool = key(False, "fail on graph breaks instead of falling back to eager for that part",
                          read_when=COMPILED)
    dynamic: bool = key(False, "compile for dynamic shapes", read_when=COMPILED)
    cache_dir: str = key("${cache_dir}/inductor", "Inductor's cache, so a rerun does not recompile",
                         content=False)
    attention: str = key("auto", "auto: flex for rows of whole documents on CUDA GPUs, else sdpa; sdpa: fused "
                         "scaled-dot-product attention kernels (a dense mask for rows of documents); flex: "
                         "FlexAttention, compiled, with a block mask for rows of documents (CUDA only); math: the "
                         "reference kernel", choices=("auto", "sdpa", "flex", "math"))
    fallback: str = key("fail", "on a compile failure: fail, or eager (continue uncompiled, recorded)",
                        choices=("fail", "eager"), read_when=COMPILED)


@dataclass
class EngineConfig:
    name: str = key(MISSING, "who executes each block's shard-local compute: an engine of the registry "
                             "(plugins/engines: torch, ort, and those installed packages add)")
    opset: int = key(17, "ONNX opset of the exported graphs (the export stage, and the graphs ORT trains)",
                     min=14, max=17)


@dataclass
class TorchEngineConfig(EngineConfig):
    name: str = key("torch", "who executes each block's shard-local compute: an engine of the registry "
                             "(plugins/engines: torch, ort, and those installed packages add)")


@dataclass
class OrtEngineConfig(EngineConfig):
    name: str = key("ort", "who executes each block's shard-local compute: an engine of the registry "
                             "(plugins/engines: torch, ort, and those installed packages add)")
    log_level: str = key("WARNING", "as in ORT's training guide: WARNING (ORT backend errors only), INFO (backend "
                                    "warnings, rank 0 only), DEVINFO (backend info, every rank), VERBOSE (everything, "
                                    "every rank, and a verbose exporter)",
                         choices=("WARNING", "INFO", "DEVINFO", "VERBOSE"), content=False)
    fallback: str = key("fail", "when ORT cannot build or run a unit: fail with ORT's message, or run that unit on the "
                                "torch engine (recorded in MLflow)", choices=("fail", "torch"))
    save_onnx: bool = key(False, "write the graphs ORT runs (forward and fw+bw) into the run folder and MLflow",
                          content=False)
    intra_op_threads: int = key(0, "ORT intra-op threads; 0 means torch's thread count", content=False, min=0,
                                max=MAX_THREADS)
    seed: int = key(0, "ORT's random seed, for ops that draw random numbers inside ORT graphs (dropout stays in torch)",
                    min=0, max=MAX_SEED)


@dataclass
class TrainConfig:
    steps: int = key(300, "optimizer steps (0: none; train.init_from=hf:<folder>'s weights saved, aggregated and "
                          "scored as they are, a baseline for evaluate.tasks)", min=0, max=MAX_STEPS,
                     read_when=("train.epochs", (0,)))
    epochs: float = key(0.0, "instead of train.steps: passes over the training split's examples (records, pairs, "
                             "rows of whole documents, or windows of a packed stream), each drawn once an epoch; "
                             "the steps are counted from the tokenized split before the run is planned (the "
                             "tokenize stage runs first where its output is not cached) and said by the plan "
                             "(0: train.steps counts)", min=0.0, max=1e6)
    batch_size: int = key(16, "global batch: sequences per optimizer step", min=1, max=MAX_TOKENS)
    seq_len: int = key(128, "tokens per sequence", min=1, max=MAX_TOKENS)
    seed: int = key(1234, "seed of initialisation, data order and dropout", min=0, max=MAX_SEED)
    grad_clip: float = key(1.0, "clip the global gradient norm to this (0: off)", min=0.0)
    eval_every: int = key(100, "evaluate the held-out loss every N steps (and at the end); 0: only at the end", min=0)
    eval_batches: int = key(4, "batches per evaluation", min=1)
    checkpoint_every: int = key(100, "save a resumable checkpoint every N steps; 0: only the final one", min=0)
    keep_checkpoints: int = key(2, "periodic checkpoints kept while training (older ones are deleted)", content=False, min=1)
    async_checkpoint: str = key("disabled", "disabled: a save stops training until its files are written; async: the "
                                "state is copied to host memory and written in the background while training goes "
                                "on (DCP's async_save, TorchTitan's checkpoint.async_mode); a checkpoint counts once "
                                "written and published", choices=("disabled", "async"), content=False)
    resume: bool = key(True, "continue an interrupted run from its latest complete checkpoint", content=False)
    init_from: Optional[str] = key(None, "start from this checkpoint folder (written by any layout): weights, optimizer "
                                         "state and step, training continues up to train.steps; or hf:<folder>, a "
                                         "Hugging Face GPT-2 or Llama save_pretrained folder (weights only, step 0)")
    nonfinite: str = key("stop", "a non-finite loss or gradient norm: stop (the stage fails naming the step; no "
                                 "checkpoint of diverged weights is written) or skip (that step's update is dropped "
                                 "and counted; training stops after train.max_nonfinite_skips in a row)",
                         choices=("stop", "skip"))
    max_nonfinite_skips: int = key(10, "consecutive steps without a finite gradient (train.nonfinite=skip, or fp16 "
                                       "overflows) after which training stops", min=1)
    profile: List[int] = key([], "[first, last]: record a torch.profiler trace of these steps (1-based, inclusive) "
                                 "as a Chrome/Perfetto trace in the train output and MLflow, with the top ops in the "
                                 "log; [] records nothing", content=False)
    profile_ranks: str = key("0", "the ranks that record a profile: 0 (rank 0), or all", choices=("0", "all"),
                             content=False)
    label_sparsity: bool = key(True, "run the vocabulary head and the cross-entropy only at the positions whose label "
                                     "enters the loss (gathered before the head; ONNX Runtime's label sparsity, TRL's "
                                     "chunked NLL): the same loss and gradients to fp32 rounding, without the logits "
                                     "of masked prompt tokens and padding; false: the dense head over every position "
                                     "(an objective of pairs always takes the sparse head's per-row log-probabilities)",
                                read_when=TOKEN_LOSS)
    loss_chunk: int = key(1024, "positions the sparse head projects onto the vocabulary at once (its full-width "
                                "logits exist for this many positions only, in the forward and the backward)",
                          min=1, max=MAX_TOKENS, read_when=("train.label_sparsity", (True,)))
    log_every: int = key(20, "print a metrics line every N steps; losses are read back from the device this "
                             "often", content=False, min=0)
    progress: bool = key(True, "show a progress bar", content=False)


@dataclass
class ExportConfig:
    sample_batch: int = key(2, "batch of the example input used to trace the model", min=1)
    sample_seq: int = key(16, "sequence length of the example input used to trace the model", min=1)
    verify_atol: float = key(1e-4, "max |logits(ONNX runtime) - logits(torch)| accepted by the export check (ONNX Runtime "
                                   "when installed, else onnx's reference evaluator)", min=0.0)


@dataclass
class AggregateConfig:
    shard_size_mb: float = key(5000, "largest safetensors file of the aggregated checkpoint and of its hf/ folder: "
                                     "above it they are sharded with an index, as save_pretrained shards (its default "
                                     "is 5 GB). Files only: the stage streams, its memory does not depend on it",
                               min=0.001)
    onnx: bool = key(True, "write the ONNX inference model (model.onnx) and check it in ONNX Runtime, which holds the "
                           "weights once more; false skips it where that cannot fit the aggregating node")
    onnx_external_data_mb: float = key(100, "weights of model.onnx beyond this go to model.onnx.data (ONNX's external "
                                            "data), which ONNX Runtime maps instead of copying: inside the protobuf a "
                                            "load holds them several times over, and protobuf cannot hold more than "
                                            "2 GiB at all; 0 puts them there always", min=0.0, max=2000,
                                      read_when=("aggregate.onnx", (True,)))


@dataclass
class TransformConfig:
    passes: List[str] = key(["layernorm_stats_outputs"], "ONNX passes applied in order (plugins/onnx/passes.py)")


@dataclass
class PlanConfig:
    calibrate_steps: int = key(0, "where no run of this layout was timed on this machine yet, time this many train "
                                  "steps of it before planning (at least 4: the first 3 are warm-up), so that the "
                                  "plan's train time is an estimate, not a floor: the run cut short, its tokenize, "
                                  "export and transform the run's own, its model then deleted (not for a run of "
                                  "no more steps: it times itself); 0: no calibration",
                               min=0, max=MAX_STEPS, content=False)
    trace: bool = key(False, "before anything launches, run one training step of each rank role of the layout (the "
                             "first, middle and last pipeline stage) through the run's own code on fake tensors and "
                             "a fake process group of the layout's world size, on this machine's CPU, and print its "
                             "peak memory by category, collectives, FLOPs and checkpoint bytes beside the estimate; "
                             "a layout whose traced peak exceeds what a rank may use (cluster.device) is refused "
                             "(docs/trace.md)", content=False)
