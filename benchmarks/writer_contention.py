"""How long a checkpoint's write takes beside a thread that runs Python: the model of a background save beside a
training loop that launches a GPU's kernels from Python (each launch holds Python's lock a few microseconds).

DCP's writer thread lets go of Python's lock for every write and checksum, and waits to take it back: a thread
that runs Python gives it back only every `sys.getswitchinterval()` (5 ms by default), so a write of many tensors
waits that long many times. Here the train stage's checkpoint writer (storage.checkpoint.save: DCP, checksummed as
written) writes a state of the model's shapes (its weights and AdamW's two moments, in memory), alone and beside a
thread counting in a Python loop, at each switch interval; printed: the write's time, and the loop's speed beside
it against alone (what the lock costs the loop).

    python benchmarks/writer_contention.py [model=gpt2_124m] [intervals=0.005,0.001] [dir=<a folder on the disk>]
"""
from __future__ import annotations

import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.support.cli import arguments  # noqa: E402


class Spinner:
    """A thread counting in a Python loop until stopped: its count per second is its speed."""

    def __init__(self):
        self.stop, self.count, self.thread = False, 0, threading.Thread(target=self._spin)

    def _spin(self) -> None:
        n = 0
        while not self.stop:
            n += 1
        self.count = n

    def __enter__(self):
        self.began = time.perf_counter()
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop = True
        self.thread.join()
        self.speed = self.count / (time.perf_counter() - self.began)


def model_state(model: str) -> dict:
    """{name: tensor} of the model's shapes, three of each (the weights, AdamW's exp_avg and exp_avg_sq)."""
    import torch

    from benchmarks.gpu import config
    from plugins.models import get_model

    cfg = config(model, 1, 16, "fp32", 1)
    weights = dict(get_model(cfg.model.name).build(cfg.model).named_parameters())  # a tied weight once
    return {f"{part}.{name}": torch.randn(t.shape) for part in ("model", "exp_avg", "exp_avg_sq")
            for name, t in weights.items()}


def timed_write(state: dict, folder: str) -> float:
    from storage import checkpoint as ckpt
    from storage.dcp_writer import HashingWriter
    import torch.distributed.checkpoint as dcp

    with tempfile.TemporaryDirectory(dir=folder) as where:
        began = time.perf_counter()
        with ckpt.quiet_single_process():
            dcp.save(state, storage_writer=HashingWriter(Path(where)))
        return time.perf_counter() - began


def main(argv: list[str]) -> int:
    args = arguments(argv, __doc__)
    intervals = [float(x) for x in args.get("intervals", "0.005,0.001").split(",")]
    state = model_state(args.get("model", "gpt2_124m"))
    gb = sum(t.numel() * t.element_size() for t in state.values()) / 2**30
    print(f"{args.get('model', 'gpt2_124m')}: {len(state)} tensors, {gb:.2f} GB, written with fsync")
    timed_write(state, args.get("dir"))  # once untimed: the first write also pays for the page cache's pages
    with Spinner() as alone:
        time.sleep(2)
    print(f"{'switch interval':>15} {'write alone s':>13} {'beside Python s':>15} {'slower':>7} {'loop speed':>10}")
    default = sys.getswitchinterval()
    try:
        for interval in intervals:
            sys.setswitchinterval(interval)
            by_itself = timed_write(state, args.get("dir"))
            with Spinner() as loop:
                beside = timed_write(state, args.get("dir"))
            print(f"{interval * 1000:>12.1f} ms {by_itself:>13.2f} {beside:>15.2f} {beside / by_itself:>6.2f}x "
                  f"{loop.speed / alone.speed:>9.2f}x")
    finally:
        sys.setswitchinterval(default)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
