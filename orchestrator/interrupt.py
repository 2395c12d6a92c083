"""Ctrl-C and SIGTERM stop a run the same way.

SIGTERM is what `timeout`, systemd, Kubernetes and a login node's cleanup send. Python's default would end the
orchestrator at once (its ranks then die with it, unsaved), so the orchestrator turns SIGTERM into the
KeyboardInterrupt that Ctrl-C raises, remembering which came: the local executor passes the same signal on to
the ranks (the train stage saves a checkpoint at the step it is on), finished stages stay cached, MLflow runs
end KILLED, and the command exits 128 + the signal's number (130 for Ctrl-C, 143 for SIGTERM), as a shell reports
a process that the signal ended. A second signal stops the ranks at once.
"""
from __future__ import annotations

import signal

_received = signal.SIGINT


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C's KeyboardInterrupt would be (every handler of one handles the other)."""


def install() -> None:
    """Turn SIGTERM into Terminated in this process (main thread only, as Python runs signal handlers there)."""
    signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum, frame) -> None:
    global _received
    _received = signal.SIGTERM
    raise Terminated()


def received() -> signal.Signals:
    """The signal that stopped this run: SIGINT unless SIGTERM came."""
    return _received


def exit_code() -> int:
    return 128 + int(_received)


def said() -> str:
    return "Ctrl-C" if _received == signal.SIGINT else _received.name
