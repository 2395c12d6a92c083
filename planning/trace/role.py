"""One rank role's step, traced: `python -m planning.trace.role CONFIG RANK [RANK ...]` prints each role's figures as
one JSON line. Each role in a process of its own, forked: it makes a fake process group of the layout's world size,
which a process can hold once.

The layout is built as the train stage builds it (build_layout, the optimizers of runtime/optim.py, the objective's
loss), its optimizer state made as the first step makes it (the traced step is a later one, which holds it), then one
step runs through runtime.step.train_step on a synthetic batch of the run's global shape
(train.batch_size x train.seq_len, every label counted): every microbatch, backward, the clip, the optimizer step.
The same function measures a real rank (fake=False, its process group already initialised: the tests' check).

What the trace does not run as the run does, each said in the output's "notes":
- triton.enabled: the blocks run eager. torch.compile does not trace fake tensors made by an outer fake mode; the
  compiled blocks compute the same ops, Inductor's fusions would only lower the temporaries.
- fp16: the loss scaler is off (its overflow check reads the gradient norm back, which a fake tensor has not);
  the memory and the collectives are the same.
- a pipeline (parallel.pp > 1): its stages are given their metadata (planning/trace/fake_pipeline.py), as every
  step after the first has it; the first step's one-off inference of it is left out.
"""
from __future__ import annotations

import contextlib
import copy
import json
import logging
import resource
import sys
import time

import torch

from plugins.data.batcher import Batch
from plugins.engines import get_engine
from plugins.models import get_model
from plugins.objectives import loss_of
from plugins.parallel import world_size
from plugins.parallel.layout import build_layout
from planning.partition import build_plan
from planning.trace.collectives import CollectiveCounter
from planning.trace.fake import fake_tensors, init_fake_world
from planning.trace.flops import counting_flops, split
from planning.trace.memory import MemoryByCategory, _local
from runtime.optim import build_optimizer
from runtime.precision import LossScaler, build_scaler
from runtime.metrics import MemoryProbe
from runtime.step import StepSettings, train_step


def traceable(cfg) -> tuple[object, list[str]]:
    """A copy of the config the trace can run, and what differs from the run (the notes)."""
    cfg, notes = copy.deepcopy(cfg), []
    if cfg.triton.enabled:
        cfg.triton.enabled = False
        notes.append("triton.enabled: traced eager (torch.compile does not take the trace's fake tensors); "
                     "compiled blocks would fuse some temporaries away")
    if cfg.precision.name == "fp16":
        notes.append("precision=fp16: traced without the loss scaler's overflow check (it reads a value back)")
    if cfg.engine.name != "torch":
        raise ValueError(f"engine={cfg.engine.name}: the trace runs engine=torch only (ONNX Runtime does not take "
                         "fake tensors)")
    return cfg, notes


def synthetic_batch(cfg) -> Batch:
    """The run's global batch shape, every label counted (the most the head and the loss can do)."""
    g = torch.Generator().manual_seed(0)
    shape = (cfg.train.batch_size, cfg.train.seq_len)
    inputs = torch.randint(0, cfg.model.vocab_size, shape, generator=g)
    labels = torch.randint(0, cfg.model.vocab_size, shape, generator=g)
    return Batch(inputs, labels, 1.0, 1.0)


def checkpoint_bytes(layout, optimizers) -> float:
    """What DCP writes for this rank: its shards of the parameters and of the optimizer state, a tensor held whole by
    k ranks of the stage counted 1/k (DCP writes one copy; which rank writes it is DCP's choice). A tied copy
    (layout.aliases) is written once, by the stage holding the weight it copies."""
    ranks = layout.coords.dp_size * layout.coords.hp_size

    def share(t: torch.Tensor, like: torch.Tensor) -> float:
        from torch.distributed.tensor import DTensor

        local = _local(t)
        if isinstance(like, DTensor):
            shards = 1
            for i, placement in enumerate(like.placements):
                if not (placement.is_replicate() or placement.is_partial()):
                    shards *= like.device_mesh.size(i)
            copies = max(ranks // shards, 1)
        else:
            copies = ranks
        return local.numel() * local.element_size() / copies

    total = 0.0
    state = {}
    for opt in optimizers:
        state.update(opt.state)
    for name, p in layout.params:
        if name in layout.aliases:
            continue
        total += share(p, p)
        for v in state.get(p, {}).values():
            if isinstance(v, torch.Tensor):
                total += share(v, p) if v.dim() else v.numel() * v.element_size() / ranks
    return total


def _pipeline(cfg, plan, spec, layout, batch, settings):
    """A pipeline schedule's step on fake tensors: its stages given their metadata (planning/trace/fake_pipeline.py),
    the activation between stages learnt from stage 0 on one microbatch, before the trackers are entered."""
    from planning.trace.fake_pipeline import fake_schedule, stage_boundary

    inputs = layout.rank_inputs(batch, settings.repack_to, settings.microbatches)[0]
    first = inputs.tensor_split(cfg.parallel.microbatches)[0]  # the schedule splits the inputs so
    return fake_schedule(layout.runner, stage_boundary(cfg, plan, spec, layout.mesh, first), first)


def _optimizer_device(cfg, fake: bool) -> torch.device:
    """The device the optimizer's implementation is chosen for (runtime/optim.py): the run's ranks' (CUDA GPUs where
    the run gets them); a real rank of the tests' check runs on this CPU."""
    from runtime.machine import ranks_on_cuda

    return torch.device("cuda" if fake and ranks_on_cuda(cfg)[0] else "cpu")


def with_optimizer_state(optimizers: list) -> None:
    """The optimizer's state made as a first step makes it (zero gradients, one step), so that the traced step is a
    later one: from the second step on, the state is held through forward and backward, and the peak with it."""
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)


