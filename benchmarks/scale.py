"""Models of any size: every stage's wall time and peak memory at several model sizes, against the model's bytes.

For each size, the whole DAG runs in a fresh cache (`python -m orchestrator ... tracking=none`, one process per
stage, one rank for training) while every process of the run is sampled (psutil, every 0.1 s; a stage's processes
are named <stage>.rank<N>). Printed per size: each stage's wall time and peak RSS, as a ratio to the fp32 weights
(train, export) or to the checkpoint's bytes (aggregate); bytes/s of the checkpoint and aggregate stages and of
cache verification (a full sha256 of the checkpoint entry against a hit of the untouched entry, which stats it);
the bytes the aggregate wrote against what it must write (the weights once, the optimizer state, the ONNX model's
weights), and its rate against this disk's own, measured first in the same run (dd: 2 GB written with fsync, read
back with O_DIRECT); and the plan's estimate of each stage beside the measured peak. Then, at the 0.2B size, `parallel.pp=8` and
`parallel.hp=4`: each train rank's peak RSS against the plan's per-rank estimate. Last, a projection on paper
from these per-byte figures for Llama-3 8B and 70B at 8 ranks per node.

    python benchmarks/scale.py [sizes=50m,200m,350m,520m] [layouts=true] [workdir=/tmp/orchestrator-scale]

Needs about 24 GB of RAM and 40 GB of disk for the 520m size (its train rank peaks near 8 GB, its checkpoint is
6.25 GB); each size's cache is deleted before the next.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.support.cli import arguments  # noqa: E402
from storage.fsio import tree_bytes  # noqa: E402

# GPT family, vocabulary 8192: d_model, n_layers, n_heads, d_ff
SIZES = {"50m": (512, 14, 8, 2048), "200m": (1024, 16, 16, 4096), "350m": (1536, 12, 16, 6144),
         "520m": (2048, 10, 16, 8192), "800m": (2048, 16, 16, 8192)}
COMMON = ["model.vocab_size=8192", "model.max_seq_len=64", "train.steps=2", "train.batch_size=8", "train.seq_len=32",
          "train.eval_batches=1", "train.eval_every=0", "train.checkpoint_every=0", "train.progress=false",
          "tracking=none", "optimizer.warmup_steps=0"]
STAGES = ("tokenize", "export", "transform", "train", "checkpoint", "aggregate")
GB = 2**30


def model_args(size: str) -> list[str]:
    d, n, h, ff = SIZES[size]
    return [f"model.d_model={d}", f"model.n_layers={n}", f"model.n_heads={h}", f"model.d_ff={ff}"]


def run_sampled(args: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess, dict]:
    """`python -m orchestrator args` in cwd, every process of it sampled: {process name: peak RSS}, and stage
    wall times from the first to the last sample of their processes."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
    reader.start()
    peaks: dict[str, int] = {}
    seen: dict[str, list[float]] = {}
    root = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        now = time.time()
        for p in procs:
            try:
                name, rss = p.name(), p.memory_info().rss
            except psutil.NoSuchProcess:
                continue
            name = name if ".rank" in name else "orchestrator"
            peaks[name] = max(peaks.get(name, 0), rss)
            seen.setdefault(name, [now, now])[1] = now
        time.sleep(0.1)
    reader.join()
    result = subprocess.CompletedProcess(proc.args, proc.returncode, "".join(out), "")
    return result, {"peaks": peaks, "seconds": {k: v[1] - v[0] for k, v in seen.items()}}


def stage_of(process: str) -> str:
    """"train.rank3" -> "train" (PR_SET_NAME keeps 15 characters: "checkpoint.rank" is checkpoint's rank 0)."""
    return process.split(".rank")[0]


def run_folder(stdout: str) -> Path:
    return Path(re.search(r"^outputs: (\S+)", stdout, re.M).group(1))


def stage_times(stdout: str) -> dict[str, float]:
    """Each stage's wall time, from the stage table the run prints ("| train | ran | 56.1 s | ...")."""
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^. (\w+)\s+. ran\s+. ([\d.]+) s", stdout, re.M)}


