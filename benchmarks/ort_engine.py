"""engine=ort against engine=torch: step time, alternating in one process, and the ORT set-up costs.

For each model and thread count, two single-process layouts are built from the same weights, one with
every block's units in ONNX Runtime; the orchestrator's own train_step (forward, backward, clipping,
AdamW) runs ROUNDS alternating rounds of STEPS steps on each; the ratio is the median over rounds of the
median step times. Set-up: export and transform stage times (in-process runs, so no process start-up),
and ONNX Runtime session creation when the graphs come from the cache.

    python benchmarks/ort_engine.py [models=gpt_tiny,gpt_small] [threads=1,2] [steps=8] [rounds=5]
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.support.cli import arguments  # noqa: E402

from orchestrator.run import orchestrate  # noqa: E402
from plugins.data import build_batcher  # noqa: E402
from plugins.engines.ort.engine import install  # noqa: E402
from storage.fsio import read_json  # noqa: E402
from runtime.metrics import MemoryProbe  # noqa: E402
from plugins.models import get_model  # noqa: E402
from runtime.optim import build_optimizer  # noqa: E402
from plugins.parallel.layout import build_layout  # noqa: E402
from runtime.step import StepSettings, train_step  # noqa: E402
from orchestrator.config.compose import compose_config  # noqa: E402


def prepare(model: str, tmp: Path) -> tuple[Path, dict]:
    """Run the DAG once in-process (engine=ort, 1 step): the graphs land in the cache; stage times."""
    args = ["cluster=debug", "tracking=none", "engine=ort", f"model={model}", "train.steps=1", "train.progress=false",
            "train.log_every=0"]
    report = orchestrate(compose_config(*args, runs_dir=tmp / "runs"), tmp / "run", args)
    key = report.results["transform"].key
    return tmp / "runs" / "cache" / "transform" / key, {n: r.seconds for n, r in report.results.items()}


def measure(cfg, layout, spec, batcher, steps: int, first_step: int) -> float:
    optimizers = [build_optimizer(cfg.optimizer, p) for p in layout.parts]
    settings, probe = StepSettings.of(cfg), MemoryProbe(torch.device("cpu"))
    times = []
    for step in range(first_step, first_step + steps):
        row = train_step(layout, optimizers, batcher.train_batch(step), step, cfg.optimizer.lr, settings, probe)
        times.append(row["step_time_s"])
    return statistics.median(times[1:])


def main(argv: list[str]) -> None:
    args = arguments(argv, __doc__)
    models = args.get("models", "gpt_tiny,gpt_small").split(",")
    thread_counts = [int(t) for t in args.get("threads", "1,2").split(",")]
    steps, rounds = int(args.get("steps", 8)), int(args.get("rounds", 5))
    t0 = time.perf_counter()
    from onnxruntime.capi import _pybind_state  # noqa: F401  (once per process; not part of a stage's cost below)
    print(f"importing ONNX Runtime's training build: {time.perf_counter() - t0:.2f} s (once per process)")
    for model in models:
        with tempfile.TemporaryDirectory() as tmp:
            transform, stage_s = prepare(model, Path(tmp))
            cfg = compose_config("engine=ort", f"model={model}")
            spec = get_model(cfg.model.name)
            plan = read_json(transform / "partition_plan.json")
            batcher = build_batcher(cfg)
            t0 = time.perf_counter()
            probe_layout = build_layout(cfg, plan, spec, torch.device("cpu"))
            install(probe_layout.parts, spec, transform / "ort", cfg.engine, None, torch.device("cpu"), 0)
            session_s = time.perf_counter() - t0
            print(f"{model}: export {stage_s['export']:.2f} s, transform (passes + gradient graphs) "
                  f"{stage_s['transform']:.2f} s; on a cache hit, model + ORT sessions {session_s:.2f} s; "
                  f"batch {cfg.train.batch_size}x{cfg.train.seq_len}")
            for threads in thread_counts:
                torch.set_num_threads(threads)
                layouts = {}
                for engine in ("torch", "ort"):
                    layouts[engine] = build_layout(cfg, plan, spec, torch.device("cpu"))
                    if engine == "ort":
                        install(layouts[engine].parts, spec, transform / "ort", cfg.engine, None,
                                torch.device("cpu"), 0)
                ratios, results = [], {"torch": [], "ort": []}
                for r in range(rounds):
                    order = ("torch", "ort") if r % 2 == 0 else ("ort", "torch")
                    for engine in order:
                        results[engine].append(measure(cfg, layouts[engine], spec, batcher, steps, r * steps))
                    ratios.append(results["ort"][-1] / results["torch"][-1])
                print(f"  {threads} thread(s): torch {statistics.median(results['torch']) * 1e3:.1f} ms/step, "
                      f"ort {statistics.median(results['ort']) * 1e3:.1f} ms/step, ort/torch "
                      f"{statistics.median(ratios):.2f}x (rounds {min(ratios):.2f}-{max(ratios):.2f})", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
