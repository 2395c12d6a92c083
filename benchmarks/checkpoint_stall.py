"""How long a checkpoint stops training: the train stage's step with saves every few steps, train.async_checkpoint
disabled (DCP's save: the step waits for the files) against async (DCP's async_save: the state is copied to host
memory and written by a thread while the steps go on), against no save at all; each in a process of its own, on the
same batches, the same disk.

Printed per mode: the steps' wall time, the stall per save (the time over the run without saves, divided by the
saves), how long the save call held the step (async: the copy, and the wait for the save before when the steps since
took less than its write), of which the wait, the checkpoint's bytes, the peak memory (allocated CUDA memory on a GPU;
RSS, where async's staging is) and the plan's estimate of it; then the time the plan gives a save before any was
measured on this disk (a file written now), against the sync save call. Goal: the async stall
<= 0.2x the sync one, where the steps between two saves take longer than one write (on a GPU: raise `every`).
modes= picks among none (no saves: the base, always needed), disabled and async.

    python benchmarks/checkpoint_stall.py [model=gpt2_124m] [batch=4] [seq=128] [steps=12] [every=3] [device=cpu]
                                          [threads=1] [modes=none,disabled,async]

threads: torch's threads for the steps. One leaves the 2-core VM a core for the writer, as a GPU node leaves its
cores to it (its steps run on the GPU); with every core computing, the background write takes its CPU time (memory
copies, checksums) from the steps, and the stall measures that instead.
"""
from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.support.cli import arguments  # noqa: E402

MODES = ("none", "disabled", "async")  # train.async_checkpoint's values; "none": no saves


def one_mode(mode: str, opts: dict, folder: Path) -> dict:
    """This process: the steps, saving every `every` steps as `mode` says; its figures."""
    import torch

    from benchmarks.gpu import StageSide, config, peak_mb
    from planning.estimate import estimate
    from planning.partition import build_plan
    from plugins.data import build_batcher
    from storage import checkpoint as ckpt
    from storage.fsio import tree_bytes

    torch.set_num_threads(opts["threads"])
    device = torch.device(opts["device"])
    cfg = config(opts["model"], opts["batch"], opts["seq"], "fp32", 1000)
    if mode != "none":
        cfg.train.async_checkpoint = mode
    batcher = build_batcher(cfg)
    side = StageSide(cfg, device, [batcher.train_batch(i) for i in range(4)])
    parts = list(zip(side.layout.parts, side.optimizers))
    side.run(1)  # optimizer state exists before the first save, as in training
    pending, saves, in_saves, waited, t0 = None, 0, 0.0, 0.0, time.perf_counter()
    for step in range(2, opts["steps"] + 2):
        side.run(1)
        if mode != "none" and step % opts["every"] == 0:
            path, called = ckpt.step_dir(folder, step), time.perf_counter()
            if pending is not None:
                pending.finish()  # the one before: published by now unless the steps since took less than its write
                waited += time.perf_counter() - called
            if mode == "disabled":
                ckpt.save(path, parts, {"step": step})
            else:
                pending = ckpt.save_async(path, parts, {"step": step})
            saves, in_saves = saves + 1, in_saves + time.perf_counter() - called
    if pending is not None:
        pending.finish()
    side.window.flush()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    written = tree_bytes(folder) // max(saves, 1)
    plan = estimate(cfg, build_plan(cfg.model, cfg.parallel))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"mode": mode, "seconds": seconds, "saves": saves, "save_call_s": in_saves / max(saves, 1),
            "waited_s": waited / max(saves, 1), "bytes_per_save": written, "cuda_gb": peak_mb(side, device) / 2**10,
            "rss_gb": rss / 2**30, "estimate_gb": plan.total / 2**30, "staging_gb": plan.staging / 2**30}


def plan_figure(opts: dict, folder) -> str:
    """What the plan prints for one save of this model before any save was measured on this disk: the
    checkpoint's bytes at the rate of a file written now (storage.disk_speed; a floor when the checkpoint is
    larger than the file). Once a save ran, the plan times the next by it (the sync row above)."""
    from benchmarks.gpu import config
    from planning.estimate import stage_costs
    from planning.partition import build_plan
    from storage.disk_speed import rates_for

    cfg = config(opts["model"], opts["batch"], opts["seq"], "fp32", 1000)
    writes = stage_costs(cfg, build_plan(cfg.model, cfg.parallel))["checkpoint"].writes
    rate = rates_for(Path(folder or tempfile.gettempdir()), {"checkpoint": writes})["checkpoint"]
    return (f"{'at least ' if rate.floor else ''}{writes / rate.bytes_per_s:.2f} s ({writes / 2**30:.2f} GB at "
            f"{rate.bytes_per_s / 2**20:,.0f} MB/s: {rate.source})")


def main(argv: list[str]) -> int:
    args = arguments(argv, __doc__)
    if "mode" in args:  # a child: one mode, its figures on the last line
        opts = json.loads(args["opts"])
        print(json.dumps(one_mode(args["mode"], opts, Path(args["folder"]))))
        return 0
    opts = {"model": args.get("model", "gpt2_124m"), "batch": int(args.get("batch", 4)),
            "seq": int(args.get("seq", 128)), "steps": int(args.get("steps", 12)), "every": int(args.get("every", 3)),
            "device": args.get("device", "cpu"), "threads": int(args.get("threads", 1))}
    print(f"{opts['model']}, batch {opts['batch']} x {opts['seq']}, {opts['steps']} steps, a save every "
          f"{opts['every']}, on {opts['device']} ({opts['threads']} torch thread(s)); each mode in a process of its own")
    modes = args.get("modes", ",".join(MODES)).split(",")
    results = {}
    for mode in modes:
        with tempfile.TemporaryDirectory(dir=args.get("dir")) as folder:
            done = subprocess.run([sys.executable, __file__, f"mode={mode}", f"opts={json.dumps(opts)}",
                                   f"folder={folder}"], capture_output=True, text=True, cwd=ROOT)
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            return 1
        results[mode] = json.loads(done.stdout.splitlines()[-1])
    base = results["none"]["seconds"]  # modes= must name none
    print(f"{'train.async_checkpoint':<22} {'steps s':>8} {'stall/save s':>12} {'save call s':>11} {'waited s':>8} "
          f"{'GB/save':>8} {'peak CUDA':>9} {'peak RSS':>9} {'estimate':>9} {'staging':>8}")
    for mode in modes:
        r = results[mode]
        stall = (r["seconds"] - base) / r["saves"] if r["saves"] else 0.0
        r["stall"] = stall
        print(f"{'(no saves)' if mode == 'none' else mode:<22} {r['seconds']:>8.2f} {stall:>12.2f} "
              f"{r['save_call_s']:>11.2f} {r['waited_s']:>8.2f} {r['bytes_per_save'] / 2**30:>8.2f} "
              f"{r['cuda_gb']:>8.2f}G {r['rss_gb']:>8.2f}G "
              f"{r['estimate_gb']:>8.2f}G {r['staging_gb']:>7.2f}G")
    print(f"the plan's time for a save before any was measured here: {plan_figure(opts, args.get('dir'))}")
    if {"async", "disabled"} <= results.keys() and results["disabled"]["stall"] > 0:
        print(f"async stall / sync stall: {results['async']['stall'] / results['disabled']['stall']:.2f} "
              f"(goal <= 0.2)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
