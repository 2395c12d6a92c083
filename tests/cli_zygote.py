"""`python -m orchestrator` for the tests, forked from a process that has imported it already.

A fresh command spends 3-4 s of CPU importing torch, Hydra and the planning before it reads its first override,
and its fork server as much again importing what the ranks use (torch._dynamo, ONNX Runtime, matplotlib, the
stages): on the 2-core VM the suite's few hundred commands paid over half an hour of CPU for imports alone. This
process imports all of that once per pytest worker, then forks one command per request. The child becomes what
`python -m orchestrator args` started in that folder would be: its own session (its process group is its pid), its
working folder and environment, its stdout and stderr on the files the test names, its argv, then orchestrator's
`__main__` run as the main module (which ends the process with its exit status). The fork server that the command
starts is then forked from it in turn (orchestrator/cluster/fork_server.py), with nothing left to import.

The commands' behaviour is the same: only the interpreter's start is shared. Tests that check a start itself (the
install, the README's commands as pasted) run a fresh interpreter.

Protocol, one JSON object a line: requests on stdin {"argv", "cwd", "env", "stdout", "stderr"},
answers on stdout {"pid"} in the order of the requests, then {"exited": pid, "code": exit code, or -signal} as
each child ends (this process reaps them: they are its children)."""
from __future__ import annotations

import importlib
import json
import os
import random
import runpy
import selectors
import signal
import sys

# the answers go to the test on a copy of stdout; what imports or children print reaches stderr
ANSWERS = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)

import orchestrator.__main__  # noqa: E402, F401 (what the command imports)
from orchestrator.cluster.fork_server import PIPELINE_PRELOAD, PRELOAD  # noqa: E402

# and what its fork server would import, but the module whose import makes a process the server (SIGTERM ignored)
for name in PRELOAD + PIPELINE_PRELOAD:
    if name != "orchestrator.cluster.fork_server_preload":
        importlib.import_module(name)


def _child(request: dict) -> None:
    os.setsid()
    for sig in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as a fresh interpreter's (a terminal's Ctrl-C)
    signal.set_wakeup_fd(-1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), 1)
    os.dup2(os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), 2)
    for fd in [int(name) for name in os.listdir("/proc/self/fd")]:  # the control pipes, the copies just made
        if fd > 2:
            try:
                os.close(fd)
            except OSError:
                pass
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    random.seed()
    sys.argv = [str(orchestrator.__main__.__file__), *request["argv"]]
    sys.modules.pop("orchestrator.__main__")  # run afresh as __main__, as `python -m` runs it
    runpy.run_module("orchestrator", run_name="__main__", alter_sys=True)  # ends the process (exit_now)
    os._exit(0)


def main() -> None:
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the selector through the pipe
    selector = selectors.DefaultSelector()
    selector.register(0, selectors.EVENT_READ)
    selector.register(read_end, selectors.EVENT_READ)
    pending = b""

    def say(message: dict) -> None:
        ANSWERS.write(json.dumps(message) + "\n")

    while True:
        for key, _ in selector.select():
            if key.fileobj == 0:
                chunk = os.read(0, 65536)
                if not chunk:  # the tests are done
                    return
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    pid = os.fork()
                    if pid == 0:
                        try:
                            _child(json.loads(line))
                        finally:
                            os._exit(70)
                    say({"pid": pid})
            else:
                try:
                    os.read(read_end, 4096)
                except BlockingIOError:
                    pass
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            say({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    main()
