"""`python -m orchestrator.follow <run dir> [<run dir> ...]`: follow a run's SLURM jobs until they end.

The command keeps its documented name; the logic lives in orchestrator/cluster/follow.py."""
import sys

from orchestrator.cluster.follow import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
