"""The content-addressed store of stage outputs.

  <root>/<stage>/<key>/            a complete output: appears in one rename, never modified afterwards;
                                   `_entry.json` lists its files (size, sha256) and what made it; a hit is
                                   checked against it, and a damaged entry is moved to <stage>/.damaged/
  <root>/<stage>/<key>.work/out/   the output being written by the current attempt (cleared per attempt)
  <root>/<stage>/<key>.work/scratch/   state that survives a failed attempt (periodic checkpoints)
  <root>/.locks/<stage>-<key>.lock one writer per key, across processes (sweep points, users)
  <root>/.verified/<stage>-<key>.json  the stamps of an entry's files when they last hashed true (fsio.stamp)

Verification at read speed: a hit (cache_verify=hash) hashes only the files whose stamp differs from the one
recorded when they last verified, so an untouched entry costs a stat per file, and any write to a file (a flipped
byte, a truncation, a file put in its place) changes its stamp and is hashed again. A file whose change time is
within RACY_NS of the stamping is not stamped (it could still change within the same clock tick unseen: git's
"racily clean" rule). Not seen: damage that bypasses the filesystem (bit rot on the disk, a faulty controller);
cache_verify=full hashes every file on every hit for that.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from filelock import FileLock

from storage.fsio import (atomic_write_json, file_table, publish_dir, read_json, remove_tree, stamp,
                          verify_file_table)

ENTRY_FILE = "_entry.json"
RACY_NS = 2 * 10**9  # a file changed this recently is hashed again at the next hit, whatever its stamp


class Cache:
    def __init__(self, root: Path):
        self.root = Path(root)

    def entry(self, stage: str, key: str) -> Path:
        return self.root / stage / key

    def work(self, stage: str, key: str) -> Path:
        return self.root / stage / f"{key}.work"

    def out(self, stage: str, key: str) -> Path:
        return self.work(stage, key) / "out"

    def scratch(self, stage: str, key: str) -> Path:
        return self.work(stage, key) / "scratch"

    def is_complete(self, stage: str, key: str) -> bool:
        return (self.entry(stage, key) / ENTRY_FILE).is_file()

    def verify(self, stage: str, key: str, checksums: bool = True, full: bool = False, record: bool = True
               ) -> list[str]:
        """Problems of a complete entry against its _entry.json (sizes; with checksums, the sha256 of every file whose
        stamp changed since it last verified, or of every file with full). record: keep the stamps of what hashed
        true (not in a dry run, which writes nothing)."""
        try:
            files = self.record(stage, key)["files"]
        except (OSError, ValueError, KeyError) as e:
            return [f"{ENTRY_FILE}: unreadable ({e})"]
        unchanged = frozenset() if full or not checksums else self._unchanged(stage, key)
        problems = verify_file_table(self.entry(stage, key), files, checksums=checksums, unchanged=unchanged)
        if record and checksums and not problems and len(unchanged) < len(files):
            self._record_stamps(stage, key, files)
        return problems

    def hit(self, stage: str, key: str, checksums: bool = True, set_aside: bool = True, full: bool = False
            ) -> tuple[bool, list[str]]:
        """(whether the entry is there and intact, its problems). A damaged entry is moved to <stage>/.damaged/
        (set_aside), so that the stage runs again and publishes a good one under the same key."""
        if not self.is_complete(stage, key):
            return False, []
        problems = self.verify(stage, key, checksums, full, record=set_aside)
        if problems and set_aside:
            moved = self.set_aside(stage, key)
            problems = [*problems, f"moved to {moved}"]
        return not problems, problems

    def _stamps_path(self, stage: str, key: str) -> Path:
        return self.root / ".verified" / f"{stage}-{key}.json"

    def _unchanged(self, stage: str, key: str) -> frozenset[str]:
        """The entry's files whose stamps are those recorded when they last verified (none if _entry.json changed)."""
        entry = self.entry(stage, key)
        try:
            recorded = read_json(self._stamps_path(stage, key))
            if recorded.get(ENTRY_FILE) != stamp(entry / ENTRY_FILE):
                return frozenset()
            return frozenset(rel for rel, st in recorded.items() if rel != ENTRY_FILE and st == stamp(entry / rel))
        except (OSError, ValueError):
            return frozenset()

    def _record_stamps(self, stage: str, key: str, files: dict) -> None:
        entry, now = self.entry(stage, key), time.time_ns()
        stamps = {rel: stamp(entry / rel) for rel in [ENTRY_FILE, *files]}
        settled = {rel: st for rel, st in stamps.items() if now - st[2] > RACY_NS}
        if ENTRY_FILE in settled:
            try:
                atomic_write_json(self._stamps_path(stage, key), settled)
            except OSError:  # a read-only cache still verifies: it hashes every time
                pass

    def set_aside(self, stage: str, key: str) -> Path:
        target = self.root / stage / ".damaged" / f"{key}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        target.parent.mkdir(parents=True, exist_ok=True)
        os.rename(self.entry(stage, key), target)
        self._stamps_path(stage, key).unlink(missing_ok=True)
        return target

    def record(self, stage: str, key: str) -> dict:
        return read_json(self.entry(stage, key) / ENTRY_FILE)

    def lock(self, stage: str, key: str, timeout: float = -1) -> FileLock:
        (self.root / ".locks").mkdir(parents=True, exist_ok=True)
        return FileLock(str(self.root / ".locks" / f"{stage}-{key}.lock"), timeout=timeout)

    def begin(self, stage: str, key: str) -> tuple[Path, Path]:
        """A fresh output folder for a new attempt; the scratch folder of earlier attempts is kept."""
        out, scratch = self.out(stage, key), self.scratch(stage, key)
        remove_tree(out)
        out.mkdir(parents=True)
        scratch.mkdir(parents=True, exist_ok=True)
        return out, scratch

    def publish(self, stage: str, key: str, meta: dict) -> Path:
        """Seal the attempt's output as the entry of (stage, key): manifest, fsync, rename, drop the workspace."""
        out = self.out(stage, key)
        atomic_write_json(out / ENTRY_FILE, {**meta, "stage": stage, "key": key, "published": time.time(),
                                              "host": os.uname().nodename,
                                              "files": file_table(out, exclude=(ENTRY_FILE,))})
        publish_dir(out, self.entry(stage, key))
        remove_tree(self.work(stage, key))
        return self.entry(stage, key)


def link_output(run_dir: Path, stage: str, entry: Path) -> None:
    """run_dir/stages/<stage>/output -> the cache entry: a run folder shows every output it used."""
    link = run_dir / "stages" / stage / "output"
    if entry.exists() and not link.is_symlink():
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(entry, target_is_directory=True)
