"""How a step's forward and backward run: a microbatch loop on one stage, or a pipeline schedule.

Both runners take the rank's share of the global batch and return the rank's contribution to the step's
loss (already divided by the global label count, detached). The loss they differentiate is that share times
`grad_scale` (the dp degree: data parallelism averages gradients over dp ranks, the global mean needs their
sum) times the step's `loss_scale` (fp16's loss scaling; 1 otherwise). The parts cast themselves (parallelize's
precision step). With label sparsity (`sparse`, train.label_sparsity) the part holding the head is given the
labels and returns the summed loss itself (plugins/models/head_loss.py); otherwise it returns logits for `loss_fn`.
Ranks whose contribution would repeat another rank's (tensor-parallel peers, stages without the loss) contribute
zero, so one SUM all-reduce over the world gives the global loss.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Optional

import torch
from torch import nn

from plugins.parallel.data import set_gradient_sync
from plugins.parallel.schedules import SCHEDULES


def _value(t: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor (under loss_parallel it is a replicated DTensor)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def loss_context(loss_parallel: bool):
    if loss_parallel:
        from torch.distributed.tensor.parallel import loss_parallel as ctx

        return ctx()
    return contextlib.nullcontext()


class MicrobatchRunner:
    """One stage holds the whole model (dp and/or hp only): accumulate gradients over microbatches."""

    def __init__(self, module: nn.Module, loss_fn: Callable, microbatches: int, counts_loss: bool,
                 loss_parallel: bool, grad_scale: float = 1.0, probe=None, sparse: bool = False, objective=None):
        self.module, self.loss_fn, self.microbatches = module, loss_fn, microbatches
        self.counts_loss, self.loss_parallel, self.probe = counts_loss, loss_parallel, probe
        self.grad_scale, self.sparse, self.objective = grad_scale, sparse, objective

    def _loss_sum(self, x, y, d, count: Optional[int] = None, row_inputs=None) -> torch.Tensor:
        return _loss_sum(self.module, x, y, d, self.sparse, self.loss_fn, count, self.objective, row_inputs)

    def train_step(self, inputs: torch.Tensor, labels: torch.Tensor, n_labels: int,
                   loss_scale: float = 1.0, documents: Optional[torch.Tensor] = None,
                   counts: Optional[list[int]] = None, row_inputs: Optional[torch.Tensor] = None) -> torch.Tensor:
        """counts: each microbatch's labels that count, read on the host before the batch went to the device (the
        sparse head then never waits for the GPU); None: the head asks the device. row_inputs: with an objective,
        each row's input it asked for (n_labels is then the global batch's count of what it averages)."""
        total = torch.zeros((), device=inputs.device)
        ys = labels.chunk(self.microbatches)
        if counts is None or len(counts) != len(ys):  # counted for another split: let the head ask the device
            counts = [None] * len(ys)
        chunks = list(zip(inputs.chunk(self.microbatches), ys, _chunks(documents, self.microbatches), counts,
                          _chunks(row_inputs, self.microbatches)))
        backward_scale = self.grad_scale * loss_scale
        for i, (x, y, d, count, r) in enumerate(chunks):
            set_gradient_sync([self.module], i == len(chunks) - 1)
            self._sample("pre_forward")
            with loss_context(self.loss_parallel):
                loss = self._loss_sum(x, y, d, count, r) / n_labels
                self._sample("post_forward")
                (loss * backward_scale if backward_scale != 1 else loss).backward()
            self._sample("post_backward")
            total += _value(loss.detach())
        return total if self.counts_loss else torch.zeros_like(total)

    @torch.no_grad()
    def eval_sum(self, inputs: torch.Tensor, labels: torch.Tensor, documents: Optional[torch.Tensor] = None,
                 row_inputs: Optional[torch.Tensor] = None) -> torch.Tensor:
        with loss_context(self.loss_parallel):
            total = _value(self._loss_sum(inputs, labels, documents, row_inputs=row_inputs))
        return total if self.counts_loss else torch.zeros_like(total)

    def _sample(self, phase: str) -> None:
        if self.probe is not None:
            self.probe.sample(phase)


class PipelineRunner:
    """This rank's pipeline stages under a torch.distributed.pipelining schedule.

    The last stage keeps neither outputs nor labels it does not need (return_outputs=False, ColossalAI's
    return_output_label=False) and losses are summed detached. Gradients are not rescaled by the schedule:
    the loss is already a share of the global mean."""

    def __init__(self, modules: list[nn.Module], stage_ids: list[int], stage_ranks: list[int], schedule: str,
                 microbatches: int, loss_fn: Callable, group, device: torch.device, counts_loss: bool,
                 loss_parallel: bool, grad_scale: float = 1.0, timeline: Optional["Timeline"] = None, probe=None,
                 sparse: bool = False, objective=None):
        from torch.distributed.pipelining import PipelineStage, schedules

        n_stages = len(stage_ranks)
        self.stages = [PipelineStage(m, s, n_stages, device, group=group) for m, s in zip(modules, stage_ids)]
        self.modules = dict(zip(stage_ids, modules))
        self.stage_ranks, self.group, self.microbatches = stage_ranks, group, microbatches
        self.has_first = any(s.is_first for s in self.stages)
        self.has_last = any(s.is_last for s in self.stages)
        self.loss_fn, self.counts_loss, self.loss_parallel = loss_fn, counts_loss, loss_parallel
        self.grad_scale, self.sparse, self.objective = grad_scale, sparse, objective
        self.scale = 1.0  # what the schedule's loss is multiplied by (its returned losses too)
        chosen = SCHEDULES[schedule]
        cls = getattr(schedules, chosen.torch_class)  # single-stage schedules take the stage, the others a list
        self.schedule = cls(self.stages if chosen.multi_chunk else self.stages[0], n_microbatches=microbatches,
                            loss_fn=self._loss, scale_grads=False)
        self.timeline, self.probe = timeline, probe
        if timeline is not None:
            timeline.instrument(self.stages)

    def _loss(self, output, target):
        """The schedule's loss of a microbatch: the last stage's output is already the summed loss when sparse
        (the labels travelled as a keyword input, split into microbatches like the documents); with an objective it
        is the rows' log-probabilities, and the target their inputs (zeros where it asked for none: a schedule wants
        a target)."""
        if self.objective is not None:
            return self.objective(output, target) * self.scale
        return (output if self.sparse else self.loss_fn(output, target)) * self.scale

    def train_step(self, inputs: torch.Tensor, labels: torch.Tensor, n_labels: int,
                   loss_scale: float = 1.0, documents: Optional[torch.Tensor] = None,
                   counts: Optional[list[int]] = None, row_inputs: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Forward and backward of every microbatch, as the schedule orders them (memory is sampled
        around the whole schedule: its phases interleave). documents go to every stage (the schedule splits
        keyword inputs into microbatches like the inputs and hands each stage its own)."""
        self.scale = self.grad_scale * loss_scale / n_labels
        if self.probe is not None:
            self.probe.sample("pre_forward")
        if self.timeline is not None:
            self.timeline.start_step()
        losses: list = []
        args = (inputs,) if self.has_first else ()
        if self.objective is not None:
            target = row_inputs if row_inputs is not None else torch.zeros(inputs.shape[0], dtype=torch.float64,
                                                                         device=inputs.device)
        else:
            target = labels
        kwargs = {"target": target, "losses": losses} if self.has_last else {}
        if documents is not None:
            kwargs["documents"] = documents
        if self.sparse:  # every stage is given them (keyword inputs go to all); only the head's uses them
            kwargs["labels"] = labels
        with loss_context(self.loss_parallel):
            self.schedule.step(*args, return_outputs=False, **kwargs)
        if self.objective is not None and self.has_last:  # not the loss of the first step's shape inference
            self.objective.keep_last(self.microbatches)
        if self.timeline is not None:
            self.timeline.stop_step()
        if self.probe is not None:
            self.probe.sample("post_backward")
        total = sum((_value(l.detach()) for l in losses), torch.zeros((), device=inputs.device)) / \
            (self.grad_scale * loss_scale)
        return total if self.counts_loss and self.has_last else torch.zeros_like(total)

    @torch.no_grad()
    def eval_sum(self, inputs: torch.Tensor, labels: torch.Tensor, documents: Optional[torch.Tensor] = None,
                 row_inputs: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Forward only, microbatch by microbatch through the stages in order, activations passed
        point-to-point (torch 2.13's schedule.eval() fails for the V schedule: "can't steal_bwd_input
        if this stage doesn't have backward"). Evaluation is rare: simplicity beats overlap here."""
        import torch.distributed as dist

        me = dist.get_group_rank(self.group, dist.get_rank())
        xs = inputs.chunk(self.microbatches) if self.has_first else [None] * self.microbatches
        ys = labels.chunk(self.microbatches) if self.has_last else [None] * self.microbatches
        total = torch.zeros((), device=inputs.device)
        last = len(self.stage_ranks) - 1
        for x, y, d, r in zip(xs, ys, _chunks(documents, self.microbatches), _chunks(row_inputs, self.microbatches)):
            h = x
            for s, owner in enumerate(self.stage_ranks):
                if owner != me:
                    continue
                if s > 0 and self.stage_ranks[s - 1] != me:
                    h = _recv(self.stage_ranks[s - 1], self.group, inputs.device)
                with loss_context(self.loss_parallel):
                    if s == last:
                        total += _value(_loss_sum(self.modules[s], h, y, d, self.sparse, self.loss_fn,
                                                  objective=self.objective, row_inputs=r))
                    else:
                        h = _forward(self.modules[s], h, d)
                if s < last and self.stage_ranks[s + 1] != me:
                    _send(h, self.stage_ranks[s + 1], self.group)
        return total if self.counts_loss and self.has_last else torch.zeros_like(total)


def _chunks(documents: Optional[torch.Tensor], n: int) -> list:
    return list(documents.chunk(n)) if documents is not None else [None] * n


def _forward(module: nn.Module, h: torch.Tensor, documents: Optional[torch.Tensor], **labels) -> torch.Tensor:
    """A module's forward, with the rows' documents when they hold whole documents (a call without them otherwise,
    so a module that never sees them needs no such argument), and `labels=` when the head computes the loss."""
    return module(h, **labels) if documents is None else module(h, documents=documents, **labels)


def _loss_sum(module: nn.Module, x: torch.Tensor, y: torch.Tensor, documents: Optional[torch.Tensor], sparse: bool,
              loss_fn: Callable, count: Optional[int] = None, objective=None,
              row_inputs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The summed loss of the part that holds the head: computed by the part itself when sparse (label sparsity;
    count: its labels that count, where the host knows it), else loss_fn on its logits; with an objective, the
    objective's of the rows' log-probabilities the part gives, with their inputs."""
    if objective is not None:
        return objective(_forward(module, x, documents, labels=y), row_inputs)
    if sparse:
        return _forward(module, x, documents, labels=y, **({} if count is None else {"label_count": count}))
    return loss_fn(_forward(module, x, documents), y)


_WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # activations between stages


def _send(t: torch.Tensor, peer: int, group) -> None:
    """Send an activation with a header (rank, shape, dtype: bf16/fp16 runs pass low-precision activations)."""
    import torch.distributed as dist

    header = torch.zeros(8, dtype=torch.int64, device=t.device)
    header[0] = t.dim()
    header[1:1 + t.dim()] = torch.tensor(t.shape)
    header[7] = _WIRE_DTYPES.index(t.dtype)
    dist.send(header, group_dst=peer, group=group)
    dist.send(t.contiguous(), group_dst=peer, group=group)


def _recv(peer: int, group, device: torch.device) -> torch.Tensor:
    import torch.distributed as dist

    header = torch.zeros(8, dtype=torch.int64, device=device)
    dist.recv(header, group_src=peer, group=group)
    shape, dtype = header[1:1 + int(header[0])].tolist(), _WIRE_DTYPES[int(header[7])]
    t = torch.empty(shape, device=device, dtype=dtype)
    dist.recv(t, group_src=peer, group=group)
    return t


class Timeline:
    """Records when each of this rank's stages runs each microbatch's forward and backward, to measure
    the pipeline bubble (idle share of a step) and to draw a per-rank timeline."""

    def __init__(self):
        self.events: list[tuple[int, str, int, float, float]] = []   # (stage, kind, microbatch, t0, t1)
        self.step_start = 0.0
        self.step_seconds = 0.0
        self.recording = False

    def start_step(self) -> None:
        self.events.clear()
        self.recording = True
        self.step_start = time.perf_counter()

    def stop_step(self) -> None:
        self.recording = False
        self.step_seconds = time.perf_counter() - self.step_start

    def idle_fraction(self) -> float:
        """Share of the last step this rank spent outside its stages' compute (waiting: the bubble)."""
        return 1.0 - self.busy_seconds() / self.step_seconds if self.step_seconds else 0.0

    def instrument(self, stages) -> None:
        for stage in stages:
            for kind, name in (("F", "forward_one_chunk"), ("B", "backward_one_chunk"), ("W", "backward_weight_one_chunk")):
                if hasattr(stage, name):
                    setattr(stage, name, self._timed(getattr(stage, name), stage.stage_index, kind))

    def _timed(self, fn, stage: int, kind: str):
        def wrapper(chunk_id, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(chunk_id, *args, **kwargs)
            finally:
                if self.recording:
                    self.events.append((stage, kind, chunk_id, t0 - self.step_start,
                                        time.perf_counter() - self.step_start))
        return wrapper

    def busy_seconds(self) -> float:
        return sum(t1 - t0 for _, _, _, t0, t1 in self.events)