def estimates(args: list[str]) -> dict:
    """The plan's figures for this config (what `python -m orchestrator` prints before it runs)."""
    from planning.plan import partition_plan
    from planning.estimate import estimate, stage_costs
    from orchestrator.config.compose import compose_config

    cfg = compose_config(*args)
    plan = partition_plan(cfg)
    costs = stage_costs(cfg, plan)
    return {"train": estimate(cfg, plan).total, **{k: v.peak for k, v in costs.items()},
            "n_parameters": plan["n_parameters"]}


def verify_speed(cache_root: Path) -> dict:
    """A full hash of the checkpoint entry (cache_verify=full) against a hit of the untouched entry (hash: stamps)."""
    from orchestrator.cache.store import Cache

    cache = Cache(cache_root)
    (key,) = [p.name for p in (cache_root / "checkpoint").iterdir() if not p.name.startswith(".") and
              not p.name.endswith(".work")]
    t0 = time.perf_counter()
    assert cache.verify("checkpoint", key, full=True) == []
    full = time.perf_counter() - t0
    time.sleep(2.1)  # past the racily-clean window of files the run wrote last
    assert cache.verify("checkpoint", key) == []  # hashes what changed since, records the stamps
    t0 = time.perf_counter()
    assert cache.verify("checkpoint", key) == []
    return {"full_s": full, "hit_s": time.perf_counter() - t0}


def disk_speed(work: Path, size_mb: int = 2048) -> dict:
    """This disk's write (fsync included) and uncached read speed, bytes/s, by dd."""
    probe = work / "dd.probe"
    speeds = {}
    for what, cmd in (("write", ["dd", "if=/dev/zero", f"of={probe}", "bs=16M", f"count={size_mb // 16}",
                                 "conv=fsync"]),
                      ("read", ["dd", f"if={probe}", "of=/dev/null", "bs=16M", "iflag=direct"])):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        speeds[what] = size_mb * 2**20 / (time.perf_counter() - t0)
    probe.unlink()
    return speeds


def measure_size(size: str, work: Path) -> dict:
    shutil.rmtree(work / "runs", ignore_errors=True)
    args = [*model_args(size), *COMMON]
    result, sampled = run_sampled(args, work)
    if result.returncode != 0:
        raise SystemExit(f"{size}: the run failed (exit {result.returncode}):\n{result.stdout[-4000:]}")
    run_dir = run_folder(result.stdout)
    cache_root = work / "runs" / "cache"
    manifest = json.loads((run_dir / "stages/checkpoint/output/manifest.json").read_text())
    aggregate = json.loads((run_dir / "stages/aggregate/output/manifest.json").read_text())
    agg_dir = (run_dir / "stages/aggregate/output").resolve()
    row = {"size": size, **estimates(args), "checkpoint_bytes": sum(f["bytes"] for f in manifest["files"].values()),
           "aggregate_bytes": tree_bytes(agg_dir),
           "peaks": {stage_of(k): v for k, v in sampled["peaks"].items()}, "seconds": stage_times(result.stdout),
           "aggregate_phases": aggregate["seconds"], "aggregate_streaming_peak": aggregate["peak_rss_mb"]["eval"] * 2**20,
           "weights_peak": aggregate["peak_rss_mb"]["weights"] * 2**20,
           **verify_speed(cache_root), "plan_saves": re.search(r"^  saves: .*$", result.stdout, re.M).group(0).strip()}
    row["weights_bytes"] = row["n_parameters"] * 4
    optimizer = sum(p.stat().st_size for p in agg_dir.glob("optimizer*.safetensors"))
    onnx = sum(p.stat().st_size for p in agg_dir.glob("model.onnx*"))
    row["aggregate_needed"] = row["weights_bytes"] + optimizer + onnx  # the weights once, optimizer state, ONNX
    row["aggregate_files"] = aggregate["safetensors"]
    shutil.rmtree(work / "runs", ignore_errors=True)
    return row


