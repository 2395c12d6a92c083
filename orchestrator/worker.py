"""Run one stage on one rank: `python -m orchestrator.worker <spec.json>` (rank and world from the
environment, torchrun's names), or `execute(spec)` in-process for the debug cluster.

The spec is written by the orchestrator: resolved config, input folders, output/scratch folders, log
folder, tracking run. On success rank 0 publishes the output into the cache (so a stage chain also works
without the orchestrator watching, as on SLURM).
"""
from __future__ import annotations

import datetime
import gc
import json
import logging
import os
import select
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

from common.problem import InputFault
from common.quick_exit import exit_now

from orchestrator import interrupt
from orchestrator.cache.store import Cache
from orchestrator.tracking.stage_tracker import stage_tracker
from runtime import preemption
from runtime.preemption import Preempted
from runtime.threads import rank_threads
from stages import get_stage
from stages.base import StageContext

LOG_FORMAT = "%(asctime)s [%(name)s] %(levelname)s %(message)s"
INTERRUPTED = 130  # the exit status of a stage stopped by Ctrl-C (as a shell reports SIGINT)
FAULT_ENV = "ORCHESTRATOR_FAIL_STAGE"  # a stage name: that stage fails at its start (to rehearse recovery)
ORCHESTRATOR_PID_ENV = "ORCHESTRATOR_PID"  # set by the local executor: the process the rank serves


def stage_logger(name: str, log_dir: Path, rank: int, console: bool) -> logging.Logger:
    log = logging.getLogger(f"{name}.rank{rank}")
    log.setLevel(logging.INFO)
    log.propagate = False
    for h in list(log.handlers):
        log.removeHandler(h)
        h.close()
    log_dir.mkdir(parents=True, exist_ok=True)
    fh = logging.FileHandler(log_dir / f"rank{rank}.log", delay=True)  # no empty log for a quiet stage
    fh.setFormatter(logging.Formatter(LOG_FORMAT))
    log.addHandler(fh)
    if console:
        sh = logging.StreamHandler(sys.stdout)
        sh.setFormatter(logging.Formatter(f"[{name}] %(message)s"))
        log.addHandler(sh)
    return log


HEARTBEAT_S = 2.0  # a rank touches log_dir/rank<N>.heartbeat this often, from a thread of its own


def heartbeat_path(log_dir: Path, rank: int) -> Path:
    return Path(log_dir) / f"rank{rank}.heartbeat"


def _beat(path: Path, orchestrator: Optional[int] = None) -> None:
    """Touch the heartbeat file for as long as the process lives: a rank blocked in a collective still beats; a
    frozen, stopped or dead one does not (the local executor names it).

    And end this rank once the orchestrator process that started it is gone. PR_SET_PDEATHSIG ties a rank to its
    parent, which for a forked rank is the fork server, not the orchestrator: that link rests on the server seeing
    the orchestrator go (fork_server._release_the_server). Watching the orchestrator itself does not."""
    gone = _exit_watch(orchestrator)
    while True:
        try:
            path.touch()
        except OSError:
            pass
        if gone is None:
            time.sleep(HEARTBEAT_S)
        elif select.select([gone], [], [], HEARTBEAT_S)[0]:  # a pidfd is readable once its process has exited
            _end_orphan(orchestrator)


def _exit_watch(pid: Optional[int]) -> Optional[int]:
    """A pidfd of `pid` (None: nothing to watch, or a kernel without pidfd_open: PDEATHSIG alone then)."""
    if pid is None:
        return None
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:  # already gone
        _end_orphan(pid)
    except (AttributeError, OSError):
        return None


def _end_orphan(orchestrator: int) -> None:
    try:
        os.write(2, f"orchestrator (pid {orchestrator}) is gone: this rank ends\n".encode())
    except OSError:  # its output was the orchestrator's pipe
        pass
    os.kill(os.getpid(), signal.SIGKILL)  # as PR_SET_PDEATHSIG would: nothing is left to report to


def execute(spec: dict, rank: int = 0, world: int = 1) -> None:
    import torch
    import torch.distributed as dist

    stage = get_stage(spec["stage"])
    log = stage_logger(stage.name, Path(spec["log_dir"]), rank, console=rank == 0)
    if spec.get("heartbeat"):
        orchestrator = os.environ.get(ORCHESTRATOR_PID_ENV)
        threading.Thread(target=_beat, args=(heartbeat_path(spec["log_dir"], rank),
                                             int(orchestrator) if orchestrator else None), daemon=True).start()
    torch.set_num_threads(rank_threads(spec.get("threads"), world))
    if world > 1 and stage.collective and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":  # NCCL binds to the current device: the rank's own, before its first collective
            from plugins.parallel.mesh import pick_device

            pick_device()
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=spec["pg_timeout_s"]))
    tracker = stage_tracker(spec, rank)
    closes_run = bool((spec.get("tracking") or {}).get("end_run"))  # no orchestrator watches (SLURM): close it here
    try:
        if os.environ.get(FAULT_ENV) == stage.name:
            raise RuntimeError(f"injected failure: {FAULT_ENV}={stage.name} (a rehearsal of a crashed stage)")
        ctx = StageContext(cfg=OmegaConf.load(spec["config"]), inputs={k: Path(v) for k, v in spec["inputs"].items()},
                           out=Path(spec["out"]), scratch=Path(spec["scratch"]),
                           aside=Path(spec["aside"]) if spec.get("aside") else None, key=spec["key"],
                           published=Cache(Path(spec["cache_root"])).entry(stage.name, spec["key"]), rank=rank,
                           world_size=world, tracker=tracker, log=log, interactive=bool(spec.get("interactive")))
        # what the imports and the start made (millions of objects with torch imported) leaves the collector's
        # sight: each full collection walked all of it, and DCP's planning of a save, allocating thousands of small
        # objects, set off several per checkpoint (0.25 s each; a 6-step tensor-parallel run's saves took 1.6 s)
        gc.freeze()
        stage.run(ctx)
        tracker.flush()
        if world > 1 and stage.collective:
            dist.barrier()
        if rank == 0:
            Cache(Path(spec["cache_root"])).publish(stage.name, spec["key"], spec["entry_meta"], known=ctx.hashes)
            if closes_run:
                tracker.end("FINISHED")
    except Preempted as e:
        log.warning("stage %s: %s", stage.name, e)
        tracker.flush()
        raise
    except KeyboardInterrupt:
        log.warning("stage %s interrupted on rank %d", stage.name, rank)
        raise
    except BaseException as e:
        if isinstance(e, InputFault):  # the user's input, said in full: no traceback to read past
            log.error("stage %s failed on rank %d: %s", stage.name, rank, e)
        else:
            log.exception("stage %s failed on rank %d", stage.name, rank)
        if rank == 0 and closes_run:
            try:
                tracker.end("FAILED")
            except Exception:  # the tracking store is unreachable: the failure itself matters more
                log.exception("could not mark the MLflow run failed")
        raise
    finally:
        for h in list(log.handlers):
            h.flush()
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m orchestrator.worker <spec.json>", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if spec["stage"] == "train":  # Ctrl-C or SIGTERM (passed on by the orchestrator): save at the next step boundary
        preemption.watch((signal.SIGINT, signal.SIGTERM))
    else:
        interrupt.install()  # stop as on Ctrl-C: the stage's record and logs are closed
    try:
        execute(spec, rank, world)
    except (Preempted, KeyboardInterrupt):
        return INTERRUPTED
    except Exception:
        return 1
    return 0


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))  # common/quick_exit.py
