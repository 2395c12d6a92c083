"""Local ranks forked from a server that has already imported torch and the stages.

A fresh `python -m orchestrator.worker` spends 1-3 s of CPU importing torch, the stage's modules (DCP, ONNX) and
MLflow before it does any work; eight ranks on a small machine wait for eight of those in turn, and a run's five
single-process stages pay it five times. The local executor instead asks one fork server per orchestrator process
(multiprocessing's "forkserver" start method, with those modules preloaded) for each rank: the child starts with
them imported, in well under 0.1 s. The server itself is forked from the orchestrator where that is safe (no thread
started since the imports, MLflow not imported: _forkable), so that it inherits torch, the stages and the planning
instead of importing them again in a fresh interpreter (3-5 s of CPU a run on the 2-core VM).

Forking is safe here because the server only imports: it never runs a torch operation, so no thread pool, CUDA
context or process group exists to be inherited. Each child then becomes what `python -m orchestrator.worker
<spec>` would be: its own session (a terminal's Ctrl-C reaches the orchestrator only), killed when its parent
dies (the server ends with the orchestrator), the rank's environment, stdout and stderr on the file or pipe the
executor gives it, atexit handlers run at the end, the worker's exit status as its own.
"""
from __future__ import annotations

import atexit
import ctypes
import importlib
import multiprocessing
import os
import signal
import sys
import threading
from multiprocessing import reduction
from typing import Optional

from stages import ORDER

# What every rank would import anyway. MLflow only when the run tracks (a stage imports it only then). Three that
# the stages import on first use, measured in the ranks of a dp2_hp2_pp2 run (CPU on the 2-core VM): torch._dynamo,
# which building any torch.optim optimizer imports (0.8-1.1 s in every train rank, 1.4 s in the aggregate stage);
# onnxruntime (export and aggregate check their ONNX models with it: 0.2-0.4 s each); matplotlib (rank 0 draws the
# loss curve: 0.9-1.1 s). Importing them starts no thread.
PRELOAD = ["orchestrator.cluster.fork_server_preload", "torch", "torch.distributed", "torch._dynamo", "onnxruntime",
           "common.figures", "orchestrator.worker", *(f"stages.{name}" for name in ORDER)]
TRACKING_PRELOAD = ["mlflow", "orchestrator.tracking.preload"]
# A pipeline's ranks import torch's pipelining (torch.export and FX with it): 1.1 s of CPU each, eight of them on a
# small machine 4-5 s of the train stage's start. Only when the run has pipeline stages: others would wait for it.
PIPELINE_PRELOAD = ["torch.distributed.pipelining"]

_context: Optional[multiprocessing.context.BaseContext] = None
_lock = threading.Lock()  # sweep points may start stages from several threads (sweep.parallelism)


def context(tracking: bool, pipeline: bool = False) -> multiprocessing.context.BaseContext:
    """The forkserver context, its server preloading PRELOAD (+ MLflow when tracking, + torch's pipelining for a
    pipeline's ranks); started on first use (what the first call asks for is what the server has)."""
    global _context
    with _lock:
        if _context is None:
            _context = multiprocessing.get_context("forkserver")
            _context.set_forkserver_preload(PRELOAD + (TRACKING_PRELOAD if tracking else []) +
                                            (PIPELINE_PRELOAD if pipeline else []))
        return _context


def running() -> bool:
    """The server was started by this process (its imports done or under way: a rank started now waits less)."""
    return _context is not None


def start(tracking: bool, pipeline: bool = False) -> None:
    """Start the server now (it imports in the background; the first rank waits for it only if it has not done).

    Forked from this process where that is safe, so that it inherits what the orchestrator has imported (torch, the
    config, the planning: 3.5 s of CPU on the 2-core VM that a fresh interpreter imports again); else
    multiprocessing starts a fresh one."""
    from multiprocessing import forkserver

    context(tracking, pipeline)
    if _forkable():
        for name in ORDER:  # the orchestrator imports them to plan anyway: imported once, not in both processes
            importlib.import_module(f"stages.{name}")
        _fork_the_server(forkserver._forkserver._preload_modules)
    forkserver.ensure_running()


