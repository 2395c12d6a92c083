"""An objective is a component: one file in plugins/objectives/ registers an ObjectiveSpec that says everything the rest
of the code asks of it (TorchTitan's TrainSpec.loss_fn, NeMo-RL's LossFunction declaring its input and batch keys).
The step and the held-out evaluation ask its loss; the batcher, the train and reference stages, the evaluate stage,
the plan, validation and the sweeps ask the spec of `objective.name`; none of them names an objective. A third-party
package adds one through the `orchestrator.objectives` entry-point group, and its config option (`conf/objective/<name>.yaml`, `defaults:
[<name>_schema]`) takes the spec's config dataclass as its schema.

The loss of an objective with a `loss` (a "rows" objective) is an object the runners call on each microbatch:
  loss(rows, row_inputs) -> the summed loss of the microbatch's examples (rows (R, 2): each row's summed
      log-probability of its learned tokens and their count, from the label-sparse head; row_inputs: the per-row
      inputs it declared, by provider (plugins/objectives/providers.py), (R,) for one, (R, k) columns in their order
      for several; None, or zeros in a pipeline's schedule, when it declared none)
  loss.count(batch, score) -> what the step's loss is a mean over (asked once per global batch, before the rows are
      run: it may keep the batch's totals it normalises by, as TRL's token-mean NLL terms need, or score other rows
      first: score(rows) is each row's summed log-probability under the policy, no gradient, the same on every rank:
      KTO's KL estimate from the batch's mismatched rows)
  loss.names, loss.take(), loss.keep_last(calls): the sums it keeps since the last take (divided by count and
      summed over ranks they are global shares), the last `calls` microbatches' kept (a pipeline's shape inference
      calls the loss on made-up outputs once); loss.means(shares) -> the measures logged, by name (by default the
      shares themselves: means over the count; a measure over part of the examples divides two shares, and one whose
      part is empty is left out, as TRL leaves it out).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from common.keys import key
from common.registry import Registry

SINGLE, PAIR = "single", "pair"  # how rows are grouped: one example a row; a pair's chosen and rejected side by side


NAME_HELP = ("what the train stage minimises: an objective of plugins/objectives/, one file each (sft: next-token "
             "cross-entropy; dpo, simpo, orpo: preference pairs), chosen with objective=<name>")


@dataclass
class ObjectiveConfig:
    """The `objective` section's schema: its name; each objective's own dataclass adds its keys (and sets its name's
    default, with NAME_HELP)."""
    name: str = key("sft", NAME_HELP)


@dataclass(frozen=True)
class ObjectiveSpec:
    config: type                                # its config dataclass (an ObjectiveConfig): the <name>_schema option
    loss: Optional[Callable[[Any], Any]] = None  # cfg.objective -> the runners' loss of per-row log-probabilities;
    #                                             None: next-token cross-entropy of the learned tokens (the head's)
    rows: str = SINGLE                          # SINGLE: one example a row; PAIR: a pair's two rows side by side
    formats: tuple[str, ...] = ("text", "prompt_completion", "chat")  # the data.format its examples are read from
    mismatched: Callable[[Any], bool] = lambda o: False  # cfg.objective -> whether each batch also draws each
    #                                             example's prompt with the previous example's completion
    #                                             (Batch.mismatched: KTO's KL rows)
    row_inputs: tuple[str, ...] = ()            # per-row inputs it needs, by provider ("reference": the reference
    #                                             model's log-probability of each row, plugins/objectives/reference.py)
    rules: Callable[[Any], list] = lambda cfg: []  # its own refusals before launch (cfg -> [Problem])
    describe: Callable[[Any], str] = lambda o: o.name  # cfg.objective -> the plan's words for it
    sweep_objectives: dict = field(default_factory=dict)  # sweep.objective -> (the summary's field, its direction)
    at_reference: Callable[[Any], Optional[float]] = lambda o: None  # cfg.objective -> its held-out loss where the
    #                                             policy is its reference (DPO's log 2): a run not below it learned
    #                                             nothing (None: no such value; its first evaluation is compared)


class RowsLoss:
    """What every loss of rows shares: its measures' sums per microbatch, kept until the step takes them."""

    names: tuple[str, ...] = ()

    def __init__(self):
        self.calls: list = []  # each call's measures' sums since the last take

    def count(self, batch, score=None) -> int:
        """The global batch's examples (what the step's loss is a mean over)."""
        return max(batch.example_count(1), 1)

    def keep_last(self, calls: int) -> None:
        del self.calls[:-calls]

    def means(self, shares: list) -> dict:
        """The measures logged from the global shares of `names` (each its sum over the count)."""
        return dict(zip(self.names, shares))

    def take(self):
        """The measures' sums since the last take (zeros when this rank computed none)."""
        import torch

        calls, self.calls = self.calls, []
        return torch.stack(calls).sum(0) if calls else torch.zeros(len(self.names))


OBJECTIVES: Registry[ObjectiveSpec] = Registry("objective.name", "orchestrator.objectives")


def register_objective(name: str, spec: ObjectiveSpec) -> None:
    OBJECTIVES.register(name, spec)


def get_objective(name: str) -> ObjectiveSpec:
    return OBJECTIVES.get(name)


def objective_names() -> list[str]:
    return OBJECTIVES.names()


def objective_of(cfg) -> ObjectiveSpec:
    """The spec of the experiment's objective (sft where the config has no objective section)."""
    o = cfg.get("objective") if hasattr(cfg, "get") else getattr(cfg, "objective", None)
    return get_objective(o.name if o is not None else "sft")


def loss_of(cfg):
    """The runners' loss of the experiment's objective (None: next-token cross-entropy)."""
    spec = objective_of(cfg)
    return spec.loss(cfg.objective) if spec.loss is not None else None


def rows_per_example(cfg) -> int:
    """The documents (rows) an example of the experiment's objective holds, its first the text the model should
    write: a preference pair's chosen, then its rejected (what val_perplexity and the generations' prompts read)."""
    return 2 if objective_of(cfg).rows == PAIR else 1


def sweep_objectives() -> dict:
    """Every registered objective's sweep objectives (sweep.objective's names beyond the train stage's own)."""
    found: dict = {}
    for name in objective_names():
        found.update(get_objective(name).sweep_objectives)
    return found
