"""How fast this disk takes a checkpoint and an aggregate's files: what the plan times the saves by.

The best figure is a save of the same size measured here: each save and each aggregate records its bytes and
seconds in the store (RECORDS, the last KEPT). A small file written now cannot stand in for a large save: this VM's
disk took 64 MB at 1.4 GB/s and a 1.5 GB checkpoint at 0.25 GB/s (a write cache in front of the disk). So a
record counts for a save at most twice its size, and without one the plan measures a file of the save's own size,
up to PROBE_BYTES, which for a larger save is a floor only."""
from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from storage import measured
from storage.fsio import PROBE_PREFIX

RECORDS = ".disk_speed.json"  # in the store's root
KEPT = 32
PROBE_BYTES = 64 * 2**20  # at most: about 0.2 s on a disk that writes 300 MB/s, paid once per command
MIN_PROBE_BYTES = 2**20
_BLOCK = 2**20


@dataclass(frozen=True)
class Rate:
    bytes_per_s: float
    source: str      # where the figure comes from, for the plan's line
    floor: bool      # measured on less than the save: the time is a lower bound


def aggregate_kind(onnx: bool) -> str:
    """An aggregate's records by whether it made the ONNX model (its check is computation the rate includes)."""
    return "aggregate" if onnx else "aggregate without onnx"


def record(store: Path, what: str, nbytes: int, seconds: float) -> None:
    """Keep what a save ("checkpoint") or an aggregate wrote and took. An estimate's input, never worth a failed
    stage: a store that cannot take it (read-only, full) is left as it is, a damaged record file started anew."""
    if seconds <= 0 or nbytes <= 0:
        return
    measured.append(Path(store) / RECORDS, {"what": what, "bytes": int(nbytes), "seconds": float(seconds),
                                            "when": measured.now()}, KEPT)


def rates_for(store: Path, wanted: dict[str, int]) -> dict[str, Rate]:
    """This disk's rate for writing each `what: bytes` of `wanted`: the newest record of that kind of at least half
    that size, else one file, of the largest such size (up to PROBE_BYTES), written and fsynced in `store` now and
    shared by all of them. Raises OSError when it cannot write."""
    kept = measured.read(Path(store) / RECORDS)
    rates: dict[str, Rate] = {}
    for what, nbytes in wanted.items():
        fitting = [r for r in kept if r.get("what") == what and r.get("bytes", 0) * 2 >= nbytes]
        if fitting:
            r = fitting[-1]
            rates[what] = Rate(r["bytes"] / r["seconds"], f"{what} of {size_text(r['bytes'])} measured here, "
                                                          f"{r['when']}", False)
    unmeasured = {what: n for what, n in wanted.items() if what not in rates}
    if unmeasured:
        rate, probe = write_rate(Path(store), max(unmeasured.values()))
        rates.update({what: Rate(rate, f"a {size_text(probe)} file written and fsynced now", probe < n)
                      for what, n in unmeasured.items()})
    return rates


def write_rate(folder: Path, nbytes: int) -> tuple[float, int]:
    """(bytes/s, bytes written): a new file of `nbytes` (clamped to MIN_PROBE_BYTES..PROBE_BYTES) written in
    `folder` and fsynced, as DCP's writer fsyncs each file of a save, then removed; random bytes, so a compressing
    filesystem cannot cheat."""
    size = max(MIN_PROBE_BYTES, min(nbytes, PROBE_BYTES))
    block = memoryview(os.urandom(_BLOCK))
    fd, probe = tempfile.mkstemp(dir=folder, prefix=f"{PROBE_PREFIX}disk-speed.")  # one a crash left is ignored
    try:
        t0 = time.perf_counter()
        written = 0
        while written < size:
            written += os.write(fd, block[: min(_BLOCK, size - written)])
        os.fsync(fd)
        return size / max(time.perf_counter() - t0, 1e-9), size
    finally:
        os.close(fd)
        os.unlink(probe)


def size_text(nbytes: float) -> str:
    if nbytes < 2**20:
        return f"{nbytes / 2**10:,.1f} KB"
    return f"{nbytes / 2**30:,.2f} GB" if nbytes >= 2**30 else f"{nbytes / 2**20:,.1f} MB"
