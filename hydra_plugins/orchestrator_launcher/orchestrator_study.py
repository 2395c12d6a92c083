"""`hydra/sweeper=optuna`: Hydra's Optuna sweeper with its study kept on disk, so the same command continues it
(the logic lives in orchestrator/sweeps/study.py). Hydra instantiates sweepers only from the `hydra_plugins` namespace.

Its config takes the name `optuna` in Hydra's config store, so `hydra/sweeper=optuna` (the README's, Hydra's docs')
gives this sweeper, with every setting of the plugin's. Hydra's plugin scan runs every plugin module again, in an
order that depends on sys.path, so `store()` is called again once the scan is done (orchestrator/__main__.py).
A config file of that name cannot replace it: Hydra would match it with the stored schema and refuse it."""
from dataclasses import dataclass

from hydra.core.config_store import ConfigStore

try:
    from hydra_plugins.hydra_optuna_sweeper.config import OptunaSweeperConf
    from hydra_plugins.hydra_optuna_sweeper.optuna_sweeper import OptunaSweeper
except ImportError:  # the `.[sweep]` extra is not installed: no Optuna sweeper to keep a study for
    OptunaSweeper = None

if OptunaSweeper is not None:
    class OrchestratorOptunaSweeper(OptunaSweeper):
        def __init__(self, study_dir: str, **settings) -> None:
            super().__init__(**settings)
            self.study_dir = study_dir

        def setup(self, *, hydra_context, task_function, config) -> None:
            super().setup(hydra_context=hydra_context, task_function=task_function, config=config)
            self.config = config

        def sweep(self, arguments):
            from orchestrator.sweeps.study import run_study

            return run_study(self.sweeper, self.config, arguments)

    @dataclass
    class OrchestratorOptunaSweeperConf(OptunaSweeperConf):
        _target_: str = "hydra_plugins.orchestrator_launcher.orchestrator_study.OrchestratorOptunaSweeper"
        study_dir: str = "${runs_dir}/studies"  # where the study is kept (orchestrator/sweeps/study.py)


def store() -> None:
    """Put this sweeper's config in the place of the plugin's `optuna` (nothing when the plugin is not installed)."""
    if OptunaSweeper is not None:
        ConfigStore.instance().store(group="hydra/sweeper", name="optuna", node=OrchestratorOptunaSweeperConf,
                                     provider="orchestrator")


store()
