"""Submit a plan's stages as SLURM jobs with submitit: one job per stage, its own resources, chained with
`afterok`, all submitted at once. Cached stages are not submitted; a stage whose key another invocation (or
another point of this sweep) has already submitted and that is still queued or running is not submitted
again: this plan depends on that job.

If sbatch refuses a job (unknown partition, too many CPUs, impossible memory), the jobs this invocation
submitted before it are cancelled and the refusal is reported with the config key to change.
"""
from __future__ import annotations

import subprocess
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig

from orchestrator.cache import resume
from orchestrator.cache.store import Cache
from orchestrator.cluster.slurm_queue import JOB_RECORD, JOBS_FILE, SubmittedStage, cancel, is_active
from orchestrator.dag import PlannedStage
from orchestrator.config.errors import ConfigError, Problem
from orchestrator.cluster.launch import Launch, write_spec
from orchestrator.tracking.tracker import Invocation, config_params
from storage.fsio import atomic_write_json, read_json


class SlurmView:
    """How the plan table and dry runs describe a stage's job."""

    name = "slurm"

    def __init__(self, cluster: DictConfig):
        self.cluster = cluster

    def describe(self, launch: Launch) -> str:
        tasks = launch.planned.resources.tasks
        nodes = job_nodes(self.cluster.nodes, tasks)
        where = f" on {self.cluster.partition}" if self.cluster.partition else ""
        return f"slurm job{where}, {tasks} task{'s' if tasks > 1 else ''}" + (f", {nodes} nodes" if nodes > 1 else "")

    def prepare(self, tracking: bool, pipeline: bool = False) -> None:
        """Nothing to start ahead: each job starts its own Python on its node."""

    def command(self, launch: Launch) -> str:
        """The sbatch script submitit would submit (dependencies are known only at submission)."""
        import sys

        from submitit.slurm.slurm import _make_sbatch_string

        folder = Path(self.cluster.folder or launch.log_dir.parents[1] / "submitit") / "%j"
        params = sbatch_parameters(self.cluster, launch.planned, [])
        script = _make_sbatch_string(command=f"{sys.executable} -u -m submitit.core._submit {folder}",
                                     folder=folder, **params)
        return "\n" + script


def cpus_per_task(c: DictConfig) -> int:
    """CPUs SLURM gives each task (rank), which is also the rank's torch threads."""
    return c.cpus_per_task or c.threads_per_rank or 1


def job_nodes(nodes: int, tasks: int) -> int:
    """The nodes a job of `tasks` spreads over evenly: cluster.nodes, or the most of them that divides the tasks
    (the train job's tasks are checked to fit before launch; a tokenize job of 3 tasks on 2 nodes takes 1)."""
    return max(n for n in range(1, min(nodes, tasks) + 1) if tasks % n == 0)


def sbatch_parameters(c: DictConfig, ps: PlannedStage, after: list[str]) -> dict:
    """submitit SlurmExecutor parameters of one stage's job (c: the cluster section)."""
    tasks = ps.resources.tasks
    nodes = job_nodes(c.nodes, tasks)
    per_node = tasks // nodes
    cpus = cpus_per_task(c)
    params = {"job_name": f"{ps.name}-{ps.key[:8]}", "time": int(c.time_min.get(ps.name, 60)), "nodes": nodes,
              "ntasks_per_node": per_node, "cpus_per_task": cpus, "signal_delay_s": c.signal_delay_s,
              "stderr_to_stdout": True, "setup": list(c.setup),
              "additional_parameters": {"kill_on_invalid_dep": "yes", **dict(c.sbatch)}}
    for name, value in (("partition", c.partition), ("account", c.account), ("qos", c.qos)):
        if value:
            params[name] = value
    if c.gpus_per_task:
        params["gpus_per_task"] = c.gpus_per_task
    if c.mem_per_task_gb:
        params["mem"] = f"{int(c.mem_per_task_gb * 1024 * per_node)}M"
    if after:
        params["dependency"] = "afterok:" + ":".join(after)
    return params


