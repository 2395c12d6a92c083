"""`python -m orchestrator [overrides]`: compose the experiment with Hydra, then run its DAG.

Configuration mistakes (bad types, unknown keys, missing options, broken cross-field rules, unresolvable values,
a sweep's bad point or search space) are printed as key / value / rule / fix and exit with status 2 before anything
is written (orchestrator/boundary.py); a failed stage exits with 1, and so does an unexpected error, in one line
that names the file holding its traceback.
"""
from __future__ import annotations

import gc
import logging
import os
import sys
from pathlib import Path
from typing import Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.plugins import Plugins
from hydra_plugins.orchestrator_launcher.orchestrator_study import store as store_optuna_sweeper
from omegaconf import DictConfig

from common.quick_exit import exit_now

from orchestrator.boundary import CHECKING, Refused, unexpected
from orchestrator.config.command import explain, task_overrides
from orchestrator.config.errors import ConfigError
from orchestrator import interrupt
from orchestrator.report import EXIT_CODES
from orchestrator.config.schema import register


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def _experiment(cfg: DictConfig) -> Optional[float]:
    """One run; it returns the run's objective (`sweep.objective`) for sweepers run by another launcher (the
    orchestrator's own launcher, orchestrator/sweeps/launcher.py, returns it without calling this)."""
    from orchestrator.sweeps import objective
    from orchestrator.experiment import conduct

    hc = HydraConfig.get()
    try:
        if cfg.tune.name == "layout":
            from orchestrator.sweeps.tune import tune

            EXIT_CODES.append(tune(cfg, Path(hc.runtime.output_dir), task_overrides(hc)))
            return None
        report = conduct(cfg, Path(hc.runtime.output_dir), task_overrides(hc))
        EXIT_CODES.append(report.exit_code)
        return objective.value(cfg.sweep.objective, report.train_summary(cfg), report.scores(cfg), cfg)
    except ConfigError as e:  # reported here, not raised: Hydra would add its own "Error executing job" line
        print(f"error: {e}", file=sys.stderr)
        EXIT_CODES.append(2)
        return None


def main() -> int:
    if any(a in ("--help", "-h") for a in sys.argv[1:]):
        from orchestrator.config.help import help_text

        print(help_text())
        return 0
    logging.getLogger("alembic").setLevel(logging.WARNING)  # Optuna's import: a "setup plugin" line per plugin
    os.environ["HYDRA_FULL_ERROR"] = "1"  # let composition errors reach us: we explain them in config terms
    register()
    Plugins.instance()  # Hydra scans its plugins once, storing their configs; then the Optuna sweeper's is replaced
    store_optuna_sweeper()  # by the one whose study the same command continues (orchestrator/sweeps/study.py)
    interrupt.install()  # SIGTERM takes Ctrl-C's path: save, mark the runs KILLED, say how to continue
    from orchestrator.sweeps.launcher import finish_study

    gc.freeze()  # the imports' objects out of the collector's walks (orchestrator/worker.py says why)

    try:
        _experiment()
        finish_study()
    # The command's check refused it (orchestrator/boundary.py), or a sweep's invalid points (the launcher checks
    # them all first): nothing was started. A signal that came during the check wins over what the check concluded:
    # a library on the way may have swallowed its KeyboardInterrupt (C code that clears errors) and left a half-made
    # config behind.
    except (Refused, ConfigError) as e:
        if interrupt.requested():
            return _stopped_while_checked()
        print(f"error: {e.error if isinstance(e, Refused) else e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a second Ctrl-C (or SIGTERM), or one before any stage started
        finish_study(interrupted=True)
        if CHECKING:  # the command's check was under way: nothing had started
            return _stopped_while_checked()
        print(f"interrupted ({interrupt.said()}): finished stages are cached and checkpoints kept; run the same "
              "command to continue", file=sys.stderr)
        return interrupt.exit_code()
    except Exception as e:  # what Hydra, OmegaConf or a sweeper raised outside the checks, or a bug
        translated = explain(e, tuple(sys.argv[1:]))
        if translated is None:
            print(unexpected(e), file=sys.stderr)
            return 1
        print(f"error: {translated}", file=sys.stderr)
        return 2
    return max(EXIT_CODES, default=0)


def _stopped_while_checked() -> int:
    print(f"interrupted ({interrupt.said()}) while the command was checked: nothing was started", file=sys.stderr)
    return interrupt.exit_code()


if __name__ == "__main__":
    exit_now(main())  # common/quick_exit.py: without the modules' teardown, which every command paid
