"""Durable file operations: write, fsync, rename. Readers never see half-written files or folders.

A folder is published by building it under a temporary name, fsyncing every file and the folder, then
renaming it into place (atomic on POSIX within one filesystem) and fsyncing the parent, so a crash at any
moment leaves either the complete folder or none.
"""
from __future__ import annotations

import contextvars
import errno
import hashlib
import json
import os
import shutil
import stat
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

UMASK = os.umask(0)  # the process's, read once (setting it is the only way to read it)
os.umask(UMASK)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and folder below root (files first, then their folders)."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            p = os.path.join(dirpath, name)
            if os.path.islink(p):
                continue
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~UMASK)  # mkstemp makes 0600: give the file the mode any other file gets
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode())


def read_json(path: Path) -> Any:
    with open(path) as f:
        return json.load(f)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def iter_files(root: Path, exclude: tuple[str, ...] = ()) -> Iterator[Path]:
    """Regular files below root, sorted, as paths relative to root."""
    for p in sorted(Path(root).rglob("*")):
        rel = p.relative_to(root)
        if p.is_file() and not p.is_symlink() and rel.as_posix() not in exclude:
            yield rel


def tree_bytes(root: Path) -> int:
    """The bytes of the regular files below root (0 when root is not a folder)."""
    return sum((Path(root) / rel).stat().st_size for rel in iter_files(root)) if Path(root).is_dir() else 0


HASHING_THREADS = 8  # files hashed at once, at most


def digests(paths: list[Path], digest: Optional[Callable[[Path], str]] = None) -> list[str]:
    """digest(path) (default sha256_file) of each path, several files at once: reading and hashlib release Python's
    lock, so each thread takes a core. A checkpoint of many ranks' files, or an aggregate's shards, is hashed at
    the speed of the disk or of the cores rather than of one core (sha256: about 1.5 GB/s; a 70B checkpoint's
    834 GB took 9 min in one thread). The caller's context variables (file_hashes' store) hold in each thread."""
    digest = digest or sha256_file
    workers = min(len(paths), os.cpu_count() or 1, HASHING_THREADS)
    if workers <= 1:
        return [digest(p) for p in paths]
    caller = contextvars.copy_context()
    with ThreadPoolExecutor(workers, thread_name_prefix="sha256") as pool:
        return list(pool.map(lambda p: caller.copy().run(digest, p), paths))


class KnownHashes:
    """sha256 of files as a stage computed them for its own check, reused while each file's stamp holds (the stamp
    taken before hashing, and unchanged after it): the cache's file table then does not read those files again.
    The checkpoint stage checks the checkpoint against its manifest once, and that pass is the entry's table."""

    def __init__(self):
        self._seen: dict[str, tuple[list[int], str]] = {}

    def sha256(self, path: Path) -> str:
        before = stamp(path)
        digest = sha256_file(path)
        if stamp(path) == before:
            self._seen[str(Path(path).absolute())] = (before, digest)
        return digest

    def add(self, path: Path, digest: str) -> None:
        """The sha256 of a file just written, taken from its bytes on their way to it (its stamp taken now)."""
        self._seen[str(Path(path).absolute())] = (stamp(path), digest)

    def get(self, path: Path) -> Optional[str]:
        known = self._seen.get(str(Path(path).absolute()))
        return known[1] if known is not None and known[0] == stamp(path) else None


def file_table(root: Path, exclude: tuple[str, ...] = (), known: Optional[KnownHashes] = None) -> dict[str, dict]:
    """{relative path: {bytes, sha256}} of every file below root (known: hashes already made, still valid)."""
    rels = list(iter_files(root, exclude))
    hashes = {rel: known.get(root / rel) if known is not None else None for rel in rels}
    missing = [rel for rel, h in hashes.items() if h is None]
    hashes.update(zip(missing, digests([root / rel for rel in missing])))
    return {rel.as_posix(): {"bytes": (root / rel).stat().st_size, "sha256": hashes[rel]} for rel in rels}


