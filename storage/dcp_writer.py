"""How a checkpoint's files are written: DCP's file writer, checksumming each file as it writes it.

A checkpoint's manifest records the sha256 of every file. Hashing after the save read all of it back (1.5 GB for
gpt2_124m with AdamW) in one process, rank 0, for every rank's files; hashing the bytes on their way to the file
costs no read, and each rank hashes its own files (`gather_hashes` brings them to rank 0 for the manifest).

The writer also skips torch.save's crc32 of each record (a second checksum of every byte, in the writer's
thread: about 0.7 s per GB on this VM). DCP saves each tensor with torch.save, which computes it by default;
loading does not need it, and the manifest's sha256, checked whenever a checkpoint is reused, covers the
same bytes.

A background write shares Python's lock with training: `quick_handoff` shortens the lock's hand-off while one is
in flight.
"""
from __future__ import annotations

import hashlib
import io
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem


class _HashingFile(io.RawIOBase):
    """A file opened for writing that feeds every byte written to a sha256 as well (DCP writes each file in
    order, from the start, and only appends)."""

    def __init__(self, file):
        super().__init__()
        self.file, self.sha256, self.bytes = file, hashlib.sha256(), 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.sha256.update(view)  # hashlib lets go of Python's lock for large buffers
        self.bytes += view.nbytes
        return self.file.write(view)

    def tell(self) -> int:
        return self.file.tell()

    def flush(self) -> None:
        self.file.flush()

    def fileno(self) -> int:
        return self.file.fileno()


class _HashingFileSystem(FileSystem):
    """DCP's local filesystem, keeping {path: (bytes, sha256)} of each file it wrote (after any rename)."""

    def __init__(self):
        super().__init__()
        self.written: dict[Path, tuple[int, str]] = {}
        self._lock = threading.Lock()  # DCP's writer threads close their files at once

    @contextmanager
    def create_stream(self, path, mode: str):
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with open(path, "wb") as file:
            hashing = _HashingFile(file)
            yield hashing
            file.flush()
        with self._lock:
            self.written[Path(path)] = (hashing.bytes, hashing.sha256.hexdigest())

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        with self._lock:
            if Path(path) in self.written:
                self.written[Path(new_path)] = self.written.pop(Path(path))


@contextmanager
def _without_crc32():
    """torch.save's crc32 off while DCP writes. The setting is the process's, not the thread's: a torch.save
    elsewhere in the process meanwhile (the train stage makes none) would skip it too, which loading allows."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


class HashingWriter(FileSystemWriter):
    """FileSystemWriter (one file per rank, each fsynced) whose `written` says {path below the checkpoint:
    (bytes, sha256)} of the files this rank wrote, hashed as they were written."""

    def __init__(self, path: Path):
        super().__init__(str(path))
        self.root, self.fs = Path(path), _HashingFileSystem()

    @property
    def written(self) -> dict[str, tuple[int, str]]:
        return {path.relative_to(self.root).as_posix(): entry for path, entry in self.fs.written.items()}

    def write_data(self, plan, planner):
        with _without_crc32():
            return super().write_data(plan, planner)


class WrittenHashes:
    """Every rank's {file: (bytes, sha256)} as its writer hashed them, for fsio.file_table's `known`: a file no
    writer hashed is hashed now (none, as DCP writes); one whose size on disk is not what its writer wrote is an
    error, not a checksum of whatever is there."""

    def __init__(self, root: Path, tables: list[dict[str, tuple[int, str]]]):
        self.root, self.files = Path(root), {rel: entry for table in tables for rel, entry in table.items()}

    def get(self, path: Path) -> Optional[str]:
        rel = Path(path).relative_to(self.root).as_posix()
        entry = self.files.get(rel)
        if entry is None:
            return None
        if entry[0] != Path(path).stat().st_size:
            raise RuntimeError(f"{path}: {Path(path).stat().st_size} bytes on disk, its writer wrote {entry[0]}")
        return entry[1]


def gather_hashes(writer: HashingWriter, group: Optional[dist.ProcessGroup]) -> Optional[WrittenHashes]:
    """On rank 0, every rank's files as its writer hashed them (once all are written); None on the others. On
    several nodes each rank hashes only its own files, and rank 0 reads none of theirs. Every rank calls this."""
    if not (dist.is_available() and dist.is_initialized()):
        return WrittenHashes(writer.root, [writer.written])
    tables = [None] * dist.get_world_size(group) if dist.get_rank() == 0 else None
    dist.gather_object(writer.written, tables, dst=0, group=group)
    return WrittenHashes(writer.root, tables) if tables is not None else None


class QuickHandoff:
    """While a background save is written, Python hands its lock from a thread that runs Python to one waiting for
    it after 1 ms instead of 5 (sys.setswitchinterval; the process's setting, put back when the last write in
    flight is published). The writer lets go of the lock for every write and checksum and waits to take it back:
    beside a thread that runs Python (a training loop launching a GPU's kernels), a write of gpt2_124m's shapes
    took 5.5x its time alone at 5 ms and 1.75x at 1 ms; the loop ran at 0.97x and 0.93x its speed meanwhile, so it
    lost about as much work in either case (benchmarks/writer_contention.py, docs/model-size.md)."""

    INTERVAL_S = 0.001

    def __init__(self):
        self.lock, self.writes, self.before = threading.Lock(), 0, None

    def begin(self) -> None:
        with self.lock:
            if self.writes == 0:
                self.before = sys.getswitchinterval()
                sys.setswitchinterval(min(self.before, self.INTERVAL_S))
            self.writes += 1

    def end(self) -> None:
        with self.lock:
            self.writes -= 1
            if self.writes == 0:
                sys.setswitchinterval(self.before)


quick_handoff = QuickHandoff()
