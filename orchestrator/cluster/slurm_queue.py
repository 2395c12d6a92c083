"""SLURM's queue as the orchestrator sees it: the records of submitted stages, and the few commands that ask
SLURM about jobs or act on them (squeue/sacct, scontrol, scancel). Submission, the job's own entry point and
following all use this; it uses none of them.
"""
from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from typing import Optional

JOBS_FILE = "slurm_jobs.json"     # in the run folder: what `orchestrator.follow` follows
JOB_RECORD = "slurm_job.json"     # in a stage's cache workspace: the job computing that key
ACTIVE_STATES = {"PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "COMPLETING",
                 "RESIZING", "SUSPENDED", "SIGNALING", "STAGE_OUT", "STOPPED"}


@dataclass
class SubmittedStage:
    stage: str
    key: str
    job_id: str
    folder: str                    # submitit's folder of that job (logs, results)
    tasks: int
    after: list[str] = field(default_factory=list)   # job ids it waits for (afterok)
    run_id: Optional[str] = None   # this invocation's MLflow run of the stage
    shared: bool = False           # submitted by another invocation / sweep point: followed, not owned


def job_states(job_ids: list[str]) -> dict[str, tuple[str, str, str]]:
    """job id -> (state, reason, time used): squeue for the jobs SLURM still holds, sacct for older ones."""
    found: dict[str, tuple[str, str, str]] = {}
    if not job_ids:
        return found
    q = subprocess.run(["squeue", "-h", "--states=all", "-j", ",".join(job_ids), "-o", "%i|%T|%r|%M"],
                       capture_output=True, text=True, timeout=60)
    for line in q.stdout.splitlines():
        parts = line.split("|")
        if len(parts) == 4:
            found[parts[0]] = (parts[1], parts[2], parts[3])
    missing = [j for j in job_ids if j not in found]
    if missing:
        a = subprocess.run(["sacct", "-X", "-n", "-P", "-j", ",".join(missing), "-o", "JobIDRaw,State,Elapsed"],
                           capture_output=True, text=True, timeout=60)
        for line in a.stdout.splitlines():
            parts = line.split("|")
            if len(parts) == 3 and parts[0] in missing:
                found[parts[0]] = (parts[1].split()[0], "", parts[2])  # "CANCELLED by 0" -> CANCELLED
    return found


def is_active(job_id: str) -> bool:
    """SLURM still has the job queued or running."""
    return job_states([job_id]).get(job_id, ("UNKNOWN",))[0] in ACTIVE_STATES


def release(job_id: str) -> None:
    """A requeued job is held until its begin time (~2 min later): nothing is gained by waiting."""
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], capture_output=True, timeout=60)


def cancel(job_ids: list[str]) -> None:
    if job_ids:
        subprocess.run(["scancel", *job_ids], capture_output=True, timeout=60)


def hostnames(nodelist: str) -> list[str]:
    """slnode[1-2] -> [slnode1, slnode2] (SLURM's own expansion)."""
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=60)
    return out.stdout.split()


def default_partition() -> Optional[str]:
    """The partition a job without --partition goes to (sinfo marks it with *)."""
    names = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=60).stdout.split()
    return next((p.rstrip("*") for p in names if p.endswith("*")), None)


def partition_nodes(partition: Optional[str]) -> list[tuple[str, str, str]]:
    """(node, state, gres) of every node of the partition (of every partition when None), as sinfo reports them."""
    args = ["sinfo", "-h", "-N", "-o", "%N|%t|%G"] + (["-p", partition] if partition else [])
    out = subprocess.run(args, capture_output=True, text=True, timeout=60).stdout
    return sorted({tuple(line.split("|")) for line in out.splitlines() if line.count("|") == 2})


UP_STATES = ("idle", "mix", "alloc", "comp")  # sinfo's short states of a node that runs jobs (no * suffix)


def lost_nodes(job_id: str) -> Optional[tuple[list[str], list[str]]]:
    """(the nodes that are down now, every node of the attempt) for a job whose last attempt ended in NODE_FAIL;
    None when none did."""
    out = subprocess.run(["sacct", "-D", "-X", "-n", "-P", "-j", job_id, "-o", "State,NodeList"],
                         capture_output=True, text=True, timeout=60).stdout
    failed = [line.split("|")[1] for line in out.splitlines() if line.startswith("NODE_FAIL|")]
    if not failed:
        return None
    nodes = hostnames(failed[-1])
    up = {n for n, state, _ in partition_nodes(None) if state in UP_STATES}
    return [n for n in nodes if n not in up], nodes
