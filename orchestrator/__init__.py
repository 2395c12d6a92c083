"""Declarative orchestrator for distributed training experiments: `python -m orchestrator`; `orchestrator.load(run
folder)` gives back a run's trained model.

Three rooms, imports pointing down (and never from `stages` or `plugins` back up to here):

- `config/`   the config language: the schema (a dataclass per section), validation before launch, the
              errors users read, the key reference (docs/configuration.md). Imports nothing else of `orchestrator`.
- the core    (this folder) `dag` plans stages and their content keys, `cache` stores their outputs,
              `tracking` talks to MLflow, `report` prints plans and outcomes, `worker` runs one stage on one
              rank; `run` conducts one invocation, `sweep` a `-m` sweep, `__main__` is the Hydra entry.
              `follow` is only the `python -m orchestrator.follow` command.
- `cluster/`  where stages run: local processes, this process (debug), or SLURM jobs (submission, the job's
              entry point, the queue, following). Imports the core below `run`, and `config`; `run` and
              `sweep` import it.
"""


def load(path, optimizer: bool = False):
    """The trained model of a run folder (or aggregate output); see orchestrator/loading.py."""
    from orchestrator.loading import load as load_run

    return load_run(path, optimizer)
