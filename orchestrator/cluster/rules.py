"""The cluster executors' rules: the train stage's processes fit what the executor can run (one process per rank;
one GPU per local rank on a CUDA machine; an even spread over SLURM's nodes) and SLURM is there to submit to."""
from __future__ import annotations

import shutil

from planning.problem import Problem
from runtime import machine


def check(cfg) -> list[Problem]:
    p, c = cfg.parallel, cfg.cluster
    world = p.dp * p.hp * p.pp
    problems = []
    if c.nprocs is not None and c.nprocs != world:
        problems.append(Problem("cluster.nprocs", c.nprocs, f"the train stage runs one process per rank: "
                                f"parallel.dp*hp*pp = {p.dp}*{p.hp}*{p.pp} = {world} processes",
                                f"cluster.nprocs={world}, or leave it unset (null)"))
    if c.name == "debug" and world > 1:
        problems.append(Problem("cluster", "debug", f"the debug cluster runs stages inside this process (one rank); "
                                f"the layout needs {world}", "cluster=local"))
    if c.name == "local":
        problems += _local_gpus(cfg, world)
    if c.name == "slurm":
        problems += _slurm(cfg, world)
    return problems


def _local_gpus(cfg, world: int) -> list[Problem]:
    """On a CUDA machine the local cluster gives each rank a GPU of its own: NCCL refuses two ranks on one."""
    if world == 1 or not machine.has_cuda():
        return []
    gpus = machine.cuda_devices()
    if world <= gpus:
        return []
    p = cfg.parallel
    return [Problem("parallel", f"dp{p.dp} hp{p.hp} pp{p.pp}", f"cluster=local runs each of the layout's {world} "
                    f"ranks (dp*hp*pp) on a CUDA GPU of its own, and this machine shows {gpus} "
                    "(NCCL cannot put two ranks on one GPU)", f"a layout of at most {gpus} rank(s) (parallel=single "
                    "for one), cluster=slurm cluster.gpus_per_task=1 to spread the ranks over more GPUs, or "
                    f"CUDA_VISIBLE_DEVICES= to run the {world} ranks on the CPU")]


def _slurm(cfg, world: int) -> list[Problem]:
    from orchestrator.config.schema import STAGE_TIMES_MIN

    c = cfg.cluster
    problems = []
    if world % c.nodes:
        fits = [n for n in range(1, world + 1) if world % n == 0]
        problems.append(Problem("cluster.nodes", c.nodes, f"the train job's {world} tasks (dp*hp*pp) are spread evenly "
                                f"over the nodes: {world} must be divisible by cluster.nodes",
                                f"cluster.nodes= one of {fits}"))
    unknown = sorted(set(c.time_min) - set(STAGE_TIMES_MIN))
    if unknown:
        problems.append(Problem(f"cluster.time_min.{unknown[0]}", c.time_min[unknown[0]], "time limits are given per "
                                f"stage: {', '.join(STAGE_TIMES_MIN)}", "cluster.time_min.train=120"))
    for stage, minutes in c.time_min.items():
        if not isinstance(minutes, int) or minutes < 1:
            problems.append(Problem(f"cluster.time_min.{stage}", minutes, "a job's time limit is a whole number of "
                                    "minutes >= 1", f"cluster.time_min.{stage}={STAGE_TIMES_MIN.get(stage, 60)}"))
    if not cfg.dry_run and not (shutil.which("sbatch") and shutil.which("sacct")):
        problems.append(Problem("cluster", "slurm", "cluster=slurm submits with sbatch and follows jobs with sacct "
                                "(SLURM accounting); they are not on this machine's PATH",
                                "run on a SLURM login node, or start the bundled single-node cluster "
                                "(sudo scripts/slurm_cluster.sh start), or cluster=local; dry_run=true prints the "
                                "sbatch scripts without SLURM"))
    return problems
