"""The memory estimate (planning/estimate.py) against what training really takes, per layout: the worst rank's peak
RSS on a CPU (what `top` shows), or the CUDA allocator's peak.

    python benchmarks/memory_estimate.py [models=gpt_small,gpt2_124m] [layouts=single,ddp2,megatron_hp2,pipeline_pp2]
                                         [batch=8] [seq=256] [steps=3]
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.support.cli import arguments  # noqa: E402

from planning.estimate import estimate  # noqa: E402
from planning.partition import build_plan  # noqa: E402
from orchestrator.config.compose import compose_config  # noqa: E402


def measured_mb(args: list[str], workdir: Path) -> float:
    out = subprocess.run([sys.executable, "-m", "orchestrator", *args, "tracking=none", "train.progress=false"],
                         cwd=workdir, capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    if out.returncode:
        raise RuntimeError(out.stdout[-2000:] + out.stderr[-2000:])
    run_dir = Path(re.search(r"^outputs: (\S+)", out.stdout, re.M).group(1))
    return json.loads((run_dir / "stages/train/output/summary.json").read_text())["peak_memory_mb"]


def main(argv: list[str]) -> None:
    args = arguments(argv, __doc__)
    models = args.get("models", "gpt_small,gpt2_124m").split(",")
    layouts = args.get("layouts", "single,ddp2,megatron_hp2,pipeline_pp2").split(",")
    common = [f"train.batch_size={args.get('batch', 8)}", f"train.seq_len={args.get('seq', 256)}",
              f"train.steps={args.get('steps', 3)}", "train.eval_every=0", "train.checkpoint_every=0"]
    print(f"{'model':<10} {'layout':<14} {'estimate MB':>12} {'measured MB':>12} {'measured/estimate':>18}")
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            for layout in layouts:
                overrides = [f"model={model}", f"parallel={layout}", *common]
                cfg = compose_config(*overrides)
                est = estimate(cfg, build_plan(cfg.model, cfg.parallel)).total / 2**20
                got = measured_mb(overrides, Path(tmp))
                print(f"{model:<10} {layout:<14} {est:>12,.0f} {got:>12,.0f} {got / est:>18.2f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
