"""DCP's file writer, checksumming each file as it writes it: what a checkpoint is saved through.

A checkpoint's manifest records the sha256 of every file. Hashing after the save read all of it back (1.5 GB for
gpt2_124m with AdamW) in one process, rank 0, for every rank's files; hashing the bytes on their way to the file
costs no read, and each rank hashes its own files (the manifest gathers them, `own_files`).

The writer also skips torch.save's crc32 of each record (a second checksum of every byte, in the writer's
thread: about 0.7 s per GB on this VM). DCP saves each tensor with torch.save, which computes it by default;
loading does not need it, and the manifest's sha256, checked whenever a checkpoint is reused, covers the
same bytes.
"""
from __future__ import annotations

import hashlib
import io
import threading
from contextlib import contextmanager
from pathlib import Path

import torch
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
        self.written: dict[str, tuple[int, str]] = {}
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
