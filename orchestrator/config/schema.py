"""The experiment schema: one dataclass per config section, a help text per field.

YAML files under conf/ only pick values; every key they may set is declared here. Field metadata:
  help     what the key means (shown in errors and in docs/configuration.md)
  choices  the allowed values of a string key
  content  False for keys that do not change what a stage produces (they stay out of the cache key)
  min/max  inclusive bounds of a number
  read_when  (key, values): this key is read only when that key has one of these values (FILLED: any value but
             an empty one; EMPTY: an empty one), or a list of such conditions, all of which must hold
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from plugins.parallel.schedules import SCHEDULES


def key(default: Any, help: str, *, choices: tuple = (), content: bool = True,
        min: Optional[float] = None, max: Optional[float] = None, read_when: Optional[tuple] = None):
    """A config field with its documentation and rules (mutable defaults are copied per instance). read_when:
    (another key, the values it must have) for this key to be read at all; set otherwise, it is refused as a key
    that would do nothing (docs/reliability.md)."""
    meta = {"help": help, "choices": choices, "content": content, "min": min, "max": max, "read_when": read_when}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


PP_SCHEDULES = tuple(SCHEDULES)
MAX_STEPS = 10**9  # no run takes a billion optimizer steps; a larger number is a typo (and overflows counters)
MAX_SEED = 2**32 - 1  # NumPy's and torch's seeds are unsigned; 32 bits is what every library accepts
# sizes past anything trained (the largest models have ~130 layers, widths of ~50k, vocabularies of ~260k): a larger
# number is a typo, and would make the plan itself loop or allocate for ever before its memory check could say so
MAX_LAYERS, MAX_WIDTH, MAX_VOCAB, MAX_TOKENS, MAX_RANKS = 4096, 2**20, 2**24, 2**24, 2**16
MAX_THREADS, MAX_GPUS, MAX_WAIT_S = 4096, 64, 7 * 24 * 3600  # a node's cores and GPUs; a week (timedelta's range)
class Filled:
    """read_when's values for a list or text key: FILLED holds when the key has something in it, EMPTY when not
    (`actual in FILLED`, as for a tuple of values)."""

    def __init__(self, filled: bool, words: str):
        self.filled, self.words = filled, words

    def __contains__(self, actual) -> bool:
        return bool(actual) == self.filled

    def __iter__(self):
        return iter((self.words,))


FILLED, EMPTY = Filled(True, "<something>"), Filled(False, "[]")
EVALUATING = ("evaluate.tasks", FILLED)  # the evaluate stage runs only with tasks to score
FP16 = ("precision.name", ("fp16",))
COMPILED = ("triton.enabled", (True,))
BPE = ("data.tokenizer", ("bpe",))
PROMPT_COMPLETION = ("data.format", ("prompt_completion",))
CHAT = ("data.format", ("chat",))
CHAT_OR_PROMPT = ("data.format", ("chat", "prompt_completion"))
LAYOUT_TUNING = ("tune.name", ("layout",))
COMPLETION_ONLY = ("data.loss_on", ("completion",))


@dataclass
class ModelConfig:
    name: str = key("gpt", "model family: an entry of the model registry (plugins/models)")
    vocab_size: int = key(320, "the vocabulary: must cover the data's (byte corpora need 258)", min=1, max=MAX_VOCAB)
    pad_vocab_to: int = key(1, "embedding and head rows rounded up to a multiple of this (Megatron's padding, e.g. "
                               "128: GPT-2's 50257 -> 50304, which hp up to 128 splits); the padding's logits never "
                               "count, so the loss is the unpadded model's", min=1)
    n_layers: int = key(8, "transformer layers", min=1, max=MAX_LAYERS)
    n_heads: int = key(4, "attention heads per layer", min=1, max=MAX_WIDTH)
    d_model: int = key(64, "hidden size", min=1, max=MAX_WIDTH)
    d_ff: int = key(256, "MLP inner size", min=1, max=MAX_WIDTH)
    max_seq_len: int = key(128, "longest sequence (rows of the position embedding)", min=1, max=MAX_TOKENS)
    dropout: float = key(0.0, "dropout probability on attention output and MLP output", min=0.0, max=0.95)
    activation: str = key("gelu", "MLP activation (gelu_tanh: GPT-2's approximation)",
                          choices=("gelu", "gelu_tanh", "relu", "silu", "elu"))
    tie_embeddings: bool = key(True, "share the token embedding with the output projection (GPT-2 style)")
    bias: bool = key(True, "biases in Linear and LayerNorm layers")
    init_std: float = key(0.02, "std of the normal weight initialisation", min=0.0)


@dataclass
class LlamaConfig(ModelConfig):
    name: str = key("llama", "model family: an entry of the model registry (plugins/models)")
    n_kv_heads: Optional[int] = key(None, "key/value heads of grouped-query attention (null: as many as "
                                          "model.n_heads); each serves n_heads/n_kv_heads query heads", min=1)
    rope_theta: float = key(10000.0, "base of the rotary position embedding's frequencies (Llama 3: 500000)",
                            min=1.0)
    norm_eps: float = key(1e-5, "RMSNorm's epsilon", min=0.0)
    activation: str = key("silu", "MLP activation (Llama's MLP is SwiGLU: silu(gate) * up)", choices=("silu",))
    tie_embeddings: bool = key(False, "share the token embedding with the output projection")
    bias: bool = key(False, "biases in Linear layers (Llama has none)")


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
                        "2 selective recompute (attention and MLP internals)", choices=(0, 1, 2))


@dataclass
class PrecisionConfig:
    name: str = key("auto", "compute precision: auto (bf16 on a CUDA GPU that has it, else fp32; the plan says which), "
                            "fp32, bf16 (master weights and optimizer state fp32, compute bf16), fp16 (as bf16, plus "
                            "dynamic loss scaling)", choices=("auto", "fp32", "bf16", "fp16"))
    tf32: bool = key(False, "on a GPU, let fp32 matmuls and convolutions use TF32 tensor cores (about 2.7x on an H100; "
                            "10-bit mantissa products)")
    init_scale: float = key(65536.0, "fp16: the first loss scale (halved on every overflow)", min=1.0,
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
class MixSourceConfig:
    paths: List[str] = key([], "this source's files, folders or glob patterns (as data.paths)")
    weight: float = key(1.0, "its share of a batch's rows, relative to the other sources' weights (a row draws its "
                              "source by weight from the seed and step); changing it re-tokenizes nothing", min=0.0)
    text_field: Optional[str] = key(None, "the field or column of its records' text (default: data.text_field)",
                                    read_when=("data.format", ("text",)))


@dataclass
class DataConfig:
    name: str = key(MISSING, "data source: an entry of the data registry (plugins/data: synthetic, stdlib, text; "
                    "packages add theirs through the orchestrator.data entry points)")
    val_fraction: float = key(0.05, "share of documents held out for evaluation", min=0.0001, max=0.5)
    packing: bool = key(True, "concatenate documents (separated by <eos>) instead of padding each one")
    packing_strategy: str = key("auto", "data.packing=true: wrapped (a row is a window of the documents back to back, "
                                        "attending across them: pretraining's way) or bfd (a row holds whole "
                                        "documents, best-fit decreasing; attention stays within a document and "
                                        "positions restart at each, as if each ran alone: fine-tuning's way); auto: "
                                        "bfd for records of prompt_completion or chat, wrapped for text",
                                choices=("auto", "wrapped", "bfd"), read_when=("data.packing", (True,)))
    long_documents: str = key("split", "data.packing_strategy=bfd (auto: for chats and prompt/completion records): a "
                                       "document longer than train.seq_len+1 tokens is split into pieces that "
                                       "overlap by one token (each learned as a document of its own) or refused: "
                                       "before launch where its bytes make it longer whatever the tokenizer (a "
                                       "text file, the first records of a file), else by the tokenize stage, "
                                       "naming its file (and line) (train.seq_len then enters that stage's key)",
                              choices=("split", "refuse"),
                              read_when=[("data.packing", (True,)), ("data.packing_strategy", ("bfd",))])
    balance_ranks: bool = key(True, "data.packing=false: deal each batch's rows (documents padded to "
                                    "train.seq_len) so that every data-parallel rank gets about the same real "
                                    "tokens, and where the layout allows (no pipeline, engine=torch, no "
                                    "compilation) each rank packs its rows' tokens into fewer rows with a document "
                                    "mask, so that it computes about its real tokens; the loss does not change",
                              read_when=("data.packing", (False,)))
    paths: List[str] = key([], "text: files, folders (searched for *.txt, *.md, *.py, *.rst, *.jsonl, *.parquet) or "
                               "glob patterns of UTF-8 text; JSON Lines and Parquet files hold one document per record")
    split: str = key("train", "a Hugging Face datasets folder in data.paths (DatasetDict.save_to_disk's, or a Hub "
                              "snapshot: a dataset card beside data/{split}-*.parquet): the split read, as "
                              "load_from_disk / load_dataset name them (the held-out part is still "
                              "data.val_fraction of it)", read_when=("data.name", ("text",)))
    format: str = key("text", "what a record is: text (one field, every token trained), prompt_completion (a "
                              "prompt and its completion) or chat (a list of {role, content} messages, rendered "
                              "with the chat template); records from JSON Lines or Parquet; what the model learns: "
                              "data.loss_on", choices=("text", "prompt_completion", "chat"))
    text_field: str = key("text", "text: the field (JSON Lines) or column (Parquet) that holds a record's text",
                          read_when=("data.format", ("text",)))
    prompt_field: str = key("prompt", "data.format=prompt_completion: the field that holds a record's prompt",
                            read_when=PROMPT_COMPLETION)
    completion_field: str = key("completion", "data.format=prompt_completion: the field that holds its completion",
                                read_when=PROMPT_COMPLETION)
    prompt_encoding: str = key("separate", "data.format=prompt_completion with text fields: separate (the prompt "
                                           "and the completion encoded apart, so the prompt's tokens are those "
                                           "inference reads and the completion starts at a token boundary) or "
                                           "joint (encoded as one text, its first len(prompt's ids) tokens not "
                                           "learned: TRL's exact ids and completion_mask; a token may then span the "
                                           "boundary, e.g. 'Answer: ' + 'the' gives ' the' where inference reads "
                                           "' ' and generates 'the')", choices=("separate", "joint"),
                               read_when=PROMPT_COMPLETION)
    messages_field: str = key("messages", "data.format=chat: the field that holds a record's messages",
                              read_when=CHAT)
    tools_field: str = key("tools", "data.format=chat: the field that holds a record's tools (a list of JSON "
                                    "schemas, TRL's `tools`), passed to the chat template as transformers' "
                                    "apply_chat_template(tools=...) passes them; a record without it has none",
                           read_when=CHAT)
    chat_turns: str = key("auto", "data.format=chat, data.loss_on=completion: the training examples a chat makes: all "
                                  "(one, every assistant turn learned), each (one per assistant turn: the "
                                  "conversation up to it as inference renders it, that turn learned), last (the "
                                  "last assistant turn's), or auto (all where the template's renderings of a "
                                  "conversation's beginnings are the start of the whole, else each: reasoning "
                                  "models' templates, Qwen3's and DeepSeek-R1's, drop earlier turns' reasoning)",
                          choices=("auto", "all", "each", "last"), read_when=[CHAT, COMPLETION_ONLY])
    learn_reasoning: bool = key(True, "data.format=chat, data.loss_on=completion: an assistant turn's reasoning "
                                      "(reasoning_content, or the <think> block opening its content) is learned "
                                      "with its answer; false: read, not learned (what follows it is)",
                                read_when=[CHAT, COMPLETION_ONLY])
    chat_template: str = key("", "records rendered as chats (data.format=chat, and prompt/completion records whose "
                                 "prompt and completion are lists of messages): the Jinja template, as transformers' "
                                 "apply_chat_template; a value with Jinja markup ({{ or {%) is the template's text, "
                                 "anything else a file's path. Default: the data.tokenizer=hf: folder's own "
                                 "(chat_template.jinja or tokenizer_config.json's chat_template)",
                             read_when=CHAT_OR_PROMPT)
    chat_template_name: str = key("", "the data.tokenizer=hf: folder's named chat template (tokenizer_config.json's "
                                      "list form, additional_chat_templates/NAME.jinja); default: its default one",
                                  read_when=CHAT_OR_PROMPT)
    loss_on: str = key("completion", "records: the tokens whose labels enter the loss: completion (a completion and "
                                     "the <eos> after it, or the assistant's turns: what {% generation %} tags mark, "
                                     "else what each assistant message adds to the template's rendering after the "
                                     "generation prompt; the others' labels are -100, TRL's completion_only_loss and "
                                     "assistant_only_loss) or all", choices=("completion", "all"),
                       read_when=("data.format", ("prompt_completion", "chat")))
    tokenizer: str = key("bytes", "bytes (one token per byte, lossless), bpe (a byte-level BPE of data.vocab_size "
                                  "trained on the corpus, saved with the tokens), or hf:<folder> (a Hugging Face "
                                  "tokenizer.json / save_pretrained folder)")
    vocab_size: int = key(2048, "data.tokenizer=bpe: the vocabulary it learns (bytes, <eos>, <pad> and merges); "
                                "model.vocab_size must be at least this", min=259, max=MAX_VOCAB, read_when=BPE)
    max_bytes: int = key(16_000_000, "read the corpus's first this many bytes, in file order, the last file cut at a "
                                     "line start (0: all of it); the plan says how much it leaves out", min=0)
    tasks: Optional[int] = key(None, "processes of the tokenize stage, each taking a contiguous part of the corpus "
                                     "(files, and big files by byte ranges at line starts); the result does not "
                                     "depend on it. Default: the usable cores (local; 1 on debug), one per node of "
                                     "cluster.nodes (slurm); at most one per MiB of corpus", content=False, min=1,
                               read_when=("cluster.name", ("local", "slurm")))  # debug: in this process, alone
    bpe_sample_bytes: int = key(1_000_000_000, "data.tokenizer=bpe: it learns from at most this many bytes of the "
                                               "training split, pieces spread evenly over the corpus (streamed)",
                                min=1, read_when=BPE)
    mix: List[MixSourceConfig] = key([], "data=text: several sources mixed by weight (Megatron's blend), e.g. "
                                         "'data.mix=[{paths: [/corpus/web], weight: 0.7}, {paths: [/corpus/code], "
                                         "weight: 0.3}]'; each is tokenized on its own (data.max_bytes each), with "
                                         "one tokenizer; data.paths stays empty")
    preview: int = key(0, "print the first this many records of each source as the model will see them (tokens "
                          "decoded, the part that enters the loss marked) after the plan, and stop: nothing runs "
                          "(0: the plan shows the first one and the run goes on)", content=False, min=0)
    synthetic_tokens: int = key(1_000_000, "synthetic: length of the random token stream", min=2,
                                read_when=("data.name", ("synthetic",)))


@dataclass
class ClusterConfig:
    name: str = key(MISSING, "where stages run: local (subprocesses), debug (in this process) or slurm (submitit jobs)",
                    choices=("local", "debug", "slurm"))
    nprocs: Optional[int] = key(None, "processes of the train stage; default dp*hp*pp (must equal it if set)", min=1)
    threads_per_rank: Optional[int] = key(None, "torch threads per rank; default: for one rank OMP_NUM_THREADS if set, "
                                          "else all usable cores; 1 each for several",
                                          content=False, min=1, max=MAX_THREADS)
    pg_timeout_s: int = key(300, "process-group timeout: a rank that stops answering fails the job after this long",
                            content=False, min=1, max=MAX_WAIT_S)
    heartbeat_timeout_s: int = key(60, "local cluster: a rank whose process shows no sign of life (a heartbeat every "
                                       "2 s from a thread of its own) for this long is named and the stage stopped "
                                       "(frozen, stopped, swapped out); ranks waiting in a collective still beat",
                                   content=False, min=5, max=MAX_WAIT_S)
    start_method: str = key("forkserver", "local cluster: how stage processes start. forkserver: forked from one "
                                          "process per run that has imported torch, the stages and MLflow once "
                                          "(under 0.1 s each); exec: a fresh `python -m orchestrator.worker` each "
                                          "(1-3 s of imports per process; for a library that misbehaves after fork)",
                            choices=("forkserver", "exec"), content=False)


STAGE_TIMES_MIN = {"tokenize": 60, "export": 10, "transform": 10, "train": 60, "checkpoint": 10, "aggregate": 20, "evaluate": 60}


@dataclass
class SlurmClusterConfig(ClusterConfig):
    partition: Optional[str] = key(None, "SLURM partition (default: the cluster's default partition)", content=False)
    account: Optional[str] = key(None, "SLURM account to charge", content=False)
    qos: Optional[str] = key(None, "SLURM quality of service", content=False)
    time_min: Dict[str, int] = key(STAGE_TIMES_MIN, "time limit of each stage's job, in minutes (train: the limit "
                                                    "of one attempt; it is requeued from its checkpoint)",
                                   content=False)
    cpus_per_task: Optional[int] = key(None, "CPUs per task (rank); default: threads_per_rank, else 1", content=False,
                                       min=1, max=MAX_THREADS)
    mem_per_task_gb: Optional[float] = key(None, "memory per task in GB (default: the partition's default)",
                                           content=False, min=0.0)
    gpus_per_task: int = key(0, "GPUs per task (rank)", content=False, min=0, max=MAX_GPUS)
    nodes: int = key(1, "nodes a job spreads its tasks over evenly (the train job's dp*hp*pp, the tokenize job's "
                        "data.tasks); a job of fewer tasks takes one node per task", content=False, min=1)
    setup: List[str] = key([], "shell lines run in each job before the stage (module load, source venv, ...)",
                           content=False)
    sbatch: Dict[str, Any] = key({}, "extra sbatch parameters, e.g. {constraint: a100, exclusive: true}",
                                 content=False)
    folder: Optional[str] = key(None, "submitit's folder (job scripts, logs, results); default: <run dir>/submitit",
                                content=False)
    wait: bool = key(True, "follow the jobs until they end; false: return after submission (follow later with "
                           "python -m orchestrator.follow <run dir>)", content=False)
    max_requeues: int = key(3, "times a preempted or timed-out train job is requeued from its checkpoint",
                            content=False, min=0)
    signal_delay_s: int = key(90, "SLURM signals the train job this long before its time limit (it checkpoints)",
                              content=False, min=0)
    poll_s: float = key(2.0, "how often the jobs' states are polled while following them", content=False, min=0.1)


@dataclass
class TuneConfig:
    name: str = key("none", "none: run the experiment; layout: try the layouts of tune.world_size ranks for a few "
                            "steps each, rank them and print the command that trains with the best",
                    choices=("none", "layout"), content=False)
    world_size: int = key(1, "tune=layout: the ranks to lay out (dp*hp*pp)", min=1, content=False,
                          read_when=LAYOUT_TUNING)
    steps: int = key(5, "tune=layout: timed training steps per layout (the first steps of a run are warm-up)", min=4,
                     content=False, read_when=LAYOUT_TUNING)
    pp_schedules: List[str] = key(["1f1b"], "tune=layout: the pipeline schedules tried for each layout with pp > 1 "
                                            "(interleaved_1f1b, looped_bfs, interleaved_zb and zbv with 2 model "
                                            "chunks per rank)", content=False, choices=PP_SCHEDULES,
                                  read_when=LAYOUT_TUNING)
    microbatches_per_stage: List[int] = key([2], "tune=layout: pipeline microbatches per stage tried for each "
                                                 "layout with pp > 1 (parallel.microbatches = this x pp; more: a "
                                                 "smaller bubble, smaller matmuls)", content=False, min=1,
                                            read_when=LAYOUT_TUNING)
    objective: str = key("tokens_per_s", "tune=layout: what ranks the layouts: tokens_per_s (fastest first) or memory "
                                         "(smallest peak per rank first)", choices=("tokens_per_s", "memory"),
                         content=False, read_when=LAYOUT_TUNING)


TRAIN_OBJECTIVES = ("eval_loss", "loss", "tokens_per_s", "peak_memory")  # sweep.objective from the train stage


@dataclass
class SweepConfig:
    parallelism: int = key(1, "-m sweeps on local/debug clusters: points run at once (SLURM runs all points at "
                              "once; its scheduler queues what does not fit)", content=False, min=1)
    max_points: int = key(256, "-m sweeps: the most points a sweep may have (every one is validated before the first "
                               "starts, about 0.2 s each); an optimising sweeper's search space larger than this has "
                               "each value validated alone", content=False, min=1, max=10**7)
    objective: str = key("eval_loss", "what a point returns to Hydra's sweeper (Optuna, Nevergrad, Ax optimise it) and "
                                      "what ranks the sweep's summary: eval_loss, loss (final train loss), tokens_per_s "
                                      "or peak_memory (MB, the worst rank's), or <task>/<metric>: a score of the "
                                      "evaluate stage (e.g. arith_mc/acc, a task in evaluate.tasks; its direction the "
                                      "task's)", content=False)


@dataclass
class TrackingConfig:
    name: str = key(MISSING, "experiment tracking backend", choices=("mlflow", "none"))
    uri: str = key("sqlite:///${runs_dir}/mlflow.db", "MLflow tracking URI", content=False)
    experiment: str = key("orchestrator", "MLflow experiment name", content=False)
    artifact_root: str = key("${runs_dir}/mlartifacts", "where a new experiment stores artifacts", content=False)
    max_artifact_mb: int = key(200, "larger files are recorded by path instead of copied into MLflow", content=False, min=0)


@dataclass
class TrainConfig:
    steps: int = key(300, "optimizer steps", min=1, max=MAX_STEPS)
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
                                     "of masked prompt tokens and padding; false: the dense head over every position")
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
class EvaluateConfig:
    tasks: List[str] = key([], "lm-evaluation-harness tasks the evaluate stage scores the aggregate's hf/ folder on, "
                               "after aggregate: ones the project ships (plugins/evaluate/tasks: arith_mc, arith_gen, "
                               "arith_chat, and val_perplexity: the run's own validation split), ones in "
                               "evaluate.include_path, or lm-eval's own where their data is reachable; [] runs no "
                               "evaluate stage")
    include_path: Optional[str] = key(None, "a folder of lm-eval task YAML files (lm-eval's --include_path); its "
                                            "files enter the stage's key, as data files do", read_when=EVALUATING)
    num_fewshot: int = key(0, "examples of the task put before each question (lm-eval's --num_fewshot)", min=0,
                           max=64, read_when=EVALUATING)
    limit: Optional[int] = key(None, "score only the first N examples of each task (None: all)", min=1,
                               read_when=EVALUATING)
    batch_size: int = key(8, "examples scored at once", min=1, max=4096, read_when=EVALUATING)
    seed: int = key(1234, "lm-eval's seeds (few-shot draws, sampling)", min=0, max=MAX_SEED,
                    read_when=EVALUATING)
    apply_chat_template: bool = key(False, "put each question in the model's own chat template, the tokenizer's "
                                           "(lm-eval's --apply_chat_template; arith_chat is made for it)",
                                    read_when=EVALUATING)
    prompts: List[str] = key([], "prompts the trained model answers (greedy) after scoring, logged as the MLflow "
                                 "table generations.json (in the chat template where the tokenizer has one); []: the "
                                 "first evaluate.generations validation prompts of a chat or prompt-completion corpus "
                                 "(a text corpus: a document's first 32 tokens)", read_when=EVALUATING)
    generations: int = key(4, "how many validation prompts are answered when evaluate.prompts is empty (0: none)",
                           min=0, max=1000, read_when=[EVALUATING, ("evaluate.prompts", EMPTY)])
    max_new_tokens: int = key(64, "the longest answer generated for a prompt, in tokens", min=1, max=MAX_TOKENS,
                              read_when=EVALUATING)
    onnx: bool = key(False, "also score the aggregate's ONNX model through ONNX Runtime on the loglikelihood tasks "
                            "(multiple choice, perplexity): the stage fails where a loglikelihood differs from hf/'s "
                            "by more than 1e-4, and records both scores (needs aggregate.onnx)",
                     read_when=EVALUATING)


LORA = ("peft.name", ("lora",))


@dataclass
class PeftConfig:
    name: str = key("none", "none: every weight trains; lora: low-rank adapters on the target Linears train, the "
                            "base weights (train.init_from's) stay frozen: no gradient, no optimizer state, not in "
                            "the checkpoints", choices=("none", "lora"))
    rank: int = key(8, "the adapters' rank r (LoRA's A is r x in, B is out x r)", min=1, max=MAX_WIDTH,
                    read_when=LORA)
    alpha: float = key(16.0, "the adapters' scale is alpha / rank (peft's lora_alpha)", min=0, read_when=LORA)
    dropout: float = key(0.0, "dropout on the adapters' input (peft's lora_dropout)", min=0, max=0.99,
                         read_when=LORA)
    targets: List[str] = key(["attention", "mlp"], "the Linears that get adapters, by the model family's own names "
                                                   "(wq, wk, wv, wo, fc1, fc2, and fc3 in Llama's MLP), or "
                                                   "`attention` (wq, wk, wv, wo) and `mlp` (its Linears)",
                             read_when=LORA)
    trainable: List[str] = key([], "weights that train beside the adapters: `bias` (every bias), or parameter names "
                                   "ending so (lm_head.weight, ln_f.weight)", read_when=LORA)


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


@dataclass
class Config:
    model: ModelConfig = MISSING
    parallel: ParallelConfig = MISSING
    optimizer: OptimizerConfig = MISSING
    memory: MemoryConfig = MISSING
    precision: PrecisionConfig = MISSING
    triton: TritonConfig = MISSING
    engine: EngineConfig = MISSING
    data: DataConfig = MISSING
    cluster: ClusterConfig = MISSING
    tracking: TrackingConfig = MISSING
    peft: PeftConfig = MISSING
    train: TrainConfig = field(default_factory=TrainConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    transform: TransformConfig = field(default_factory=TransformConfig)
    aggregate: AggregateConfig = field(default_factory=AggregateConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    tune: TuneConfig = MISSING
    dry_run: bool = key(False, "print the plan (stages, cache hits, resources, commands) and exit", content=False)
    runs_dir: str = key("runs", "outputs: run folders, cache/, mlflow.db (relative to the working directory)",
                        content=False)
    cache_verify: str = key("hash", "how a cache hit is checked against its _entry.json before it is reused: hash "
                                    "(sizes, and the sha256 of every file written since it last verified: a stat per "
                                    "untouched file, a disk's read speed for changed ones), full (the sha256 of every "
                                    "file on every hit, about 1 s per GB: also catches damage that bypasses the "
                                    "filesystem, such as bit rot) or size (sizes only); a damaged entry is set aside "
                                    "and its stage runs again", choices=("hash", "full", "size"), content=False)
    cache_dir: str = key("${runs_dir}/cache", "the content-addressed store of every stage's outputs (also ORT's cache "
                                              "directory: exported and transformed graphs live here)", content=False)


# group name -> {option-schema name: dataclass}; YAML options start with `defaults: [<option-schema name>]`
GROUP_SCHEMAS = {
    "model": {"model_schema": ModelConfig, "llama_schema": LlamaConfig},
    "parallel": {"parallel_schema": ParallelConfig},
    "optimizer": {"adamw_schema": AdamWConfig, "sgd_schema": SGDConfig},
    "memory": {"memory_schema": MemoryConfig},
    "precision": {"precision_schema": PrecisionConfig},
    "triton": {"triton_schema": TritonConfig},
    "engine": {"torch_schema": TorchEngineConfig, "ort_schema": OrtEngineConfig},
    "data": {"data_schema": DataConfig},
    "cluster": {"cluster_schema": ClusterConfig, "slurm_schema": SlurmClusterConfig},
    "tracking": {"tracking_schema": TrackingConfig},
    "tune": {"tune_schema": TuneConfig},
    "peft": {"peft_schema": PeftConfig},
}


@dataclass
class LauncherConf:
    """hydra/launcher=orchestrator: the sweep launcher (orchestrator/sweeps/launcher.py, found through hydra_plugins/)."""
    _target_: str = "hydra_plugins.orchestrator_launcher.orchestrator_launcher.OrchestratorLauncher"


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    cs.store(group="hydra/launcher", name="orchestrator", node=LauncherConf, provider="orchestrator")
    for group, schemas in GROUP_SCHEMAS.items():
        for name, node in schemas.items():
            cs.store(group=group, name=name, node=node)