def verify_file_table(root: Path, table: dict[str, dict], checksums: bool = True,
                      unchanged: frozenset[str] = frozenset(), digest=None) -> list[str]:
    """Problems found comparing the files below root with a file_table(); empty when everything matches.
    unchanged: files known to be as they were when last hashed (their sizes are still checked). digest: the
    sha256 of a path (default sha256_file; storage/file_hashes.sha256 reuses a hash while the file's stamp holds)."""
    found: dict[str, str] = {}
    for rel, want in table.items():
        p = Path(root) / rel
        if not p.is_file():
            found[rel] = f"{rel}: missing"
        elif p.stat().st_size != want["bytes"]:
            found[rel] = f"{rel}: {p.stat().st_size} bytes, manifest says {want['bytes']}"
    to_hash = [rel for rel in table if rel not in found and checksums and rel not in unchanged]
    for rel, h in zip(to_hash, digests([Path(root) / rel for rel in to_hash], digest)):
        if h != table[rel]["sha256"]:
            found[rel] = f"{rel}: sha256 differs from the manifest"
    return [found[rel] for rel in table if rel in found]


def stamp(path: Path) -> list[int]:
    """What changes whenever a file's content is written through the filesystem: size, modification and change
    times (the change time cannot be set back by anyone, `touch -d` included), inode and device (a file put in
    its place by a rename)."""
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def publish_dir(src: Path, dst: Path) -> None:
    """Make the finished folder src appear at dst in one step (dst must not exist yet)."""
    src, dst = Path(src), Path(dst)
    fsync_tree(src)
    dst.parent.mkdir(parents=True, exist_ok=True)
    os.rename(src, dst)  # fails if dst exists and is not empty: a complete entry is never replaced
    fsync_dir(dst.parent)


def disk_space(path: Path, needed: int = 0) -> str:
    """A sentence on the free space where path lives (for messages about failed writes)."""
    where = Path(path).absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return ""
    text = f" ({free / 2**20:,.1f} MB free on that disk"
    return text + (f", {needed / 2**20:,.1f} MB needed)" if needed else ")")


def remove_tree(path: Path) -> None:
    """Delete a folder; renamed aside first so a crash mid-delete never leaves a partial folder under its name."""
    path = Path(path)
    if not path.exists():
        return
    doomed = path.with_name(f".{path.name}.deleting.{os.getpid()}")
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def link_tree(src: Path, dst: Path) -> None:
    """Recreate the files of src under dst as hard links (copies across filesystems). Cheap for large,
    never-modified files such as published checkpoints."""
    src, dst = Path(src), Path(dst)
    for rel in iter_files(src):
        target = dst / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src / rel, target)
        except OSError:
            shutil.copy2(src / rel, target)


PROBE_PREFIX = ".orchestrator-probe-"  # the folder why_unwritable makes and removes at once


def why_unwritable(path) -> str:
    """Why a folder cannot be created or written at path ('' when it can)."""
    import tempfile

    p = Path(path).expanduser().absolute()
    while not p.exists():
        p = p.parent
    if not p.is_dir():
        return f"{p} is a file, not a folder"
    try:  # the one sure test (permissions, read-only mounts, /proc): make a folder there, and remove it
        os.rmdir(tempfile.mkdtemp(dir=p, prefix=PROBE_PREFIX))
    except OSError as e:
        return f"no folder can be made in {p} ({e.strerror})"
    return ""


_KINDS = {stat.S_IFIFO: "a named pipe (FIFO)", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFDIR: "a folder"}


def why_not_a_file(path) -> str:
    """Why path cannot be read as a regular file ('' when it can): reading a named pipe or a device blocks or
    never ends, and a symbolic link loop looks like a missing file to Path.exists()."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "is a symbolic link loop"
        if os.path.islink(path):
            return f"is a broken symbolic link (to {os.readlink(path)})"
        return "does not exist" if e.errno == errno.ENOENT else f"cannot be read ({e.strerror})"
    if stat.S_ISREG(mode):
        return ""
    return f"is {_KINDS.get(stat.S_IFMT(mode), 'not a regular file')}, not a regular file"


def kept_aside(path: Path) -> str:
    """A sentence on data set aside: where it is, its size, that it stays until removed."""
    return f"{path} ({tree_bytes(path) / 2**20:,.1f} MB, kept for inspection: remove it when done)"
