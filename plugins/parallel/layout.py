"""This rank's share of the model, built from the partition plan the transform stage wrote.

`build_layout` makes the rank's pipeline stage module(s) on the meta device (layers by global index, so
parameter names are the same in every layout), transforms them there (plugins/parallel/parallelize.py:
recomputation, tensor parallelism, the engine, compilation, data parallelism, in that order), then allocates
only the rank's shards and initialises them
by name (each weight drawn in full from its own seed, its shard kept: every layout starts from the same values),
checks the result against the plan, and chooses the runner (microbatch loop or pipeline schedule). A rank's peak
while building is its shards plus the largest single parameter. One process is the layout with every size 1.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from plugins.data.packing import rank_tokens, repack, trimmed_width
from plugins.engines import get_engine
from plugins.models.head_loss import IGNORED
from plugins.models.lora import apply_lora, init_adapters, store_frozen
from plugins.models.registry import build_on_meta, materialise
from plugins.parallel.grads import TiedGradients, clip_grad_norm
from plugins.parallel.mesh import Coordinates, build_mesh
from plugins.parallel.parallelize import parallelize
from plugins.parallel.pipeline import MicrobatchRunner, PipelineRunner, Timeline
from storage.weights import tied_aliases
from runtime import precision as mixed
from runtime.kernels import KernelReport


@dataclass
class Layout:
    parts: list[nn.Module]              # this rank's stage modules (one unless a schedule has several chunks)
    runner: object                      # MicrobatchRunner | PipelineRunner
    coords: Coordinates
    aliases: dict[str, str]             # name of a tied copy -> the name of the weight it copies
    device: torch.device
    mesh: object = None
    tied: Optional[TiedGradients] = None
    timeline: Optional[Timeline] = None
    loss_rank: bool = True              # whether this rank's loss counts in the global sum
    stage_ids: list[int] = field(default_factory=list)
    kernels: KernelReport = field(default_factory=KernelReport)   # what compilation did (triton=on)
    engine_fallbacks: dict[str, str] = field(default_factory=dict)  # units the engine left to torch, and why

    def __post_init__(self):
        seen: set[int] = set()
        self.params = []                # (name, parameter) of every local parameter, each once
        for part in self.parts:
            for name, p in part.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    self.params.append((name, p))

    @property
    def world(self) -> bool:
        return self.coords.world_size > 1

    def rank_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """The rows of the global batch this rank's data-parallel replica trains on."""
        rows = tensor.shape[0] // self.coords.dp_size
        return tensor[self.coords.dp * rows:(self.coords.dp + 1) * rows]

    def local_batch(self, tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """This rank's rows of the global batch, on its device (None stays None: documents of rows that are not
        whole documents)."""
        return None if tensor is None else self.to_device(self.rank_rows(tensor))

    def rank_inputs(self, batch, repack_to: int = 0, microbatches: int = 1, rows_kept: bool = False) -> tuple:
        """This rank's (inputs, labels, documents) of a batch on its device: its rows, or (repack_to: padded rows
        of one document each) their real tokens packed into fewer rows (plugins/data/packing.repack): the same
        logits per token, about the real tokens' compute, so ranks dealt equal real tokens take equal time; with
        rows_kept (preference pairs: each row is a completion), the rows cut after their longest real run instead
        (packing.trimmed_width). Fourth, each microbatch's count of labels that enter the loss, read here on the host
        (the sparse head's `count`)."""
        if repack_to and rows_kept and batch.real is not None and batch.documents is None:
            width = trimmed_width(self.rank_rows(torch.from_numpy(batch.real)).tolist(), batch.inputs.shape[1],
                                  repack_to)
            mine = (self.rank_rows(batch.inputs)[:, :width], self.rank_rows(batch.labels)[:, :width], None)
        elif not repack_to or batch.real is None or batch.documents is not None:
            mine = tuple(None if t is None else self.rank_rows(t) for t in (batch.inputs, batch.labels,
                                                                             batch.documents))
        else:
            mine = repack(self.rank_rows(batch.inputs), self.rank_rows(batch.labels),
                          self.rank_rows(torch.from_numpy(batch.real)), repack_to, microbatches)
        counts = [int((y != IGNORED).sum()) for y in mine[1].chunk(microbatches)]
        return (*(None if t is None else self.to_device(t) for t in mine), counts)

    def rank_token_spread(self, real) -> float:
        """The most real tokens a data-parallel rank holds over their mean (1: balanced)."""
        tokens = rank_tokens(real, self.coords.dp_size)
        return float(tokens.max() / max(tokens.mean(), 1))

    def to_device(self, mine: torch.Tensor) -> torch.Tensor:
        """To a GPU through pinned memory, without waiting: a copy from pageable memory synchronises the stream, so
        the host would wait for the last step's kernels before it could queue the next step's."""
        if self.device.type == "cuda":
            return mine.pin_memory().to(self.device, non_blocking=True)
        return mine.to(self.device)

    def sync_and_clip(self, max_norm: float, loss_scale: float = 1.0) -> torch.Tensor:
        """Make tied copies' gradients equal, then unscale them (fp16's loss scale) and clip by the global norm
        (returned, unscaled; inf or nan when a gradient overflowed). A tied copy is not counted in the norm: the
        weight it copies lives on the first stage and is counted there."""
        if self.tied is not None:
            self.tied.sync()
        return clip_grad_norm(self.params, max_norm, set(self.aliases),
                              self.coords.dp_size * self.coords.hp_size, self.world, loss_scale)

    def train(self, mode: bool = True) -> None:
        for part in self.parts:
            part.train(mode)

    def objective_metrics(self, count: int) -> Optional[tuple[Callable, torch.Tensor]]:
        """(the objective's means, this rank's share of its sums over `count`) of what it measured since it was last
        asked (preference pairs' rewards and log-probabilities): summed over ranks they are the global shares, which
        means(shares) names; None without an objective. Ranks whose values repeat another's (tensor-parallel
        peers) add nothing."""
        objective = getattr(self.runner, "objective", None)
        if objective is None:
            return None
        sums = objective.take().to(self.device)
        return objective.means, sums / count if self.loss_rank else torch.zeros_like(sums)

    def reduce(self, values: torch.Tensor, op=None) -> torch.Tensor:
        """All-reduce small host-side statistics (on the rank's device: nccl reduces CUDA tensors only)."""
        if not self.world:
            return values
        on_device = values.to(self.device)
        dist.all_reduce(on_device, op=op or dist.ReduceOp.SUM)
        return on_device.cpu()


def build_layout(cfg, plan: dict, spec, device: torch.device, probe=None, timeline: bool = False,
                 prepared=None, log=None, objective=None) -> Layout:
    """prepared: what the transform stage prepared for the engine (None: no engine); log: where compilation reports
    (None: the `triton` section is not applied). The train stage passes both; a reference layout neither.
    objective: an objective's loss of per-row log-probabilities (plugins/objectives/spec.py; None: next-token
    cross-entropy): the head then gives each row's log-probability (per_row), which it takes."""
    p = cfg.parallel
    mesh, coords = build_mesh(p, device)
    local_stages = [s for s in plan["pipeline"] if s["rank"] == coords.pp]
    engine, fallbacks = None, {}
    runs_on = get_engine(cfg.engine.name)
    if prepared is not None and runs_on.build is not None:
        hp_group = mesh.get_group("hp") if coords.hp_size > 1 else None
        engine, fallbacks = runs_on.build(spec, prepared, cfg.engine, hp_group, device, dist.get_rank() if mesh else 0)
    kernels = KernelReport()
    precision = mixed.of(cfg, device, runs_on.mixed_precision)
    parts = []
    for i, st in enumerate(local_stages):
        # structure first, on the meta device: split and transformed there, so that only this rank's shards are
        # ever allocated (materialise), then filled with the values every layout shares
        module = build_on_meta(spec, cfg.model)
        if cfg.peft.name == "lora":  # adapters first: every layout then places them as the Linears beside them
            apply_lora(module, cfg.peft)
            if precision.mixed:  # the frozen base in bf16/fp16, the adapters in fp32
                store_frozen(module, precision.dtype)
        if p.pp > 1:
            module = spec.split(module, st["layers"], st["embedding"], st["head"])
        parallelize(module, spec, cfg, mesh, device, engine, kernels if log is not None else None, log, i)
        materialise(module, device)
        spec.init_weights(module, cfg.model, cfg.train.seed)
        if cfg.peft.name == "lora":
            init_adapters(module, cfg.train.seed)
        module.loss_chunk = cfg.train.loss_chunk
        module.per_row = objective is not None
        parts.append(module)
    check_against_plan(parts, plan)

    aliases = tied_aliases(plan)
    loss_rank = coords.hp == 0  # tensor-parallel peers compute the same loss: count it once
    sparse = cfg.train.label_sparsity  # the head and the loss only where labels count (plugins/models/head_loss.py)
    if p.pp > 1:
        tl = Timeline() if timeline else None
        runner = PipelineRunner(parts, [s["stage"] for s in local_stages], [s["rank"] for s in plan["pipeline"]],
                                p.pp_schedule,
                                p.microbatches, spec.loss, mesh.get_group("pp"), device, loss_rank,
                                p.loss_parallel, p.dp, tl, probe, sparse, objective)
    else:
        tl = None
        runner = MicrobatchRunner(parts[0], spec.loss, p.microbatches, loss_rank, p.loss_parallel, p.dp, probe,
                                  sparse, objective)
    layout = Layout(parts, runner, coords, aliases, device, mesh, None, tl, loss_rank,
                    [s["stage"] for s in local_stages], kernels, fallbacks)
    if p.pp > 1 and aliases:
        layout.tied = _tied_gradients(layout, plan)
    return layout


def check_against_plan(parts: list[nn.Module], plan: dict) -> None:
    """Every local parameter has the plan's full shape, and is split across hp exactly where the plan says."""
    problems = []
    for part in parts:
        for name, param in part.named_parameters(remove_duplicate=False):
            want = plan["parameters"].get(name)
            if want is None:
                problems.append(f"{name}: not in the partition plan")
                continue
            if list(param.shape) != want["shape"]:
                problems.append(f"{name}: shape {list(param.shape)}, plan {want['shape']}")
            hp_split = _split_on_hp(param, want["partition_axis"])
            if hp_split != want["is_partitioned"]:
                problems.append(f"{name}: split across hp={hp_split}, plan says {want['is_partitioned']}")
    if problems:
        raise RuntimeError("the layout does not match the transform stage's partition plan: " + "; ".join(problems[:8]))


def _split_on_hp(param: torch.Tensor, axis: Optional[int]) -> bool:
    if axis is None or not isinstance(param, DTensor):
        return False
    names = param.device_mesh.mesh_dim_names or ()
    return any(dim == "hp" and placement.is_shard(axis) for dim, placement in zip(names, param.placements))


def _tied_gradients(layout: Layout, plan: dict) -> TiedGradients:
    """Group the copies of tied weights: local copies, and the ranks of the first and last stage that hold
    the same (dp, hp) shard. new_group is collective: every rank creates every group, in the same order."""
    canonical = set(layout.aliases.values())
    copies = [p for part in layout.parts for name, p in part.named_parameters()
              if name in layout.aliases or name in canonical]
    first_rank = plan["pipeline"][0]["rank"]
    last_rank = plan["pipeline"][-1]["rank"]
    group = None
    if first_rank != last_rank:
        grid = layout.mesh.mesh  # tensor of global ranks indexed by (pp, dp, hp)
        for d in range(grid.shape[1]):
            for h in range(grid.shape[2]):
                ranks = [int(grid[first_rank, d, h]), int(grid[last_rank, d, h])]
                g = dist.new_group(ranks)
                if (d, h) == (layout.coords.dp, layout.coords.hp):
                    group = g
        if layout.coords.pp not in (first_rank, last_rank):
            group = None
    return TiedGradients(copies, group)
