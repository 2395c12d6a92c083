"""The trace (planning/trace/) against real processes at sizes this machine runs for real: each layout's ranks run one
step on real tensors over gloo (tests/trace_real_rank.py: the same counters, the same step), and each role is
traced; printed per role and category: the real peak, the traced peak and their ratio, and whether the collectives
are equal.

    python benchmarks/trace_vs_real.py [model=gpt2_124m|llama_0.5b] [layouts=single,fsdp2,megatron_hp2,pipeline_pp2,dp2_hp2_pp2]
                                       [batch=8] [seq=128] [extra overrides...]
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.support.cli import arguments  # noqa: E402
from benchmarks.support.shapes import model_overrides  # noqa: E402
from orchestrator.config.compose import compose_config  # noqa: E402
from planning.trace.memory import CATEGORIES  # noqa: E402
from planning.trace.roles import trace_roles  # noqa: E402

LAYOUTS = {  # name -> (ranks, overrides)
    "single": (1, []),
    "fsdp2": (2, ["parallel=ddp2", "parallel.dp_mode=shard"]),
    "megatron_hp2": (2, ["parallel=megatron_hp2"]),
    "pipeline_pp2": (2, ["parallel=pipeline_pp2"]),
    "dp2_hp2_pp2": (8, ["parallel=dp2_hp2_pp2"]),
}
MB = 2**20


def main(argv: list[str]) -> None:
    args = arguments(argv, __doc__)
    extra = [a for a in argv if "=" in a and a.split("=", 1)[0] not in ("model", "layouts", "batch", "seq")]
    common = [*model_overrides(args.get('model', 'gpt2_124m')), f"train.batch_size={args.get('batch', 8)}",
              f"train.seq_len={args.get('seq', 128)}", *extra]
    for name in args.get("layouts", ",".join(LAYOUTS)).split(","):
        ranks, overrides = LAYOUTS[name]
        started = time.perf_counter()
        with tempfile.TemporaryFile("w+") as out:
            done = subprocess.run([sys.executable, str(ROOT / "tests" / "trace_real_rank.py"), "--", str(ranks),
                                   *overrides, *common], stdout=out, stderr=subprocess.PIPE, text=True, cwd=ROOT)
            if done.returncode:
                raise RuntimeError(done.stderr[-3000:])
            out.seek(0)
            reals = json.loads(out.read().strip().splitlines()[-1])
        real_s = time.perf_counter() - started
        started = time.perf_counter()
        roles = trace_roles(compose_config(*overrides, *common, conf=ROOT / "conf"))
        print(f"{name} ({' '.join(common)}): real ranks {real_s:.0f} s, trace {time.perf_counter() - started:.0f} s")
        for role in roles:
            real = reals[role["rank"]]
            cells = []
            for c in ("peak", *CATEGORIES):
                r = real["peak_bytes"] if c == "peak" else real["category_peaks"][c]
                t = role["peak_bytes"] if c == "peak" else role["category_peaks"][c]
                cells.append(f"{c} {r / MB:,.1f}/{t / MB:,.1f}" + (f" ({t / r:.3f})" if r else ""))
            same = "equal" if real["collectives"] == role["collectives"] else "DIFFER"
            print(f"  rank {role['rank']} real/traced MiB: {'; '.join(cells)}; collectives {same}")


if __name__ == "__main__":
    main(sys.argv[1:])
