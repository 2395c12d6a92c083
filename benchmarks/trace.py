"""The trace of a layout (issue 78): each distinct rank role's step on fake tensors and a fake process group, timed.

Prints, per role (first, middle and last pipeline stage), the trace's wall time and the process's max RSS, beside
what it measured: the peak by category, the FLOPs, the checkpoint bytes and the collectives.

    python benchmarks/trace.py model=llama3_8b parallel.dp=8 parallel.hp=8 parallel.dp_mode=shard \
        parallel.sequence_parallel=true parallel.loss_parallel=true memory=level2 precision=bf16 \
        train.batch_size=8 train.seq_len=8192
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.support.cli import arguments  # noqa: E402
from orchestrator.config.compose import compose_config  # noqa: E402
from planning.trace.roles import trace_roles  # noqa: E402

GIB = 2**30


def main(overrides: list[str]) -> None:
    arguments(overrides, __doc__)  # -h: the usage; every argument an override
    cfg = compose_config(*overrides, conf=ROOT / "conf")
    p = cfg.parallel
    print(f"{cfg.model.name} ({' '.join(overrides)}): world {p.dp * p.hp * p.pp} = pp {p.pp} x dp {p.dp} x hp {p.hp}")
    started = time.perf_counter()
    for role in trace_roles(cfg):
        cats = ", ".join(f"{k} {v / GIB:.2f}" for k, v in role["by_category"].items() if v)
        print(f"rank {role['rank']} (stages {role['stage_ids']}): {role['seconds']:.1f} s, max RSS "
              f"{role['max_rss_bytes'] / GIB:.2f} GiB; peak {role['peak_bytes'] / GIB:.2f} GiB ({cats}); "
              f"{role['flops'] / 1e12:.1f} TFLOP (attention {role['flops_attention'] / 1e12:.1f}); checkpoint "
              f"{role['checkpoint_bytes'] / GIB:.2f} GiB")
        print("  category peaks (GiB): " + ", ".join(f"{k} {v / GIB:.2f}" for k, v in role["category_peaks"].items()))
        for c in role["collectives"]:
            peer = f" with rank {c['peer']}" if "peer" in c else ""
            print(f"  {c['kind']:>15} over {c['group']:<6} x{c['count']:<5} {c['bytes'] / GIB:8.2f} GiB{peer}")
        for note in role["notes"]:
            print(f"  note: {note}")
    print(f"all roles: {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
