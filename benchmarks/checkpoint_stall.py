"""How long a checkpoint stops training: the train stage's step, with train.async_checkpoint disabled (DCP's save:
the step waits for the files) and async (DCP's async_save: the state is copied to host memory and written by a thread
while the steps go on); each in a process of its own, on the same batches, the same disk.

Each process runs `saves` rounds: `every` steps without a save, then a save and `every` steps, the save finished
(published) by the round's end, where the next save would wait for it. The stall per save is the time of the
steps with a save over those without, in the same process and interleaved in time, so that the VM's drift between
processes (4 s in 40) does not enter it. Printed per mode: both times, the stall per save, how long the save call
held the step (async: the copy to host memory), how long the round's end waited for the write (async: the steps
after the save took less than it), the checkpoint's bytes, the peak memory (allocated CUDA memory on a GPU; RSS,
where async's staging is) and the plan's estimate of it; then the time the plan gives a save before any was
measured on this disk (a file written now), against the sync save call. Goal: the async stall <= 0.2x the sync
one, where `every` steps take longer than one write (on a GPU: raise `every`).

    python benchmarks/checkpoint_stall.py [model=gpt2_124m] [batch=4] [seq=128] [saves=3] [every=3] [device=cpu]
                                          [threads=1] [modes=disabled,async]

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

MODES = ("disabled", "async")  # train.async_checkpoint's values


def one_mode(mode: str, opts: dict, folder: Path) -> dict:
    """This process: `saves` rounds of `every` steps without a save, then a save and `every` steps, the save
    finished (published) before the round ends; its figures."""
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
    cfg.train.async_checkpoint = mode
    batcher = build_batcher(cfg)
    side = StageSide(cfg, device, [batcher.train_batch(i) for i in range(4)])
    parts = list(zip(side.layout.parts, side.optimizers))

    def now() -> float:  # once every step launched so far has run
        side.window.flush()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    side.run(1)  # optimizer state exists before the first save, as in training
    plain = saving = in_calls = waited = 0.0
    for round_ in range(opts["saves"]):
        began = now()
        side.run(opts["every"])
        plain += now() - began
        began, path = now(), ckpt.step_dir(folder, round_)
        if mode == "disabled":  # the stage's aliases: a tied weight saved once, under the name it copies
            ckpt.save(path, parts, {"step": round_}, side.layout.aliases)
        else:
            pending = ckpt.save_async(path, parts, {"step": round_}, side.layout.aliases)
        in_calls += time.perf_counter() - began
        side.run(opts["every"])
        if mode == "async":
            called = now()
            pending.finish()  # where the next save would wait for it: the steps since took less than its write
            waited += time.perf_counter() - called
        saving += now() - began
    saves = opts["saves"]
    plan = estimate(cfg, build_plan(cfg.model, cfg.parallel))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"mode": mode, "plain_s": plain, "saving_s": saving, "stall_s": (saving - plain) / saves,
            "save_call_s": in_calls / saves, "waited_s": waited / saves,
            "bytes_per_save": tree_bytes(folder) // saves, "cuda_gb": peak_mb(side, device) / 2**10,
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
            "seq": int(args.get("seq", 128)), "saves": int(args.get("saves", 3)), "every": int(args.get("every", 3)),
            "device": args.get("device", "cpu"), "threads": int(args.get("threads", 1))}
    print(f"{opts['model']}, batch {opts['batch']} x {opts['seq']}, {opts['saves']} rounds of {opts['every']} steps "
          f"then a save and {opts['every']} steps, on {opts['device']} ({opts['threads']} torch thread(s)); each "
          f"mode in a process of its own")
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
    print(f"{'train.async_checkpoint':<22} {'no save s':>9} {'saving s':>8} {'stall/save s':>12} {'save call s':>11} "
          f"{'waited s':>8} {'GB/save':>8} {'peak CUDA':>9} {'peak RSS':>9} {'estimate':>9} {'staging':>8}")
    for mode in modes:
        r = results[mode]
        print(f"{mode:<22} {r['plain_s']:>9.2f} {r['saving_s']:>8.2f} {r['stall_s']:>12.2f} {r['save_call_s']:>11.2f} "
              f"{r['waited_s']:>8.2f} {r['bytes_per_save'] / 2**30:>8.2f} {r['cuda_gb']:>8.2f}G {r['rss_gb']:>8.2f}G "
              f"{r['estimate_gb']:>8.2f}G {r['staging_gb']:>7.2f}G")
    print(f"the plan's time for a save before any was measured here: {plan_figure(opts, args.get('dir'))}")
    if {"async", "disabled"} <= results.keys() and results["disabled"]["stall_s"] > 0:
        print(f"async stall / sync stall: {results['async']['stall_s'] / results['disabled']['stall_s']:.2f} "
              f"(goal <= 0.2)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
