"""The real ranks of the trace's check (run by tests/test_trace.py): the same step planning/trace/role.py traces, on
real tensors over gloo, measured by the same counters, and under torch's profiler for the peak of live CPU bytes the
step allocated (tests/layout_memory_rank.py's peak_allocated), and what building the layout allocated (its `built`). Each layout's ranks are processes forked from this one
(planning.trace.role.forked: the imports once, not once a rank), the layouts one after another; for each layout one
JSON line, the list of its ranks' figures.

    python tests/trace_real_rank.py -- RANKS overrides... [-- RANKS overrides...]
"""
from __future__ import annotations

import functools
import json
import sys
import tempfile
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planning.trace.role import forked, measure  # noqa: E402
from tests.conftest import make_cfg  # noqa: E402
from tests.layout_memory_rank import built, peak_allocated  # noqa: E402


def rank_figures(overrides: list[str], rank: int, world: int, store: str) -> dict:
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    profiled = {}

    def around(step):
        profiled["peak"], result = peak_allocated(step)
        return result

    cfg = make_cfg(*overrides)
    figures = measure(cfg, rank, fake=False, around_step=around)
    # then what building the rank's part of the layout allocates, as the run builds it (after the step: the groups a
    # second build makes are not the measured step's)
    figures["build"], _ = built(cfg)
    figures["profiler_peak_bytes"] = profiled["peak"]
    if world > 1:
        dist.barrier()  # no rank leaves while a peer still sends to it
        dist.destroy_process_group()
    return figures


def main(argv: list[str]) -> None:
    layouts = [part.split() for part in " ".join(argv).split("--") if part.strip()]
    with tempfile.TemporaryDirectory(prefix="trace-real-") as scratch:
        for i, (ranks, *overrides) in enumerate(layouts):
            world, store = int(ranks), f"{scratch}/store{i}"
            calls = [functools.partial(rank_figures, overrides, r, world, store) for r in range(world)]
            print(json.dumps(forked(calls, jobs=world)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
