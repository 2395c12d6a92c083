"""Ending a process that imported torch without tearing its modules down.

Python's exit runs the atexit handlers, then frees every module; with torch, ONNX Runtime and MLflow imported the
second part alone takes about 0.4 s here (a process that imported them, measured from its last output to its end).
A command paid it twice: in the orchestrator, then in its fork server, which holds the command's output open until
it ends (a pipe, `| tee`, a test's capture, waits for both). What an exit must do is done first: the threads that
are not daemons joined, the atexit handlers run (logging's flush, multiprocessing's, MLflow's), stdout and stderr
flushed; only the teardown is skipped."""
from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    _flushed_exit(code)


def skip_teardown_at_exit() -> None:
    """For a process whose main loop ends it by raising SystemExit (multiprocessing's fork server, which imports
    this first): an atexit handler that ends it, run after every handler registered later (atexit runs the last
    registered first). Those registered before it do not run: there, multiprocessing's own, which ends the Process
    children the server never has (it forks its ranks itself). A forked child inherits the handler and runs it,
    without effect, with its own atexit handlers."""
    pid = os.getpid()
    atexit.register(lambda: _flushed_exit(0) if os.getpid() == pid else None)


def _flushed_exit(code: int) -> NoReturn:
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe: nothing left to say to it
                pass
    os._exit(code)
