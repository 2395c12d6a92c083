"""Stop at a step boundary when the scheduler asks: SLURM signals a job (SIGUSR2 by default) before its time
limit or when it is preempted. The signal only sets a flag; the train loop looks at it after each step, all
ranks agree on it (one tiny all-reduce), save a checkpoint together, and raise `Preempted`. Whoever runs the
stage (the SLURM job wrapper) then requeues the job, which resumes from that checkpoint.

Nothing is installed unless a launcher calls `watch()`: SLURM jobs watch SIGUSR2; local train ranks watch SIGINT
and SIGTERM (Ctrl-C or a SIGTERM, passed on by the orchestrator): the first stops at the next step boundary with
a checkpoint, a second Ctrl-C raises KeyboardInterrupt at once (a repeated SIGTERM only asks again: a process
group's SIGTERM may reach a rank directly as well as through the orchestrator).
"""
from __future__ import annotations

import signal
from typing import Optional

_watching = False
_requested: Optional[str] = None


class Preempted(Exception):
    """The stage stopped early on the scheduler's request; its progress is saved in a checkpoint."""

    def __init__(self, step: int, reason: str):
        super().__init__(f"stopped at step {step} on {reason}; progress saved in the checkpoint of step {step}")
        self.step, self.reason = step, reason


def watch(signals: tuple[int, ...] = (signal.SIGUSR2,)) -> None:
    """Turn signals into a stop request (replaces any previous handler of these signals)."""
    global _watching, _requested
    _watching, _requested = True, None
    for sig in signals:
        signal.signal(sig, _on_signal)


def _on_signal(signum, frame) -> None:
    global _requested
    if signum == signal.SIGINT and _requested:
        raise KeyboardInterrupt  # a second Ctrl-C: stop now
    _requested = signal.Signals(signum).name


def request(reason: str) -> None:
    """Ask for a stop as a signal would (used when the job wrapper learns of a preemption another way)."""
    global _requested
    _requested = reason


def control_group(distributed: bool):
    """A CPU (gloo) group for the per-step stop flag: a collective on the GPU's stream would make every step wait
    for the device. None for one process; the default group where it is gloo already."""
    import torch.distributed as dist

    if not distributed or dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo")


def stop_requested(distributed: bool, group=None) -> Optional[str]:
    """The reason to stop now, if any rank was asked to; a collective when several ranks run (all must call).
    `group`: a CPU (gloo) process group for the flag (None: the default group, when that is gloo), so that
    asking never waits for a GPU's queue."""
    if not _watching:
        return None
    if distributed:
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1.0 if _requested else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return (_requested or "a signal to another rank") if flag.item() > 0 else None
    return _requested
