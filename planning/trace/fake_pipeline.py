"""A pipeline schedule's step in the trace (planning/trace/role.py): the project's PipelineRunner (torch.distributed.
pipelining's PipelineStage and schedule) on fake tensors in torch's fake process group.

Under the fake process group a rank receives nothing from its peers: a recv leaves the buffer the stage allocated (of
the right shape, all a trace needs). What does not survive that is the schedule's set-up, which decides on what
peers sent: the warm-up vote (`_PipelineScheduleBase._warmup_p2p`: every stage votes STATIC or DYNAMIC and the
product travels the pipeline and back; received as zeros it always says DYNAMIC) and, in DYNAMIC mode (the runner
gives PipelineStage no example tensors, so the run's first step is DYNAMIC), the metadata exchange
(`PipelineStage._recv_meta` -> `recv_object_list`, which unpickles the sizes and bytes a peer sent). So the stages
are given their metadata, as torch's STATIC mode takes it from a user (`_user_meta`), and the vote is skipped: the
step every step after the first takes (the first one also runs one microbatch's forward and backward to infer the
metadata, and exchanges it; a one-off the trace leaves out). The rest is the real code: the P2P sends and recvs,
the recv buffers for every microbatch, FSDP2's and tensor parallelism's collectives, every microbatch's forward and
backward in the schedule's order.

The metadata is the activation between stages, which a process does not know alone: `stage_boundary` builds stage
0 as build_layout builds a part and runs it on one microbatch. STATIC mode derives each stage's output-gradient
metadata from its output metadata (`_derive_grad_metas`: none for an output without requires_grad), so the boundary
is given requires_grad when the schedule has a backward (without it no gradient recv buffer is made, and the stage's
backward fails: "grad can be implicitly created only for scalar outputs"; a real process group fails the same way).
"""
from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Iterator

import torch


def stage_boundary(cfg, plan: dict, spec, mesh, microbatch: torch.Tensor) -> tuple:
    """The metas of one microbatch's activation between pipeline stages: stage 0 of the layout, built as
    build_layout builds a part, run without gradients on `microbatch` (the first stage's input). Every decoder
    boundary carries the same hidden state, so stage 0's output stands for every stage's input. Call it inside
    planning/trace/fake.py's fake_tensors() (the weights are then fake) and before the trackers (its collectives and
    memory are not the step's)."""
    from torch.distributed.pipelining._utils import extract_tensor_meta

    from plugins.parallel import layout as built  # build_on_meta: fake_tensors()'s, with the fake mode unset
    from plugins.parallel.parallelize import parallelize

    device = microbatch.device
    st = plan["pipeline"][0]
    module = spec.split(built.build_on_meta(spec, cfg.model), st["layers"], st["embedding"], st["head"])
    parallelize(module, spec, cfg, mesh, device)
    built.materialise(module, device)
    module.loss_chunk = cfg.train.loss_chunk
    with torch.no_grad():
        out = module(microbatch)
    return tuple(extract_tensor_meta(o) for o in (out if isinstance(out, (tuple, list)) else (out,)))


@contextlib.contextmanager
def fake_schedule(runner, boundary: tuple, first_input: torch.Tensor) -> Iterator[None]:
    """Inside this, `runner.train_step(...)` (a plugins.parallel.pipeline.PipelineRunner built in the fake process
    group) completes on one CPU. boundary: `stage_boundary`'s metas; first_input: one microbatch of the first
    stage's input. Only instance attributes of the schedule and its stages are set, and they are restored on exit."""
    from torch.distributed.pipelining import _utils

    schedule, stages = runner.schedule, list(runner.stages)
    # what arrives from the stage before requires grad when the schedule has a backward (the sender's output is in
    # its graph), and so does what a stage sends (its gradient comes back)
    grads = schedule._has_backward
    metas = tuple(replace(m, requires_grad=grads and m.dtype.is_floating_point) for m in boundary)
    first = (_utils.extract_tensor_meta(first_input),)

    def warmup_p2p(stages_, has_backward, p2p_done):
        for s in stages_:
            s._inference_mode = _utils.InferenceMode.STATIC

    saved = [s._user_meta for s in stages]
    schedule._warmup_p2p = warmup_p2p
    for s in stages:
        s._user_meta = _utils._StageMeta(inputs=first if s.is_first else metas, outputs=metas)
    try:
        yield
    finally:
        schedule.__dict__.pop("_warmup_p2p", None)
        for s, user_meta in zip(stages, saved):
            s._user_meta = user_meta
