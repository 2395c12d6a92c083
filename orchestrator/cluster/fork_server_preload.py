"""Imported first by the fork server (fork_server.PRELOAD): the server ignores SIGTERM, as multiprocessing makes it
ignore SIGINT. A SIGTERM to the orchestrator's process group (`timeout`, systemd, `kill -- -PGID`) then reaches
the orchestrator, which stops the ranks as on Ctrl-C; had it ended the server, every rank, whose parent the server
is, would have died with it (PR_SET_PDEATHSIG) before saving. The server still ends with the orchestrator (EOF on
its "alive" pipe). Each rank restores the default at its start (fork_server._child).

It then ends without tearing its modules down (common/quick_exit.py): the command's output stays open until it
ends."""
import signal

from common.quick_exit import skip_teardown_at_exit

signal.signal(signal.SIGTERM, signal.SIG_IGN)
skip_teardown_at_exit()
