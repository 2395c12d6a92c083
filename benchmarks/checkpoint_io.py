"""Checkpoint throughput: the project's sharded save/load against plain torch.save/torch.load of the same
tensors (each rank's local shards), in the same run, on the same disk; and aggregation throughput.

- save (ours): DCP save + fsync + sha256 manifest + atomic rename, what every checkpoint costs;
- save (dcp only): torch.distributed.checkpoint.save alone;
- torch.save: each rank saves its local shards to one file (fsynced, for a fair comparison);
- load (ours): manifest read + DCP load into the layout (any layout can read it) vs torch.load of the file;
- aggregate: DCP shards -> one plain model and optimizer -> safetensors files (what the aggregate stage
  writes before verifying), on rank 0 after training state is saved.

    python benchmarks/checkpoint_io.py [model=gpt_small] [layout=single] [repeats=3]
    (layout: a parallel= option; several ranks are launched with torch.distributed.run)
"""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.support.cli import arguments  # noqa: E402


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def rank_main(model: str, layout: str, repeats: int, workdir: Path) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    sys.path.insert(0, str(ROOT))
    from storage import checkpoint as ckpt
    from storage import consolidate
    from plugins.data import build_batcher
    from storage.dcp_reader import CheckpointReader
    from storage.fsio import read_json, remove_tree, tree_bytes, verify_file_table
    from plugins.models import get_model
    from runtime.optim import build_optimizer
    from plugins.parallel.layout import build_layout
    from planning.partition import build_plan
    from orchestrator.config.compose import compose_config

    torch.set_num_threads(1 if "WORLD_SIZE" in os.environ else 2)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    cfg = compose_config(f"model={model}", f"parallel={layout}", "train.batch_size=8", "train.seq_len=32")
    plan = build_plan(cfg.model, cfg.parallel)
    spec = get_model(cfg.model.name)
    lay = build_layout(cfg, plan, spec, torch.device("cpu"))
    optimizers = [build_optimizer(cfg.optimizer, part) for part in lay.parts]
    parts = list(zip(lay.parts, optimizers))
    batch = build_batcher(cfg).train_batch(0)
    lay.runner.train_step(lay.local_batch(batch.inputs), lay.local_batch(batch.labels), batch.n_labels)
    for opt in optimizers:  # an optimizer step creates the Adam moments: a checkpoint's real size
        opt.step()

    def barrier():
        if dist.is_initialized():
            dist.barrier()

    def timed(fn) -> float:
        barrier()
        t0 = time.perf_counter()
        fn()
        barrier()
        return time.perf_counter() - t0

    state = ckpt.training_state(parts, lay.aliases)
    local = {k: (v.to_local() if isinstance(v, DTensor) else v) for part in state.values() for k, v in part.items()
             if isinstance(v, torch.Tensor)}
    results: dict[str, list[float]] = {k: [] for k in ("ours", "dcp", "torch.save", "load ours", "torch.load")}
    written: dict[str, int] = {}

    for r in range(repeats):
        ours, raw, plain = workdir / f"ours{r}", workdir / f"raw{r}", workdir / f"plain{r}"
        plain.mkdir(exist_ok=True)
        results["ours"].append(timed(lambda: ckpt.save(ours, parts, {"step": 1, "trainer": {}}, lay.aliases)))
        results["dcp"].append(timed(lambda: dcp.save(ckpt.training_state(parts, lay.aliases), checkpoint_id=str(raw))))

        def plain_save():
            torch.save(local, plain / f"rank{rank}.pt")
            _fsync(plain / f"rank{rank}.pt")

        results["torch.save"].append(timed(plain_save))
        results["load ours"].append(timed(lambda: ckpt.load(ours, parts, lay.aliases)))
        results["torch.load"].append(timed(lambda: torch.load(plain / f"rank{rank}.pt", weights_only=True)))
        barrier()
        written.update({"ours": tree_bytes(ours), "dcp": tree_bytes(raw), "torch.save": tree_bytes(plain)})
        written.update({"load ours": written["ours"], "torch.load": written["torch.save"]})
        if rank == 0:
            for p in (raw, plain) + ((ours,) if r < repeats - 1 else ()):
                remove_tree(p)
    if dist.is_initialized():  # aggregation runs in one process, like the aggregate stage
        dist.destroy_process_group()
    if rank == 0:
        out = workdir / "aggregated"
        t0 = time.perf_counter()  # what the aggregate stage does first: the DCP shards streamed into safetensors
        consolidate.write_from_checkpoint(out, CheckpointReader(workdir / f"ours{repeats - 1}"), [], {})
        aggregate_s = time.perf_counter() - t0
        aggregated = tree_bytes(out)
        med = {k: statistics.median(v) for k, v in results.items()}
        print(f"{model} in layout {layout} ({lay.coords.world_size} rank(s)), median of {repeats}; MB are bytes on disk "
              f"(DCP keeps one copy of what dp replicas share, torch.save writes every rank's)")
        for k in ("ours", "dcp", "torch.save"):
            print(f"  save {k:<11} {med[k]:7.3f} s  {written[k] / 1e6:7.1f} MB  {written[k] / med[k] / 1e6:7.1f} MB/s  "
                  f"({med[k] / med['torch.save']:.2f}x torch.save's time)")
        for k in ("load ours", "torch.load"):
            print(f"  {k:<16} {med[k]:7.3f} s  {written[k] / 1e6:7.1f} MB  {written[k] / med[k] / 1e6:7.1f} MB/s  "
                  f"({med[k] / med['torch.load']:.2f}x torch.load's time)")
        print(f"  aggregate        {aggregate_s:7.3f} s  {aggregated / 1e6:7.1f} MB  {aggregated / aggregate_s / 1e6:7.1f} MB/s"
              f"  (DCP shards -> safetensors, streamed, each file read back and checked)")
        # what reusing it costs when every file is hashed (cache_verify=full; a hit of an untouched entry under the
        # default cache_verify=hash stats the files instead: benchmarks/scale.py measures both)
        folder = workdir / f"ours{repeats - 1}"
        table = read_json(folder / ckpt.MANIFEST)["files"]
        for mode, checksums in (("full", True), ("size", False)):
            t0 = time.perf_counter()
            assert verify_file_table(folder, table, checksums=checksums) == []
            seconds = time.perf_counter() - t0
            print(f"  verify ({mode})    {seconds:7.3f} s  {written['ours'] / 1e6:7.1f} MB  "
                  f"{written['ours'] / seconds / 1e6:9.1f} MB/s  (cache_verify={mode}: what a cache hit costs)")


def main(argv: list[str]) -> None:
    args = arguments(argv, __doc__)
    model, layout, repeats = args.get("model", "gpt_small"), args.get("layout", "single"), int(args.get("repeats", 3))
    world = {"single": 1, "ddp2": 2, "megatron_hp2": 2, "megatron_hp4": 4, "pipeline_pp2": 2,
             "pipeline_pp4_interleaved": 4, "dp2_hp2_pp2": 8}[layout]
    workdir = Path(tempfile.mkdtemp(dir=ROOT / "runs" if (ROOT / "runs").is_dir() else None))
    try:
        if world == 1:
            rank_main(model, layout, repeats, workdir)
        else:
            env = {**os.environ, "PYTHONPATH": str(ROOT), "CKPT_BENCH": f"{model},{layout},{repeats},{workdir}"}
            subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", __file__],
                           env=env, check=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    if os.environ.get("CKPT_BENCH"):
        m, lay, rep, wd = os.environ["CKPT_BENCH"].split(",")
        rank_main(m, lay, int(rep), Path(wd))
    else:
        main(sys.argv[1:])
