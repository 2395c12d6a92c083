"""Content hashes of input files at stat speed: a file's sha256 is reused while its stamp (size, modification and
change times, inode, device: fsio.stamp) is the one it had when it was hashed, the rule the cache uses for its
own entries. An untouched corpus then costs a stat per file per plan; any write through the filesystem changes
the stamp and the file is hashed again.

The remembered hashes live in one JSON file (`remembering(<cache>/.verified/files.json)` around the calls); a
file changed within RACY_NS of its hashing is not remembered (it could change again within the same clock tick).
Without a store, or when it cannot be written (a read-only cache), files are simply hashed.
"""
from __future__ import annotations

import contextlib
import contextvars
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from storage.fsio import atomic_write_json, read_json, sha256_file, stamp

RACY_NS = 2 * 10**9

_store: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("file_hashes", default=None)


@contextlib.contextmanager
def remembering(path: Path) -> Iterator[None]:
    """Within this block, sha256() reuses and records hashes in the JSON file at `path`."""
    path = Path(path)
    try:
        known = read_json(path) if path.is_file() else {}
    except (OSError, ValueError):
        known = {}
    state = {"known": known, "changed": False}
    token = _store.set(state)
    try:
        yield
    finally:
        _store.reset(token)
        if state["changed"]:
            try:
                atomic_write_json(path, state["known"])
            except OSError:  # a read-only cache: hashing again next time is all it costs
                pass


def remembering_in(cache_dir) -> contextlib.AbstractContextManager:
    """remembering(<cache_dir>/.verified/files.json) where the cache exists; else nothing is written (a first dry run,
    a refused input) and every value is computed."""
    store = Path(cache_dir).expanduser() / ".verified" / "files.json"
    return remembering(store) if store.parent.is_dir() else contextlib.nullcontext()


def sha256(path: Path) -> str:
    """The file's sha256, reused while its stamp is unchanged (inside `remembering`)."""
    return remembered(path, lambda p: sha256_file(p))


def remembered(path: Path, compute: Callable[[Path], Any], what: str = "") -> Any:
    """compute(path), a JSON value (a hash, a corpus's smallest and largest ids), reused while the file's stamp is the
    one it had when computed (inside `remembering`); `what` tells a file's values apart."""
    state = _store.get()
    if state is None:
        return compute(path)
    key = str(Path(path).absolute()) + (f"#{what}" if what else "")
    now_stamp = stamp(path)
    known = state["known"].get(key)
    if known and known[0] == now_stamp:
        return known[1]
    value = compute(path)
    if time.time_ns() - now_stamp[2] > RACY_NS and stamp(path) == now_stamp:
        state["known"][key] = [now_stamp, value]
        state["changed"] = True
    return value
