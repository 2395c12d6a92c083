"""The content-addressed store of stage outputs.

  <root>/<stage>/<key>/            a complete output: appears in one rename, never modified afterwards;
                                   `_entry.json` lists its files (size, sha256) and what made it; a hit is
                                   checked against it, and a damaged entry is moved to <stage>/.damaged/
  <root>/<stage>/<key>.work/out/   the output being written by the current attempt (cleared per attempt)
  <root>/<stage>/<key>.work/scratch/   state that survives a failed attempt (periodic checkpoints)
  <root>/.locks/<stage>-<key>.lock one writer per key, across processes (sweep points, users)
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from filelock import FileLock

from plugins.fsio import atomic_write_json, file_table, publish_dir, read_json, remove_tree, verify_file_table

ENTRY_FILE = "_entry.json"


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

    def verify(self, stage: str, key: str, checksums: bool = True) -> list[str]:
        """Problems of a complete entry against its _entry.json (sizes; with checksums, sha256 too)."""
        try:
            files = self.record(stage, key)["files"]
        except (OSError, ValueError, KeyError) as e:
            return [f"{ENTRY_FILE}: unreadable ({e})"]
        return verify_file_table(self.entry(stage, key), files, checksums=checksums)

    def hit(self, stage: str, key: str, checksums: bool = True, set_aside: bool = True) -> tuple[bool, list[str]]:
        """(whether the entry is there and intact, its problems). A damaged entry is moved to <stage>/.damaged/
        (set_aside), so that the stage runs again and publishes a good one under the same key."""
        if not self.is_complete(stage, key):
            return False, []
        problems = self.verify(stage, key, checksums)
        if problems and set_aside:
            moved = self.set_aside(stage, key)
            problems = [*problems, f"moved to {moved}"]
        return not problems, problems

    def set_aside(self, stage: str, key: str) -> Path:
        target = self.root / stage / ".damaged" / f"{key}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        target.parent.mkdir(parents=True, exist_ok=True)
        os.rename(self.entry(stage, key), target)
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