def _threads() -> int:
    """This process's threads, native ones included (-1: unknown)."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("Threads:"))
    except (OSError, StopIteration, ValueError):
        return -1


# The threads the imports start (OpenBLAS's pool, with numpy: it hands itself over a fork through its atfork handlers)
_IMPORTED_THREADS = _threads()


def _forkable() -> bool:
    """This process may become the server by fork: no thread started since the imports (a thread's locks would be
    held for ever in the copy: Python's, an OpenMP pool that ran torch operations, MLflow's), and no MLflow (its
    open store connections and its at-exit end of the active run must not reach the ranks)."""
    threads = _threads()
    return (threading.active_count() == 1 and 0 < threads <= _IMPORTED_THREADS and "mlflow" not in sys.modules)


def _fork_the_server(preload: list[str]) -> None:
    """What multiprocessing's ForkServer.ensure_running does, with os.fork() in place of a fresh interpreter: the
    listening socket and the "alive" pipe, the server's loop (multiprocessing.forkserver.main) in the child, whose
    other file descriptors are closed as spawning closes them."""
    import socket
    from multiprocessing import connection, forkserver, resource_tracker, util

    server = forkserver._forkserver
    with server._lock:
        if server._forkserver_pid is not None:
            return
        resource_tracker.ensure_running()
        with socket.socket(socket.AF_UNIX) as listener:
            address = connection.arbitrary_address("AF_UNIX")
            listener.bind(address)
            if not util.is_abstract_socket_namespace(address):
                os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                try:
                    _become_the_server(listener.fileno(), alive_r, preload)
                finally:
                    os._exit(0)
            os.close(alive_r)
        server._forkserver_address = address
        server._forkserver_alive_fd = alive_w
        server._forkserver_pid = pid


def _become_the_server(listener_fd: int, alive_r: int, preload: list[str]) -> None:
    from multiprocessing import forkserver

    keep = {0, 1, 2, listener_fd, alive_r}
    for fd in [int(name) for name in os.listdir("/proc/self/fd")]:
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass  # the listing's own descriptor
    for sig in signal.valid_signals():  # the orchestrator's handlers (Ctrl-C, SIGTERM) are not the server's
        if callable(signal.getsignal(sig)):
            signal.signal(sig, signal.SIG_DFL)
    sys.argv = ["-c"]  # as a fresh server's
    forkserver.main(listener_fd, alive_r, preload)


class _Fd:
    """A file descriptor handed to the child: duplicated into it when the process starts (SCM_RIGHTS)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _received, (reduction.DupFd(self.fd),)


def _received(dup) -> int:
    return dup.detach()


def _release_the_server() -> None:
    """Close this child's copy of the server's "alive" pipe. multiprocessing hands every forked child the write
    end (so that it could start processes of its own), and the server exits only at EOF, once no process holds
    it: with ranks holding it, a SIGKILLed orchestrator left the server and so the ranks (whose parent it is)
    running until rank 0's next print hit the closed pipe of its output."""
    from multiprocessing import forkserver

    fd = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)
    if fd is not None:
        os.close(fd)
        forkserver._forkserver._forkserver_alive_fd = None


def _child(spec_path: str, env: dict, out_fd: int, title: str) -> None:
    server = os.getppid()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the server ignores it (fork_server_preload); a rank does not
    os.setsid()
    _release_the_server()
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the server, which ends with the orchestrator
    if os.getppid() != server:  # the server ended before the line above: no signal will come
        os._exit(1)
    libc.prctl(15, title.encode()[:15])  # PR_SET_NAME: ps and top show e.g. "train.rank1", not the server's name
    os.environ.clear()
    os.environ.update(env)
    for std in (1, 2):
        os.dup2(out_fd, std)
    os.close(out_fd)
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.reconfigure(line_buffering=True, write_through=True)
    from orchestrator.worker import main

    try:
        code = main([spec_path])
    finally:
        atexit._run_exitfuncs()  # a multiprocessing child ends with os._exit: run what `python -m` runs at exit
    sys.exit(code)


class RankProcess:
    """One forked rank with the part of subprocess.Popen's interface the local executor uses."""

    def __init__(self, spec_path: str, env: dict, out_fd: int, title: str, tracking: bool):
        self._process = context(tracking).Process(target=_child, args=(spec_path, env, _Fd(out_fd), title),
                                                  name=title)
        self._process.start()
        self.pid = self._process.pid

    def poll(self) -> Optional[int]:
        return self._process.exitcode

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        self._process.join(timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
