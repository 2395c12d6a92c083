"""triton=on / triton=off step time, and compile times, on this machine (CPU: Inductor's C++ kernels; GPU:
Triton kernels when CUDA is available).

For each model, one process holds an eager and a compiled copy (same weights, blocks compiled as the train
stage compiles them) and alternates rounds of steps between them after warm-up; the first compiled step of a
cold Inductor cache is the first-run compile time; a second process with the now warm cache measures the
cached compile time.

    python benchmarks/kernels.py [models=gpt_tiny,gpt_small] [rounds=5] [steps=5] [batch=16] [seq=128] [threads=all]
"""
from __future__ import annotations

import copy
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.support.cli import arguments  # noqa: E402
from runtime.kernels import apply_kernels  # noqa: E402
from plugins.models import get_model  # noqa: E402
from orchestrator.config.compose import compose_config  # noqa: E402


def setup(model: str, cache_dir: str, batch: int, seq: int):
    cfg = compose_config(f"model={model}", "triton=on", f"train.batch_size={batch}", f"train.seq_len={seq}")
    OmegaConf.update(cfg, "triton.cache_dir", cache_dir)
    spec = get_model(cfg.model.name)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    eager = spec.build(cfg.model)
    spec.init_weights(eager, cfg.model, 0)
    eager.to(device)
    compiled = copy.deepcopy(eager)
    apply_kernels([compiled], spec, cfg.triton, logging.getLogger("bench"), cuda=device.type == "cuda")
    ids = torch.randint(0, cfg.model.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)

    def step_fn(model, opt):
        def step():
            t0 = time.perf_counter()
            loss = spec.loss(model(ids[:, :-1]), ids[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - t0
        return step

    return (step_fn(eager, torch.optim.AdamW(eager.parameters(), lr=1e-4)),
            step_fn(compiled, torch.optim.AdamW(compiled.parameters(), lr=1e-4)))


def child(model: str, cache_dir: str, rounds: int, steps: int, batch: int, seq: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    eager, compiled = setup(model, cache_dir, batch, seq)
    first = compiled()  # compiles (cold cache) or loads the kernels (warm cache)
    eager()
    for _ in range(2):  # warm-up both
        eager(), compiled()
    times = {"off": [], "on": []}
    for _ in range(rounds):
        times["off"] += [eager() for _ in range(steps)]
        times["on"] += [compiled() for _ in range(steps)]
    return {"first_compiled_step_s": first, "off_s": statistics.median(times["off"]),
            "on_s": statistics.median(times["on"])}


def run_child(model: str, cache_dir: str, *nums: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", model, cache_dir, *map(str, nums)],
                         capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stdout[-3000:] + out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> None:
    if argv and argv[0] == "--child":
        model, cache_dir, *nums = argv[1:]
        print(json.dumps(child(model, cache_dir, *map(int, nums))))
        return
    args = arguments(argv, __doc__)
    models = args.get("models", "gpt_tiny,gpt_small").split(",")
    rounds, steps, batch, seq, threads = (int(args.get(k, d)) for k, d in (
        ("rounds", 5), ("steps", 5), ("batch", 16), ("seq", 128), ("threads", os.cpu_count() or 1)))
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {threads} threads"
    print(f"{where}; batch {batch} x {seq}; median step of {rounds} alternating rounds x {steps} steps")
    for model in models:
        with tempfile.TemporaryDirectory() as cache:
            cold = run_child(model, cache, rounds, steps, batch, seq, threads)
            warm = run_child(model, cache, rounds, steps, batch, seq, threads)
        eager_step = statistics.median([cold["off_s"], warm["off_s"]])
        compiled_step = statistics.median([cold["on_s"], warm["on_s"]])
        print(f"{model:<10} off {eager_step * 1e3:7.1f} ms  on {compiled_step * 1e3:7.1f} ms  "
              f"on/off {compiled_step / eager_step:.2f}x (per process: {cold['on_s'] / cold['off_s']:.2f}x, "
              f"{warm['on_s'] / warm['off_s']:.2f}x) | first compiled step: cold cache "
              f"{cold['first_compiled_step_s']:.1f} s, warm cache {warm['first_compiled_step_s']:.1f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
