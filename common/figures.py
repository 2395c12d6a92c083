"""Pictures written to files (a train stage's loss curve and pipeline timeline, a sweep's and a tune's charts):
matplotlib's pyplot on its file-only backend, Agg, chosen before pyplot is imported so that no GUI toolkit is
probed on a cluster node. Importing it costs 0.9-1.1 s of CPU (measured on the 2-core VM); the local fork server
preloads this module (orchestrator/cluster/fork_server.py), so a rank that draws starts with it imported.
Callers import it where they draw, so that a module that only may draw does not pay for it."""
import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402  (the backend is chosen first)

__all__ = ["plt"]
