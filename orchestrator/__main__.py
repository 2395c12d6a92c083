"""`python -m orchestrator [overrides]`: compose the experiment with Hydra, then run its DAG.

Configuration mistakes (bad types, unknown keys, missing options, broken cross-field rules) are printed
as key / value / rule / fix and exit with status 2 before anything starts; a failed stage exits with 1.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from orchestrator.errors import ConfigError, from_hydra
from orchestrator.report import EXIT_CODES
from orchestrator.schema import register


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def _experiment(cfg: DictConfig) -> None:
    from orchestrator.run import orchestrate

    hc = HydraConfig.get()
    try:
        EXIT_CODES.append(orchestrate(cfg, Path(hc.runtime.output_dir), list(hc.overrides.task)).exit_code)
    except ConfigError as e:  # reported here, not raised: Hydra would add its own "Error executing job" line
        print(f"error: {e}", file=sys.stderr)
        EXIT_CODES.append(2)


def main() -> int:
    os.environ["HYDRA_FULL_ERROR"] = "1"  # let composition errors reach us: we explain them in config terms
    register()
    try:
        _experiment()
    except ConfigError as e:  # a sweep with invalid points (the launcher checks them all before starting)
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        translated = from_hydra(e, tuple(sys.argv[1:]))
        if translated is None:
            raise
        print(f"error: {translated}", file=sys.stderr)
        return 2
    return max(EXIT_CODES, default=0)


if __name__ == "__main__":
    sys.exit(main())