def measure_layouts(work: Path) -> list[dict]:
    rows = []
    for name, layout in (("pp=8", ["parallel.pp=8", "parallel.microbatches=8"]), ("hp=4", ["parallel.hp=4"])):
        shutil.rmtree(work / "runs", ignore_errors=True)
        args = [*model_args("200m"), *COMMON, *layout]
        result, sampled = run_sampled(args, work)
        if result.returncode != 0:
            raise SystemExit(f"200m {name}: the run failed:\n{result.stdout[-4000:]}")
        ranks = {k: v for k, v in sampled["peaks"].items() if stage_of(k) == "train"}
        rows.append({"layout": name, "estimate": estimates(args)["train"], "ranks": ranks})
        shutil.rmtree(work / "runs", ignore_errors=True)
    return rows


def projection(rows: list[dict]) -> list[str]:
    """Llama-3 8B and 70B on paper: the plan's per-rank estimate for a layout of 8 ranks per node, and the other
    stages from the largest measured size's per-byte figures."""
    from planning.plan import partition_plan
    from planning.estimate import estimate, stage_costs
    from orchestrator.config.compose import compose_config

    big = max(rows, key=lambda r: r["n_parameters"])
    ckpt_rate = big["checkpoint_bytes"] / big["seconds"]["checkpoint"]
    agg_rate = big["checkpoint_bytes"] / big["seconds"]["aggregate"]
    hash_rate = big["checkpoint_bytes"] / big["full_s"]
    llama = ["model=llama_1b", "model.vocab_size=128256", "model.n_kv_heads=8", "model.rope_theta=500000",
             "model.max_seq_len=8192", "train.seq_len=8192", "memory=level1"]
    cases = {"Llama-3 8B, 1 node: dp=8 (FSDP), 1 sequence of 8192 per rank": [
                 *llama, "model.d_model=4096", "model.n_layers=32", "model.n_heads=32", "model.d_ff=14336",
                 "parallel.dp=8", "parallel.dp_mode=shard", "train.batch_size=8"],
             "Llama-3 70B, 8 nodes: hp=8 x pp=8, 8 microbatches of 1 sequence": [
                 *llama, "model.d_model=8192", "model.n_layers=80", "model.n_heads=64", "model.d_ff=28672",
                 "parallel.hp=8", "parallel.pp=8", "parallel.microbatches=8", "train.batch_size=8"]}
    lines = [f"projection (on paper: the plan's estimate per train rank, on GPUs in bf16; the other stages scaled from the "
             f"{big['size']} run's per-byte figures: checkpoint {ckpt_rate / 1e6:,.0f} MB/s, aggregate "
             f"{agg_rate / 1e6:,.0f} MB/s of checkpoint, full hash {hash_rate / 1e6:,.0f} MB/s, on this VM's disk)"]
    for name, args in cases.items():
        cfg = compose_config(*args, "cluster=slurm", "cluster.gpus_per_task=1", "cluster.mem_per_task_gb=80",
                             "precision=bf16")
        plan = partition_plan(cfg)
        costs = stage_costs(cfg, plan)
        ckpt = costs["checkpoint"].writes
        lines.append(f"  {name}: {plan['n_parameters'] / 1e9:,.1f}B parameters, checkpoint {ckpt / 1e9:,.0f} GB; "
                     f"train {estimate(cfg, plan).total / GB:,.1f} GB per rank; export {costs['export'].peak / GB:,.0f}"
                     f" GB; aggregate {costs['aggregate'].peak / GB:,.0f} GB ({costs['aggregate'].what}; "
                     f"{stage_costs(cfg, plan, onnx=False)['aggregate'].peak / GB:,.1f} GB with aggregate.onnx=false), "
                     f"{_dur(ckpt / agg_rate)}, writes {costs['aggregate'].writes / 1e9:,.0f} GB; checkpoint stage "
                     f"{_dur(ckpt / ckpt_rate)}; a cache hit {_dur(big['hit_s'])} against a full hash's "
                     f"{_dur(ckpt / hash_rate)}")
    return lines


