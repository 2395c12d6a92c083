"""The cluster executors' rules: the train stage's processes fit what the executor can run (one process per rank;
one GPU per local rank on a CUDA machine; an even spread over SLURM's nodes) and SLURM is there to submit to."""
from __future__ import annotations

import shutil

from common.problem import Problem
from plugins.parallel import world_size
from runtime import machine


def check(cfg) -> list[Problem]:
    p, c = cfg.parallel, cfg.cluster
    world = world_size(p)
    problems = []
    if c.nprocs is not None and c.nprocs != world:
        problems.append(Problem("cluster.nprocs", c.nprocs, f"the train stage runs one process per rank: "
                                f"parallel.dp*hp*pp = {p.dp}*{p.hp}*{p.pp} = {world} processes",
                                f"cluster.nprocs={world}, or leave it unset (null)"))
    if c.name == "debug" and world > 1:
        problems.append(Problem("cluster", "debug", f"the debug cluster runs stages inside this process (one rank); "
                                f"the layout needs {world}", "cluster=local"))
    if c.name == "debug" and cfg.sweep.parallelism > 1:
        problems.append(Problem("sweep.parallelism", cfg.sweep.parallelism, "the debug cluster runs each stage "
                                "inside this process, in its main thread (where signals and the stage's state live): "
                                "points cannot run side by side", "sweep.parallelism=1, or cluster=local to run "
                                f"{cfg.sweep.parallelism} points at once"))
    problems += _device(cfg)
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
    if world > c.nodes and world % c.nodes:  # fewer tasks than nodes: the job takes one node per task
        fits = [n for n in range(1, world + 1) if world % n == 0]
        problems.append(Problem("cluster.nodes", c.nodes, f"the train job's {world} tasks (dp*hp*pp) are spread evenly "
                                f"over the nodes: {world} must be divisible by cluster.nodes",
                                f"cluster.nodes= one of {fits}"))
    problems += _contradictions(c)
    unknown = sorted(set(c.time_min) - set(STAGE_TIMES_MIN))
    if unknown:
        problems.append(Problem(f"cluster.time_min.{unknown[0]}", c.time_min[unknown[0]], "time limits are given per "
                                f"stage: {', '.join(STAGE_TIMES_MIN)}", "cluster.time_min.train=120"))
    for stage, minutes in c.time_min.items():
        if not isinstance(minutes, int) or minutes < 1:
            problems.append(Problem(f"cluster.time_min.{stage}", minutes, "a job's time limit is a whole number of "
                                    "minutes >= 1", f"cluster.time_min.{stage}={STAGE_TIMES_MIN.get(stage, 60)}"))
    if not cfg.dry_run and shutil.which("sinfo") and (c.nodes > 1 and world > 1 or c.gpus_per_task):
        problems += _partition(cfg)
    if not cfg.dry_run and not (shutil.which("sbatch") and shutil.which("sacct") and shutil.which("scontrol")):
        problems.append(Problem("cluster", "slurm", "cluster=slurm submits with sbatch, follows jobs with sacct "
                                "(SLURM accounting) and requeues them with scontrol; they are not all on this "
                                "machine's PATH",
                                "run on a SLURM login node, or start the bundled single-node cluster "
                                "(sudo scripts/slurm_cluster.sh start), or cluster=local; dry_run=true prints the "
                                "sbatch scripts without SLURM"))
    return problems


# sbatch parameters the cluster section sets itself: given in cluster.sbatch too, one of the two would be ignored
OWNED = {"nodes": "cluster.nodes", "ntasks": "the layout (dp*hp*pp)", "ntasks_per_node": "the layout (dp*hp*pp)",
         "cpus_per_task": "cluster.cpus_per_task", "mem": "cluster.mem_per_task_gb",
         "mem_per_cpu": "cluster.mem_per_task_gb", "time": "cluster.time_min", "partition": "cluster.partition",
         "account": "cluster.account", "qos": "cluster.qos", "gpus_per_task": "cluster.gpus_per_task",
         "gres": "cluster.gpus_per_task", "gpus": "cluster.gpus_per_task", "signal": "cluster.signal_delay_s",
         "job_name": "the stage's name and key", "dependency": "the DAG (each job waits for its inputs)",
         "output": "cluster.folder", "error": "cluster.folder"}


