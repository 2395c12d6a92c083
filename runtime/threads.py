"""How many torch threads a rank runs: one rule for the worker that sets it and the plan that estimates with it."""
from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional


def usable_cores() -> int:
    """The CPUs this process may run on: a SLURM allocation's or a taskset's, not every core of the machine."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call on this platform
        return os.cpu_count() or 1


def rank_threads(configured: Optional[int], ranks: int) -> int:
    """cluster.threads_per_rank when set. Else one rank takes OMP_NUM_THREADS when the environment sets it (the
    user's or a launcher's choice, e.g. jobs that share a machine: two 2-thread jobs on 2 cores run 2-6x slower
    than two 1-thread ones), else every usable core; several ranks share the cores, 1 thread each."""
    if configured:
        return int(configured)
    if ranks > 1:
        return 1
    omp = os.environ.get("OMP_NUM_THREADS", "")
    return int(omp) if omp.isdigit() and int(omp) > 0 else usable_cores()


@contextlib.contextmanager
def cores_shared_by(jobs: int) -> Iterator[None]:
    """While `jobs` run at once on this machine (a local sweep's points), a one-rank stage takes 1/jobs of the
    usable cores (through OMP_NUM_THREADS, which rank_threads reads and ranks inherit), unless the user set it."""
    if jobs <= 1 or "OMP_NUM_THREADS" in os.environ:
        yield
        return
    os.environ["OMP_NUM_THREADS"] = str(max(1, usable_cores() // jobs))
    try:
        yield
    finally:
        os.environ.pop("OMP_NUM_THREADS", None)