def _dur(s: float) -> str:
    return f"{s * 1e3:,.1f} ms" if s < 1 else f"{s:,.1f} s" if s < 120 else f"{s / 60:,.0f} min"


def main() -> None:
    args = arguments(sys.argv[1:], __doc__)
    work = Path(args.get("workdir", "/tmp/orchestrator-scale"))
    work.mkdir(parents=True, exist_ok=True)
    sizes = args.get("sizes", "50m,200m,350m,520m").split(",")
    disk = disk_speed(work)
    print(f"this disk: writes {disk['write'] / 1e6:,.0f} MB/s (fsync), reads {disk['read'] / 1e6:,.0f} MB/s "
          "(O_DIRECT)", flush=True)
    rows = []
    for size in sizes:
        row = measure_size(size, work)
        rows.append(row)
        w, c = row["weights_bytes"], row["checkpoint_bytes"]
        print(f"{size}: {row['n_parameters'] / 1e6:,.0f}M parameters, weights {w / GB:.2f} GB, checkpoint "
              f"{c / GB:.2f} GB, aggregate wrote {row['aggregate_bytes'] / GB:.2f} GB", flush=True)
        for stage in STAGES:
            peak, sec = row["peaks"].get(stage, 0), row["seconds"].get(stage, math.nan)
            base = c if stage in ("checkpoint", "aggregate") else w
            est = row.get(stage)
            print(f"  {stage:<10} {sec:7.1f} s  peak {peak / GB:6.2f} GB = {peak / base:5.2f}x the "
                  f"{'checkpoint' if base == c else 'weights'}" + (f"  (plan: {est / GB:.2f} GB)" if est else ""))
        print(f"  aggregate's weights step (the DCP shards streamed into files, read back): peak "
              f"{row['weights_peak'] / GB:.2f} GB; with the eval (before the ONNX check): "
              f"{row['aggregate_streaming_peak'] / GB:.2f} GB = {row['aggregate_streaming_peak'] / c:.2f}x the checkpoint")
        print(f"  checkpoint {c / row['seconds']['checkpoint'] / 1e6:,.0f} MB/s; aggregate "
              f"{c / row['seconds']['aggregate'] / 1e6:,.0f} MB/s of checkpoint (phases: "
              + ", ".join(f"{k} {v:.1f} s" for k, v in row["aggregate_phases"].items()) + ")")
        written, agg_s = row["aggregate_bytes"], row["seconds"]["aggregate"]
        weights = sum(f["bytes"] for k, f in row["aggregate_files"].items() if k != "optimizer")
        print(f"  aggregate wrote {written / GB:.2f} GB = {written / row['aggregate_needed']:.2f}x what it must "
              f"(weights once + optimizer state + ONNX: {row['aggregate_needed'] / GB:.2f} GB); "
              f"{written / agg_s / 1e6:,.0f} MB/s over the stage = {written / agg_s / disk['write']:.2f}x the disk's "
              f"write speed; its weights step (beside the optimizer state's writer) "
              f"{weights / row['aggregate_phases']['weights'] / 1e6:,.0f} MB/s")
        print(f"  the plan said: {row['plan_saves']}")
        print(f"  cache verification of the checkpoint entry: full hash {row['full_s']:.2f} s "
              f"({c / row['full_s'] / 1e6:,.0f} MB/s), hit of the untouched entry {row['hit_s'] * 1e3:.1f} ms "
              f"({row['hit_s'] / row['full_s']:.2%} of the full hash)", flush=True)
    if args.get("layouts", "true") == "true":
        for row in measure_layouts(work):
            worst = max(row["ranks"].values())
            print(f"200m {row['layout']}: plan {row['estimate'] / GB:.2f} GB per rank; measured train ranks "
                  f"{min(row['ranks'].values()) / GB:.2f}-{worst / GB:.2f} GB: worst {worst / row['estimate']:.2f}x "
                  f"the plan", flush=True)
    print("\n".join(projection(rows)))


if __name__ == "__main__":
    main()
