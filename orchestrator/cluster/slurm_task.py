"""What runs inside a SLURM job: one stage on one task (rank), submitted by orchestrator.cluster.slurm_submit.

Rank and world come from SLURM (submitit's JobEnvironment), the torch rendezvous from the job's first node.
The train stage stops at a step boundary on SLURM's signal (time limit near, or preemption), saves a
checkpoint and the job is requeued; the next attempt resumes from it and logs into the same MLflow run.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import submitit
from submitit.helpers import TorchDistributedEnvironment

from orchestrator.cluster.slurm_queue import release
from orchestrator.worker import execute
from runtime import preemption

REQUEUE_TAG = "slurm.requeues"


class StageJob(submitit.helpers.Checkpointable):
    """`StageJob(spec_path, max_requeues)()` runs the stage the spec describes, on this task's rank.

    A Checkpointable, so that a stage other than train, signalled by SLURM, is requeued by submitit as it is
    (it restarts). The train stage replaces submitit's signal handler with its own: a signal mid-step must not
    interrupt the ranks' collectives, so every rank finishes the step, they save together, then rank 0 requeues.
    """

    def __init__(self, spec_path: str, max_requeues: int):
        self.spec_path, self.max_requeues = spec_path, max_requeues

    def __call__(self) -> dict:
        env = submitit.JobEnvironment()
        rank, world = env.global_rank, env.num_tasks
        if world > 1:
            TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        spec = json.loads(Path(self.spec_path).read_text())
        restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
        if rank == 0 and restarts:
            _record_requeue(spec, restarts)
        if spec["stage"] == "train":
            preemption.watch()
        try:
            execute(spec, rank, world)
        except preemption.Preempted as e:
            if restarts >= self.max_requeues:
                raise RuntimeError(f"{e}; not requeued: the job was already requeued {restarts} time(s) "
                                   f"(cluster.max_requeues={self.max_requeues}). Run the same command again "
                                   "to continue from that checkpoint, or raise cluster.max_requeues / "
                                   "cluster.time_min.train") from e
            if rank == 0:
                requeue(env.job_id)
            time.sleep(600)  # SLURM stops every task of a requeued job; we only wait for it
            raise RuntimeError(f"job {env.job_id} was requeued but not stopped by SLURM") from e
        return {"rank": rank, "stage": spec["stage"], "restarts": restarts}


def requeue(job_id: str) -> None:
    """Put the job back in the queue now (its next attempt resumes from the checkpoint just saved).
    A requeued job is held until its begin time (~2 min later): release it at once."""
    subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=60)
    release(job_id)


def _record_requeue(spec: dict, restarts: int) -> None:
    from orchestrator.tracking.stage_tracker import stage_tracker

    tracker = stage_tracker(spec, 0)
    tracker.set_tags({REQUEUE_TAG: restarts})
    tracker.log_metrics({"requeues": restarts}, step=restarts)
    tracker.flush()