def _contradictions(c) -> list[Problem]:
    """SLURM keys against each other and against the time limit: each would run, and not as written."""
    problems = []
    if c.mem_per_task_gb == 0:  # None (unset) is the partition's default
        problems.append(Problem("cluster.mem_per_task_gb", c.mem_per_task_gb, "SLURM reads --mem=0 as all the "
                                "memory of each node, not none: every job would hold whole nodes",
                                "cluster.mem_per_task_gb= the GB a task needs (the plan prints it), or leave it "
                                "unset for the partition's default; for whole nodes: cluster.sbatch={exclusive: true}"))
    train_s = 60 * int(c.time_min.get("train", 0) or 0)
    if train_s and c.signal_delay_s >= train_s:
        problems.append(Problem("cluster.signal_delay_s", c.signal_delay_s, f"SLURM signals the train job this long "
                                f"before its time limit ({train_s} s, cluster.time_min.train): the signal would come "
                                "as it starts, and it would checkpoint and requeue without training",
                                f"cluster.signal_delay_s={max(0, min(90, train_s // 4))} (a save's time and some), "
                                "or a longer cluster.time_min.train"))
    if c.threads_per_rank and c.cpus_per_task and c.threads_per_rank > c.cpus_per_task:
        problems.append(Problem("cluster.threads_per_rank", c.threads_per_rank, f"each rank would run "
                                f"{c.threads_per_rank} threads on the {c.cpus_per_task} CPUs SLURM gives its task "
                                "(cluster.cpus_per_task): they would share cores and run slower than fewer",
                                f"cluster.threads_per_rank={c.cpus_per_task}, or "
                                f"cluster.cpus_per_task={c.threads_per_rank}"))
    for name in sorted(c.sbatch):
        owner = OWNED.get(str(name).replace("-", "_"))
        if owner:
            problems.append(Problem(f"cluster.sbatch.{name}", c.sbatch[name], f"sbatch's {name} is set by "
                                    f"{owner}; given here too, one of the two would be ignored",
                                    f"remove cluster.sbatch.{name}" + (f" and set {owner}" if owner.startswith(
                                        "cluster.") else "")))
    return problems


def _partition(cfg) -> list[Problem]:
    """What a multi-node or GPU job needs of the partition, asked of SLURM before submitting: enough nodes up (a
    job for more waits for ever), a first node whose name does not resolve to loopback (the ranks meet at a
    rendezvous on the job's first node: 127.x reaches only itself, the most reported multi-node failure), and GPUs
    where cluster.gpus_per_task asks for them."""
    import socket

    from orchestrator.cluster import slurm_queue

    c = cfg.cluster
    partition = c.partition or slurm_queue.default_partition()
    nodes = slurm_queue.partition_nodes(partition)
    up = [name for name, state, _ in nodes if state in slurm_queue.UP_STATES]
    problems = []
    if c.nodes > 1 and len(up) < c.nodes:
        problems.append(Problem("cluster.nodes", c.nodes, f"partition {partition} has {len(up)} node(s) up of "
                                f"{len(nodes)} (sinfo): a job on {c.nodes} nodes would wait until more are",
                                f"cluster.nodes={max(len(up), 1)}, with a layout whose ranks it divides (a lost node: "
                                "the same command continues from the last checkpoint), or another "
                                "cluster.partition"))
    if c.nodes > 1 and up:
        try:
            address = socket.gethostbyname(up[0])
        except OSError as e:
            address = f"nothing ({e})"
        if not address[0].isdigit() or address.startswith("127."):
            problems.append(Problem("cluster.nodes", c.nodes, f"the ranks of a multi-node job meet at a rendezvous "
                                    f"on its first node, and node {up[0]} resolves to {address} here (a loopback "
                                    "address reaches only itself: the other nodes' ranks would wait for ever)",
                                    f"make {up[0]} resolve to an address the other nodes reach (/etc/hosts or DNS), "
                                    "or cluster.nodes=1"))
    if c.gpus_per_task and not any("gpu" in gres for _, _, gres in nodes):
        problems.append(Problem("cluster.gpus_per_task", c.gpus_per_task, f"partition {partition} has no GPUs "
                                f"(sinfo's generic resources: {', '.join(sorted({g for _, _, g in nodes})) or 'none'})",
                                "cluster.gpus_per_task=0, or cluster.partition= a partition with GPUs"))
    return problems


def _device(cfg) -> list[Problem]:
    """cluster.device: a known device or a memory in GiB; on this machine (local, debug) only for a plan, since the
    ranks of a run here hold what this machine has, which the plan measures itself."""
    from planning.devices import DEVICES, device_of

    c = cfg.cluster
    value = c.get("device")
    if value is None:
        return []
    if device_of(value) is None:
        return [Problem("cluster.device", value, f"a device the plan knows ({', '.join(DEVICES)}) or its memory in "
                        "GiB, a positive number", "cluster.device=h100_80gb, or cluster.device=24 for a 24 GiB one")]
    if c.name != "slurm" and not cfg.dry_run:
        return [Problem("cluster.device", value, f"a run on cluster={c.name} gets this machine's memory, which the "
                        "plan measures; a declared device is for the plan of a run elsewhere",
                        "dry_run=true to plan for it here, or cluster=slurm to run on it")]
    return []