def submit_plan(cfg: DictConfig, plan: list[PlannedStage], launches: dict[str, Launch], cache: Cache,
                run_dir: Path, tracking: Optional[Invocation]) -> list[SubmittedStage]:
    """Submit every stage that is neither cached nor already in the queue; write run_dir/slurm_jobs.json."""
    import submitit

    from orchestrator.cluster.slurm_task import StageJob

    folder = Path(cfg.cluster.folder or run_dir / "submitit").resolve()
    job_of: dict[str, str] = {}
    submitted: list[SubmittedStage] = []
    cached: list[str] = []
    start_job = _queued_start(cfg, cache)
    try:
        for ps in plan:
            if cache.is_complete(ps.name, ps.key):  # cached when planned, or finished since
                if tracking:
                    tracking.record_cached(ps.name, ps.key, cache.record(ps.name, ps.key).get("mlflow_run_id", ""))
                cached.append(ps.name)
                continue
            after = [job_of[u] for u in ps.stage.after if u in job_of] + ([start_job] if ps.stage.starts and
                                                                          start_job else [])
            with cache.lock(ps.name, ps.key):
                record_path = cache.work(ps.name, ps.key) / JOB_RECORD
                queued = read_json(record_path) if record_path.is_file() else None
                if queued and is_active(queued["job_id"]):
                    run_id = tracking.start_stage(ps.name, ps.key, config_params(cfg, ps.stage.reads), {
                        "orchestrator.status": "shared", "slurm.job_id": queued["job_id"]}) if tracking else None
                    s = SubmittedStage(ps.name, ps.key, queued["job_id"], queued["folder"], ps.resources.tasks,
                                       after, run_id, shared=True)
                else:
                    s = _submit_stage(cfg, ps, launches[ps.name], cache, folder, after, tracking, submitit, StageJob)
                    atomic_write_json(record_path, {"job_id": s.job_id, "folder": s.folder, "run_dir": str(run_dir)})
            job_of[ps.name] = s.job_id
            submitted.append(s)
    except BaseException as e:
        mine = [s for s in submitted if not s.shared]
        cancel([s.job_id for s in mine])
        if tracking:
            for s in submitted:
                tracking.end_run(s.run_id, "KILLED", tags={"orchestrator.status": "cancelled"})
            tracking.end_run(tracking.parent, "FAILED", tags={"orchestrator.status": "rejected"})
        if isinstance(e, submitit.core.utils.FailedJobError):
            raise ConfigError([_rejection(cfg, ps, str(e))]) from None
        raise
    atomic_write_json(run_dir / JOBS_FILE, {
        "stages": [asdict(s) for s in submitted], "cached": cached,
        "keys": {ps.name: ps.key for ps in plan}, "order": [ps.name for ps in plan], "cache_root": str(cache.root),
        "tracking": {"uri": cfg.tracking.uri, "parent": tracking.parent} if tracking else None,
        "poll_s": cfg.cluster.poll_s})
    return submitted


def _queued_start(cfg: DictConfig, cache: Cache) -> Optional[str]:
    """The job in the queue that writes the weights train.init_from names (an experiment's earlier phase's aggregate,
    submitted just before: orchestrator/phases.py), which the stages that read them wait on; None: none queued."""
    from storage import hf
    from storage.init_from import in_entry

    entry = in_entry(hf.folder_of(cfg.train.init_from) or cfg.train.init_from, str(cache.root))
    if not entry:
        return None
    stage, key = entry.split("/")[:2]
    record_path = cache.work(stage, key) / JOB_RECORD
    if cache.is_complete(stage, key) or not record_path.is_file():
        return None
    job_id = read_json(record_path)["job_id"]
    return job_id if is_active(job_id) else None


def _submit_stage(cfg, ps: PlannedStage, launch: Launch, cache: Cache, folder: Path, after: list[str],
                  tracking: Optional[Invocation], submitit, StageJob) -> SubmittedStage:
    resume.begin(cfg, cache, ps)
    run_id = launch.open_run(tracking, cfg, "submitted", closes_itself=True)
    launch.spec["threads"] = cpus_per_task(cfg.cluster)
    launch.spec["interactive"] = False
    write_spec(launch.spec_path, launch.spec)
    executor = submitit.SlurmExecutor(folder=folder / "%j", max_num_timeout=cfg.cluster.max_requeues)
    executor.update_parameters(**sbatch_parameters(cfg.cluster, ps, after))
    try:
        job = executor.submit(StageJob(str(launch.spec_path), cfg.cluster.max_requeues))
    except BaseException:
        if tracking:
            tracking.end_run(run_id, "KILLED", tags={"orchestrator.status": "rejected"})
        raise
    if tracking:
        tracking.client.set_tag(run_id, "slurm.job_id", job.job_id)
    return SubmittedStage(ps.name, ps.key, job.job_id, str(folder / job.job_id), ps.resources.tasks, after, run_id)


