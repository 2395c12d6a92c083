"""One rank of the "a rank allocates only what it holds" check (run by tests with torch.distributed.run).

Builds this rank's part of the layout (build_layout, as the train stage does) under torch's profiler, which sees
every allocation and free of the CPU allocator, and prints one JSON line per rank: the peak of live bytes while
building, the bytes of the parameters this rank holds (its shards), and the largest parameter of the model. With
--hf=<folder> and/or --dcp=<checkpoint>, also the peak while loading those weights into the built layout (what
`train.init_from` does), in "load_peak_hf" and "load_peak_dcp".

    python -m torch.distributed.run --nproc_per_node=N tests/layout_memory_rank.py [--hf=DIR] [--dcp=DIR] overrides...
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch._C._profiler import _EventType
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plugins.models import build_on_meta, get_model  # noqa: E402
from plugins.parallel.layout import build_layout  # noqa: E402
from planning.partition import build_plan  # noqa: E402
from tests.conftest import make_cfg  # noqa: E402


def peak_allocated(fn) -> tuple[int, object]:
    """The peak of live CPU bytes allocated by fn (allocations and frees in time order), and fn's result."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = []

    def walk(nodes):
        for n in nodes:
            if n.tag == _EventType.Allocation and n.extra_fields.device.type == "cpu":
                events.append((n.start_time_ns, n.extra_fields.alloc_size))
            walk(n.children)

    walk(prof.profiler.kineto_results.experimental_event_tree())
    live = peak = 0
    for _, size in sorted(events):
        live += size
        peak = max(peak, live)
    return peak, result


def built(cfg) -> tuple[dict, object]:
    """This rank's layout built as the train stage builds it, and what building it took: the peak of live bytes, the
    bytes of the parameters the rank holds, of the model's largest parameter and of the whole model."""
    spec = get_model(cfg.model.name)
    plan = build_plan(cfg.model, cfg.parallel)
    full = build_on_meta(spec, cfg.model)
    largest = max(p.numel() * p.element_size() for p in full.parameters())
    peak, layout = peak_allocated(lambda: build_layout(cfg, plan, spec, torch.device("cpu")))
    held = 0
    for _, p in layout.params:
        local = p.to_local() if isinstance(p, DTensor) else p
        held += local.numel() * local.element_size()
    return {"rank": dist.get_rank() if dist.is_initialized() else 0, "peak": peak, "held": held, "largest": largest,
            "model": sum(p.numel() * p.element_size() for p in full.parameters())}, layout


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    sources = [a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--")]
    cfg = make_cfg(*[a for a in sys.argv[1:] if not a.startswith("--")])
    line, layout = built(cfg)
    for kind, path in sources:
        line[f"load_peak_{kind}"], _ = peak_allocated(lambda: load(kind, Path(path), cfg, layout))
    lines = [None] * dist.get_world_size()
    dist.all_gather_object(lines, line)
    if dist.get_rank() == 0:
        print(json.dumps(lines))
    dist.destroy_process_group()


def load(kind: str, path: Path, cfg, layout) -> None:
    """What train.init_from does with a Hugging Face folder (weights) or a DCP checkpoint (weights and optimizer)."""
    from storage import checkpoint as ckpt
    from storage import hf
    from plugins.models.registry import vocab_rows
    from runtime.optim import build_optimizer

    if kind == "hf":
        ckpt.load_full_weights([(p, None) for p in layout.parts], hf.load_state(path, vocab_rows(cfg.model)),
                               layout.aliases)
    else:
        parts = [(p, build_optimizer(cfg.optimizer, p, torch.device("cpu"))) for p in layout.parts]
        ckpt.load(path, parts, layout.aliases)


if __name__ == "__main__":
    main()
