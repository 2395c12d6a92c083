"""The experiment schema: one dataclass per config section, a help text per field, a module per kind of section
(keys: how a key is declared; model, training, objective, data, cluster, sweeps, evaluate); the whole (`Config`) and its
registration with Hydra here.

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

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from orchestrator.config.schema.cluster import STAGE_TIMES_MIN, ClusterConfig, SlurmClusterConfig, TrackingConfig
from orchestrator.config.schema.data import DataConfig, MixSourceConfig
from orchestrator.config.schema.evaluate import EvaluateConfig
from orchestrator.config.schema.keys import (BPE, CHAT, CHAT_OR_PROMPT, COMPILED, COMPLETION_ONLY, EMPTY, EVALUATING,
                                             FILLED, FP16, LAYOUT_TUNING, LORA, MAX_GPUS, MAX_LAYERS, MAX_RANKS,
                                             MAX_SEED, MAX_STEPS, MAX_THREADS, MAX_TOKENS, MAX_VOCAB, MAX_WAIT_S,
                                             MAX_WIDTH, PP_SCHEDULES, PROMPT_COMPLETION, Filled, key)
from orchestrator.config.schema.model import LlamaConfig, ModelConfig, PeftConfig
from orchestrator.config.schema.objective import ObjectiveConfig, objective_schemas
from orchestrator.config.schema.sweeps import TRAIN_OBJECTIVES, SweepConfig, TuneConfig
from orchestrator.config.schema.training import (AdamWConfig, AggregateConfig, EngineConfig, ExportConfig,
                                                 MemoryConfig, OptimizerConfig, OrtEngineConfig, ParallelConfig,
                                                 PlanConfig, PrecisionConfig, SGDConfig, TorchEngineConfig,
                                                 TrainConfig, TransformConfig, TritonConfig)


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
    objective: ObjectiveConfig = MISSING
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
    phases: dict = key({}, "an experiment of phases, run in order by one command (docs/experiments.md): name -> the "
                           "phase's overrides in the config's shape, `choices` picking config group options "
                           "({choices: {objective: dpo}, objective: {beta: 0.1}}); train.init_from=phase:<name> "
                           "starts from an earlier phase's model", content=False)


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
    "objective": objective_schemas(),
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


# what the sections' modules declare, importable from here as from one schema
__all__ = ["AdamWConfig", "AggregateConfig", "BPE", "CHAT", "CHAT_OR_PROMPT", "COMPILED", "COMPLETION_ONLY",
           "ClusterConfig", "Config", "DataConfig", "EMPTY", "EVALUATING", "EngineConfig", "EvaluateConfig",
           "ExportConfig", "FILLED", "FP16", "Filled", "GROUP_SCHEMAS", "LAYOUT_TUNING", "LORA",
           "LauncherConf", "LlamaConfig", "MAX_GPUS", "MAX_LAYERS", "MAX_RANKS", "MAX_SEED", "MAX_STEPS",
           "MAX_THREADS", "MAX_TOKENS", "MAX_VOCAB", "MAX_WAIT_S", "MAX_WIDTH", "MemoryConfig",
           "MixSourceConfig", "ModelConfig", "ObjectiveConfig", "OptimizerConfig", "OrtEngineConfig", "PP_SCHEDULES",
           "PROMPT_COMPLETION", "ParallelConfig", "PeftConfig", "PlanConfig", "PrecisionConfig",
           "SGDConfig", "STAGE_TIMES_MIN", "SlurmClusterConfig", "SweepConfig", "TRAIN_OBJECTIVES",
           "TorchEngineConfig", "TrackingConfig", "TrainConfig", "TransformConfig", "TritonConfig",
           "TuneConfig", "key", "register"]
