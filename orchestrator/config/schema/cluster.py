"""Where stages run (`cluster`: local processes or SLURM jobs, their time limits) and where they are recorded
(`tracking`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

from orchestrator.config.schema.keys import key, MAX_THREADS, MAX_GPUS, MAX_WAIT_S


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
    device: Optional[str] = key(None, "what each rank holds, for the plan's memory per rank: h100_80gb, h100_94gb, "
                                      "h200, a100_80gb, a100_40gb, or its memory in GiB (e.g. 24); null: the "
                                      "machine's own (its GPU, its RAM, or cluster.mem_per_task_gb on SLURM). A plan "
                                      "on a CPU for the GPUs a run will get (planning/devices.py)", content=False)


STAGE_TIMES_MIN = {"tokenize": 60, "reference": 60, "export": 10, "transform": 10, "train": 60, "checkpoint": 10,
                   "aggregate": 20, "evaluate": 60}


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
class TrackingConfig:
    name: str = key(MISSING, "experiment tracking backend", choices=("mlflow", "none"))
    uri: str = key("sqlite:///${runs_dir}/mlflow.db", "MLflow tracking URI", content=False)
    experiment: str = key("orchestrator", "MLflow experiment name", content=False)
    artifact_root: str = key("${runs_dir}/mlartifacts", "where a new experiment stores artifacts", content=False)
    max_artifact_mb: int = key(200, "larger files are recorded by path instead of copied into MLflow", content=False, min=0)
