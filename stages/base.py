"""The stage contract: a stage is data plus one function; the DAG does the rest.

A stage reads config subtrees (they enter its cache key), takes its upstream stages' output folders as
inputs, and writes its own outputs into `ctx.out`. Nothing else passes between stages.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from storage.fsio import KnownHashes


@dataclass(frozen=True)
class Resources:
    tasks: int = 1                 # processes (ranks) the stage runs as
    cpus_per_task: int = 1
    timeout_min: int = 60


class Tracker:
    """What a stage may record about itself. This base records nothing (tracking=none, ranks other than 0)."""

    def log_params(self, params: dict[str, Any]) -> None: ...

    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None: ...

    def log_artifact(self, path: Path, artifact_path: Optional[str] = None) -> None: ...

    def set_tags(self, tags: dict[str, Any]) -> None: ...

    def log_table(self, data: dict[str, list], artifact_file: str) -> None:
        """Columns of equal length, shown as a table (MLflow's log_table: the evaluate stage's generations)."""

    def flush(self) -> None: ...

    def end(self, status: str) -> None: ...

    def last_step(self, metric: str) -> Optional[int]:
        """The last step at which `metric` was recorded in this run (None: never, or not tracked)."""
        return None


@dataclass
class StageContext:
    cfg: Any                        # the whole resolved config (DictConfig)
    inputs: dict[str, Path]         # upstream stage name -> its output folder
    out: Path                       # write outputs here; published atomically when run() returns
    scratch: Path                   # survives a failed attempt (resume state), deleted after publishing
    aside: Optional[Path] = None    # where damaged data found in scratch is kept (outlives the scratch folder)
    published: Optional[Path] = None  # where `out` is kept once published (the cache entry), for files that name it
    key: str = ""                   # this stage's content key (hash of its config, inputs and code)
    rank: int = 0
    world_size: int = 1
    tracker: Tracker = field(default_factory=Tracker)
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("stage"))
    interactive: bool = False       # stdout ends at a terminal: live progress bars are welcome
    # sha256 of files in `out` the stage made for its own checks: the cache entry's file table reuses them
    hashes: KnownHashes = field(default_factory=KnownHashes)

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class Stage:
    name: str
    run: Callable[[StageContext], None]
    after: tuple[str, ...] = ()
    """upstream stages: their output keys enter this stage's key, their folders are its inputs."""
    reads: tuple[str, ...] = ()
    """config paths (e.g. "model", "train") whose content enters the key."""
    ignores: tuple[str, ...] = ()
    """paths inside what it reads that do not enter its key; a list's items each lose the field (tokenize:
    "data.mix.weight": the weights decide what train draws, not what is tokenized)."""
    resources: Callable[[Any], Resources] = lambda cfg: Resources()
    fingerprint: Optional[Callable[[Any], Any]] = None
    """extra key material computed from the config (e.g. a fingerprint of the data files)."""
    progress: Optional[Callable[[Path], Optional[str]]] = None
    """(scratch folder) -> what an interrupted attempt left, e.g. "resumes at step 200"."""
    summary: Optional[Callable[[Path], str]] = None
    """(output folder) -> one line for the result table, e.g. "final loss 2.31"."""
    lineage: tuple[str, ...] = ()
    """config paths that decide what an interrupted attempt computed, not how (no layout, cluster or code): an
    attempt under another key with the same lineage and upstream data may be continued (`adopt`)."""
    collective: bool = True
    """its tasks form a process group (torch.distributed) and meet at a barrier before publishing; False: they
    share only files (tokenize: tasks of very different lengths would outwait the group's timeout)."""
    enabled: Callable[[Any], bool] = lambda cfg: True
    """whether this config runs the stage at all (evaluate: only with evaluate.tasks); a stage left out is not
    planned, and nothing after it may need it (but as `optional`)."""
    optional: tuple[str, ...] = ()
    """upstream stages of `after` this stage runs after only when the config runs them (train after the reference
    log-probabilities: preference pairs only); left out, they are neither inputs nor in the key."""
    starts: bool = False
    """it reads the weights train.init_from names: on SLURM its job waits for the job that writes them, where one is
    queued (an experiment's earlier phase's aggregate: orchestrator/phases.py)."""
    adopt: Optional[Callable[..., Optional[int]]] = None
    """(cfg, an earlier attempt's scratch, this attempt's scratch or None, its key) -> the step this attempt would
    continue from (None: nothing usable); given this attempt's scratch, the state is linked into it."""

    @property
    def module(self) -> str:
        return self.run.__module__
