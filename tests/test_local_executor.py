"""The local executor's bookkeeping, with stand-in ranks (the real processes are in test_layouts and test_cli_e2e)."""
from __future__ import annotations

import signal
import time

from orchestrator.cluster.local import LocalExecutor


class _ExitsAt:
    """A stand-in rank that exits with `code` on its `polls`-th poll."""

    def __init__(self, code, polls):
        self.code, self.polls = code, polls

    def poll(self):
        self.polls -= 1
        return self.code if self.polls <= 0 else None

    def kill(self):
        if self.polls > 0:
            self.code, self.polls = -signal.SIGKILL, 0

    def wait(self, timeout=None):
        return self.code


def test_a_rank_killed_by_a_signal_is_named_even_when_its_peer_is_seen_failing_first():
    executor = LocalExecutor(poll_s=0.001, grace_s=1.0)
    # rank 0 fails in its next collective ("Connection reset by peer") and is polled first; rank 1 was SIGKILLed
    failure = executor._wait([_ExitsAt(1, polls=1), _ExitsAt(-signal.SIGKILL, polls=3)], 60, time.perf_counter())
    assert failure == (1, "killed by signal SIGKILL")
    # without a signal, the first failure seen is the one named
    assert executor._wait([_ExitsAt(0, 5), _ExitsAt(3, 1)], 60, time.perf_counter()) == (1, "exit code 3")