# -- a refused submission, in config terms ------------------------------------------------------------------------

def _rejection(cfg: DictConfig, ps: PlannedStage, message: str) -> Problem:
    text = " ".join(line.replace("sbatch: error:", "").strip() for line in message.splitlines() if line.strip())
    low = text.lower()
    c = cfg.cluster
    tasks = ps.resources.tasks
    job = sbatch_parameters(c, ps, [])
    per_node, cpus = job["ntasks_per_node"], job["cpus_per_task"]
    capacity = _node_capacity()
    if "account" in low:
        return Problem("cluster.account", c.account, f"SLURM refused the {ps.name} job: {text}",
                       "an account you belong to (`sacctmgr show assoc user=$USER`), or null")
    if "qos" in low:
        return Problem("cluster.qos", c.qos, f"SLURM refused the {ps.name} job: {text}",
                       "a QOS your account may use (`sacctmgr show qos`), or null")
    if "partition" in low:
        return Problem("cluster.partition", c.partition, f"SLURM refused the {ps.name} job: {text}",
                       f"a partition listed by `sinfo -s`{_known(capacity, 'partitions')}, or null for the default")
    if "time limit" in low:
        return Problem(f"cluster.time_min.{ps.name}", c.time_min.get(ps.name), f"SLURM refused the {ps.name} job: "
                       f"{text}", "a time within the partition's limit (`sinfo -o '%P %l'`)")
    if "memory" in low:
        most = capacity.get("mem_mb")
        fix = f"cluster.mem_per_task_gb={most / 1024 / per_node:.1f} or less" if most else "less memory per task"
        return Problem("cluster.mem_per_task_gb", c.mem_per_task_gb, f"SLURM refused the {ps.name} job ({per_node} "
                       f"task(s) per node): {text}", fix + " (the node's memory is shared by its tasks), or null")
    if "node count" in low:
        return Problem("cluster.nodes", c.nodes, f"SLURM refused the {ps.name} job: {text}",
                       f"cluster.nodes={capacity.get('nodes', 1)} or fewer (the partition's nodes)")
    if "gres" in low or (c.gpus_per_task and "configuration" in low):
        return Problem("cluster.gpus_per_task", c.gpus_per_task, f"SLURM refused the {ps.name} job: {text}",
                       "cluster.gpus_per_task=0 on a partition without GPUs, or a GPU partition")
    most_cpus = capacity.get("cpus")
    if cpus > 1:
        fix = f"cluster.cpus_per_task={max(1, most_cpus // per_node)}" if most_cpus else "fewer CPUs per task"
        return Problem("cluster.cpus_per_task", cpus, f"SLURM refused the {ps.name} job: {text} ({per_node} tasks x "
                       f"{cpus} CPUs per node{f'; a node has {most_cpus}' if most_cpus else ''})", fix)
    where = f"{text} ({per_node} tasks per node{f'; a node has {most_cpus} CPUs' if most_cpus else ''})"
    if ps.name == "tokenize":
        fits = max(1, most_cpus // cpus) * job["nodes"] if most_cpus else None
        return Problem("data.tasks", tasks, f"SLURM refused the tokenize job: {where}",
                       f"data.tasks={fits} or fewer" if fits else "fewer data.tasks, or more nodes (cluster.nodes)")
    return Problem("parallel", f"dp*hp*pp={tasks}", f"SLURM refused the {ps.name} job: {where}",
                   "a smaller layout, or spread the ranks over more nodes (cluster.nodes)")


def _node_capacity() -> dict:
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%c|%m|%D|%R"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    rows = [line.split("|") for line in out.splitlines() if line.count("|") == 3]
    if not rows:
        return {}
    return {"cpus": max(int(r[0].rstrip("+")) for r in rows), "mem_mb": max(int(r[1].rstrip("+")) for r in rows),
            "nodes": sum(int(r[2]) for r in rows), "partitions": sorted({r[3] for r in rows})}


def _known(capacity: dict, what: str) -> str:
    return f" (here: {', '.join(capacity[what])})" if capacity.get(what) else ""
