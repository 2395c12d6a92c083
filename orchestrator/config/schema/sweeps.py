"""Searches over runs: a layout tune (`tune`) and a sweep's points (`sweep`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

from orchestrator.config.schema.keys import key, PP_SCHEDULES, LAYOUT_TUNING
from plugins.objectives.spec import sweep_objectives


@dataclass
class TuneConfig:
    name: str = key("none", "none: run the experiment; layout: try the layouts of tune.world_size ranks for a few "
                            "steps each, rank them and print the command that trains with the best",
                    choices=("none", "layout"), content=False)
    world_size: int = key(1, "tune=layout: the ranks to lay out (dp*hp*pp)", min=1, content=False,
                          read_when=LAYOUT_TUNING)
    steps: int = key(5, "tune=layout: timed training steps per layout (the first steps of a run are warm-up)", min=4,
                     content=False, read_when=LAYOUT_TUNING)
    pp_schedules: List[str] = key(["1f1b"], "tune=layout: the pipeline schedules tried for each layout with pp > 1 "
                                            "(interleaved_1f1b, looped_bfs, interleaved_zb and zbv with 2 model "
                                            "chunks per rank)", content=False, choices=PP_SCHEDULES,
                                  read_when=LAYOUT_TUNING)
    microbatches_per_stage: List[int] = key([2], "tune=layout: pipeline microbatches per stage tried for each "
                                                 "layout with pp > 1 (parallel.microbatches = this x pp; more: a "
                                                 "smaller bubble, smaller matmuls)", content=False, min=1,
                                            read_when=LAYOUT_TUNING)
    objective: str = key("tokens_per_s", "tune=layout: what ranks the layouts: tokens_per_s (fastest first) or memory "
                                         "(smallest peak per rank first)", choices=("tokens_per_s", "memory"),
                         content=False, read_when=LAYOUT_TUNING)


TRAIN_OBJECTIVES = ("eval_loss", "loss", "tokens_per_s", "peak_memory",  # sweep.objective from the train stage
                    *sweep_objectives())  # and what the objectives offer (the held-out pairs' rewards, maximised)


@dataclass
class SweepConfig:
    parallelism: int = key(1, "-m sweeps on local/debug clusters: points run at once (SLURM runs all points at "
                              "once; its scheduler queues what does not fit)", content=False, min=1)
    max_points: int = key(256, "-m sweeps: the most points a sweep may have (every one is validated before the first "
                               "starts, about 0.2 s each); an optimising sweeper's search space larger than this has "
                               "each value validated alone", content=False, min=1, max=10**7)
    objective: str = key("eval_loss", "what a point returns to Hydra's sweeper (Optuna, Nevergrad, Ax optimise it) and "
                                      "what ranks the sweep's summary: eval_loss, loss (final train loss), tokens_per_s, "
                                      "peak_memory (MB, the worst rank's), what the objective offers (eval_reward_accuracy or "
                                      "eval_reward_margin: the held-out pairs' of dpo, simpo, orpo), or <task>/<metric>: a score of the "
                                      "evaluate stage (e.g. arith_mc/acc, a task in evaluate.tasks; its direction the "
                                      "task's)", content=False)