def step_floor(cfg, flops: float) -> str:
    """The step's FLOPs at the declared device's dense peak (cluster.device): a floor on its time; '' without one."""
    from planning.devices import device_of

    device = device_of(cfg.cluster.get("device"))
    if device is None or not device.bf16_tflops:
        return ""
    low = cfg.precision.name in ("bf16", "fp16")
    rate = (device.bf16_tflops if low else device.fp32_tflops) * 1e12
    return (f"{flops / rate:,.2f} s at {device.what}'s dense {'bf16' if low else 'fp32'} peak "
            f"({rate / 1e12:,.0f} TFLOP/s; a floor)")


def measure(cfg, rank: int, fake: bool = True, around_step=None) -> dict:
    """The role's figures. fake=False: real tensors in an initialised process group (the tests' real side);
    around_step(fn) runs the step (the tests put the profiler around it) and returns fn's result."""
    started = time.perf_counter()
    cfg, notes = traceable(cfg)
    device = torch.device("cpu")
    if fake:
        init_fake_world(rank, world_size(cfg.parallel))
    spec = get_model(cfg.model.name)
    plan = build_plan(cfg.model, cfg.parallel, cfg.peft)
    engine = get_engine(cfg.engine.name)
    with fake_tensors() if fake else contextlib.nullcontext():
        layout = build_layout(cfg, plan, spec, device, timeline=False, prepared=None, log=logging.getLogger("trace"),
                              objective=loss_of(cfg))
        # the optimizer's kernels as the run's ranks choose them: a GPU run's fused ones keep no temporaries
        optimizers = [build_optimizer(cfg.optimizer, part, _optimizer_device(cfg, fake)) for part in layout.parts]
        scaler = LossScaler(enabled=False) if fake else build_scaler(cfg)
        batch = synthetic_batch(cfg)
        settings = StepSettings.of(cfg, engine.one_shape)

        pipeline = contextlib.nullcontext()
        if cfg.parallel.pp > 1 and fake:
            pipeline = _pipeline(cfg, plan, spec, layout, batch, settings)
        elif cfg.parallel.pp > 1:  # a real pipeline's first step also infers and exchanges the stages' metadata (a
            # microbatch's forward and backward, once); the trace gives it them, as every later step has them: the
            # real rank is measured at its second step
            train_step(layout, optimizers, batch, 0, cfg.optimizer.lr, settings, MemoryProbe(device), scaler)
        if not (cfg.parallel.pp > 1 and not fake):  # (the real pipeline's first step made it)
            with_optimizer_state(optimizers)

        def step():
            with counting_flops() as flops, CollectiveCounter(layout.mesh) as comm, \
                    MemoryByCategory(layout.parts, optimizers) as memory, pipeline:
                train_step(layout, optimizers, batch, 0, cfg.optimizer.lr, settings, MemoryProbe(device), scaler)
            return flops, comm, memory

        flops, comm, memory = (around_step or (lambda fn: fn()))(step)
        figures = {"rank": rank, "world_size": layout.coords.world_size,
                   "coords": {d: getattr(layout.coords, d) for d in ("pp", "dp", "hp")},
                   "sizes": {d: getattr(layout.coords, f"{d}_size") for d in ("pp", "dp", "hp")},
                   "stage_ids": list(layout.stage_ids), **memory.result(),
                   "collectives": comm.result(), **split(flops),
                   "checkpoint_bytes": checkpoint_bytes(layout, optimizers)}
    figures["seconds"] = time.perf_counter() - started
    figures["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    figures["step_floor"] = step_floor(cfg, figures["flops"])
    figures["notes"] = notes
    return figures


def forked(calls: list, jobs: int) -> list:
    """Each call's result (JSON-able), each call run in a process forked from this one, up to `jobs` at once: a
    role needs a process of its own (its process group), and forking spares each one the imports (most of a small
    role's time). The children do no more than the call; a failed one raises here (its traceback on stderr)."""
    import os
    import tempfile
    import traceback
    from pathlib import Path

    results, running, todo = {}, {}, list(enumerate(calls))
    with tempfile.TemporaryDirectory(prefix="trace-") as scratch:
        while todo or running:
            while todo and len(running) < jobs:
                i, call = todo.pop(0)
                path = Path(scratch) / f"{i}.json"
                pid = os.fork()
                if pid == 0:  # the child: never returns
                    code = 1
                    try:
                        torch.set_num_threads(1)  # the parent's OpenMP pool does not survive a fork
                        path.write_text(json.dumps(call()))
                        code = 0
                    except BaseException:
                        traceback.print_exc()
                    finally:
                        sys.stdout.flush(), sys.stderr.flush()
                        os._exit(code)
                running[pid] = (i, path)
            pid, status = os.wait()
            i, path = running.pop(pid)
            if os.waitstatus_to_exitcode(status) != 0:
                for other in running:
                    os.kill(other, 9)
                raise RuntimeError(f"call {i} failed (exit status {os.waitstatus_to_exitcode(status)})")
            results[i] = json.loads(path.read_text())
    return [results[i] for i in range(len(calls))]


def main(argv: list[str]) -> None:
    """CONFIG RANK [RANK ...] [--jobs N]: one JSON line per rank, in order (N at once; default one per core)."""
    import functools
    import os

    from omegaconf import OmegaConf

    jobs = int(argv[argv.index("--jobs") + 1]) if "--jobs" in argv else os.cpu_count() or 1
    args = argv[:argv.index("--jobs")] if "--jobs" in argv else argv
    cfg = OmegaConf.load(args[0])
    for figures in forked([functools.partial(measure, cfg, int(rank)) for rank in args[1:]], jobs):
        print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
