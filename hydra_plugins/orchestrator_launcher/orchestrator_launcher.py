"""Hydra finds launchers only in the `hydra_plugins` namespace: this names the orchestrator's sweep launcher
there (the logic lives in orchestrator/sweeps/launcher.py)."""
from orchestrator.sweeps.launcher import SweepLauncher


class OrchestratorLauncher(SweepLauncher):
    """`-m` sweeps: every point validated first, per-point resources, shared stages, a summary table."""
