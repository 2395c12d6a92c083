"""Ctrl-C and SIGTERM stop a run the same way.

SIGTERM is what `timeout`, systemd, Kubernetes and a login node's cleanup send. Python's default would end the
orchestrator at once (its ranks then die with it, unsaved), so the orchestrator turns SIGTERM into the
KeyboardInterrupt that Ctrl-C raises, remembering which came: the local executor passes the same signal on to
the ranks (the train stage saves a checkpoint at the step it is on), finished stages stay cached, MLflow runs
end KILLED, and the command exits 128 + the signal's number (130 for Ctrl-C, 143 for SIGTERM), as a shell reports
a process that the signal ended. A second signal stops the ranks at once.

Python runs signal handlers in the main thread only. Points of a sweep that run side by side (sweep.parallelism)
wait for their ranks in other threads: they ask `requested()` (and `signals()`, for the second) as they poll, and
take the same path.
"""
from __future__ import annotations

import signal

_received = signal.SIGINT
_count = 0  # signals received so far


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C's KeyboardInterrupt would be (every handler of one handles the other)."""


def install() -> None:
    """Turn SIGTERM into Terminated in this process, and count both signals (main thread only, as Python runs
    signal handlers there)."""
    signal.signal(signal.SIGTERM, _on_signal)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where SIGINT is ignored (`cmd &`)
        signal.signal(signal.SIGINT, _on_signal)


def _on_signal(signum, frame) -> None:
    note(signal.Signals(signum))
    raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def note(sig: signal.Signals) -> None:
    """Count `sig` as received: also where a stage in this process (cluster=debug's train) acted on it itself."""
    global _received, _count
    _received, _count = sig, _count + 1


def requested() -> bool:
    """Whether a signal asked this process to stop (for threads, which Python does not interrupt)."""
    return _count > 0


def signals() -> int:
    return _count


def received() -> signal.Signals:
    """The signal that stopped this run: SIGINT unless SIGTERM came."""
    return _received


def exit_code() -> int:
    return 128 + int(_received)


def said() -> str:
    return "Ctrl-C" if _received == signal.SIGINT else _received.name
