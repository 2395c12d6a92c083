"""The content-addressed store of stage outputs.

  <root>/<stage>/<key>/            a complete output: appears in one rename, never modified afterwards;
                                   `_entry.json` lists its files (size, sha256) and what made it; a hit is
                                   checked against it, and a damaged entry is moved to <stage>/.damaged/
  <root>/<stage>/<key>.work/out/   the output being written by the current attempt (cleared per attempt)
  <root>/<stage>/<key>.work/scratch/   state that survives a failed attempt (periodic checkpoints)
  <root>/.locks/<stage>-<key>.lock one writer per key, across processes (sweep points, users)
  <root>/.verified/<stage>-<key>.json  the stamps of an entry's files when they last hashed true (fsio.stamp)
  <root>/.disk_speed.json          what the last saves and aggregates wrote, and took (the plan's time for saves)
  <root>/.stage_times.json         what the last stages run here took (the plan's time per stage)

Verification at read speed: a hit (cache_verify=hash) hashes only the files whose stamp differs from the one
recorded when they last verified, so an untouched entry costs a stat per file, and any write to a file (a flipped
byte, a truncation, a file put in its place) changes its stamp and is hashed again. A file whose change time is
within RACY_NS of the stamping is not stamped (it could still change within the same clock tick unseen: git's
"racily clean" rule). Not seen: damage that bypasses the filesystem (bit rot on the disk, a faulty controller);
cache_verify=full hashes every file on every hit for that.
"""
from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Optional

from filelock import FileLock

from common.problem import Problem
from planning.stage_time import TIMES
from storage.disk_speed import RECORDS
from storage.fsio import (PROBE_PREFIX, KnownHashes, atomic_write_json, file_table, kept_aside, publish_dir,
                          read_json, remove_tree, stamp, verify_file_table)

ENTRY_FILE = "_entry.json"
OWN_FOLDERS = (".locks", ".verified")  # beside one folder per stage
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
            if not self.entry(stage, key).is_dir():
                return False, []
            # an entry appears in one rename with its record inside: without it, something removed the record
            problems = [f"{ENTRY_FILE} is missing (an entry is only trusted with its record)"]
        else:
            problems = self.verify(stage, key, checksums, full, record=set_aside)
        if problems and set_aside:
            try:
                problems = [*problems, f"moved to {self.set_aside(stage, key)}"]
            except OSError as e:  # a read-only cache: the stage must run, which the run refuses with the reason
                problems = [*problems, f"could not be moved aside ({e.strerror})"]
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

    def set_aside(self, stage: str, key: str) -> str:
        """Move a damaged entry to <stage>/.damaged/ (kept until the user removes it); where it went, and its size."""
        target = self.damaged(stage) / f"{key}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        target.parent.mkdir(parents=True, exist_ok=True)
        os.rename(self.entry(stage, key), target)
        self._stamps_path(stage, key).unlink(missing_ok=True)
        return kept_aside(target)

    def discard(self, stage: str, key: str) -> None:
        """Delete an entry nothing needs (a calibration's model): it leaves in one rename, then its files go."""
        with self.lock(stage, key):
            gone = self.work(stage, key).with_suffix(f".discarded-{os.getpid()}")
            with contextlib.suppress(FileNotFoundError):  # discarded already (by a concurrent calibration)
                os.rename(self.entry(stage, key), gone)
                self._stamps_path(stage, key).unlink(missing_ok=True)
                remove_tree(gone)

    def damaged(self, stage: str) -> Path:
        """Where damaged data of a stage is kept for inspection: entries, and the checkpoints of its attempts."""
        return self.root / stage / ".damaged"

    def record(self, stage: str, key: str) -> dict:
        return read_json(self.entry(stage, key) / ENTRY_FILE)

    def lock(self, stage: str, key: str, timeout: float = -1) -> FileLock:
        (self.root / ".locks").mkdir(parents=True, exist_ok=True)
        return FileLock(str(self.root / ".locks" / f"{stage}-{key}.lock"), timeout=timeout)

    def holder(self, stage: str, key: str) -> Path:
        """Who holds the lock of (stage, key): written by the holder as it takes it, for those who wait."""
        return self.root / ".locks" / f"{stage}-{key}.holder.json"

    def begin(self, stage: str, key: str) -> tuple[Path, Path]:
        """A fresh output folder for a new attempt; the scratch folder of earlier attempts is kept."""
        out, scratch = self.out(stage, key), self.scratch(stage, key)
        remove_tree(out)
        out.mkdir(parents=True)
        scratch.mkdir(parents=True, exist_ok=True)
        return out, scratch

    def publish(self, stage: str, key: str, meta: dict, known: Optional[KnownHashes] = None) -> Path:
        """Seal the attempt's output as the entry of (stage, key): manifest, fsync, rename, drop the workspace.
        known: hashes the stage made of its own files (StageContext.hashes), taken where their stamps still hold."""
        out = self.out(stage, key)
        atomic_write_json(out / ENTRY_FILE, {**meta, "stage": stage, "key": key, "published": time.time(),
                                              "host": os.uname().nodename,
                                              "files": file_table(out, exclude=(ENTRY_FILE,), known=known)})
        publish_dir(out, self.entry(stage, key))
        remove_tree(self.work(stage, key))
        return self.entry(stage, key)


def check(cfg) -> list:
    """cache_dir holds a cache or nothing: a cache in a folder of other things (a home folder, a project) is almost
    surely a typo, and the stages would write their folders among them. (Validation says whether it can be
    written, and refuses the filesystem's root.)"""
    from stages import ORDER

    root = Path(cfg.cache_dir).expanduser().absolute()
    inductor = Path(cfg.triton.cache_dir).expanduser().absolute()  # Inductor's cache lives beside the stages
    try:
        names = [] if root == Path(root.anchor) else os.listdir(root)
    except OSError:
        return []
    known = {*ORDER, *OWN_FOLDERS, RECORDS, TIMES, *([inductor.name] if inductor.parent == root else [])}
    foreign = sorted(n for n in names if n not in known and not n.startswith(PROBE_PREFIX))
    if not foreign:
        return []
    shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
    return [Problem("cache_dir", cfg.cache_dir, f"{root} holds other things than cache entries ({shown}); a cache "
                    f"has one folder per stage ({', '.join(ORDER)}), and its stages would write them among yours",
                    "cache_dir= a new or empty folder, or the cache of earlier runs (by default runs/cache)")]


def link_output(run_dir: Path, stage: str, entry: Path) -> None:
    """run_dir/stages/<stage>/output -> the cache entry: a run folder shows every output it used."""
    link = run_dir / "stages" / stage / "output"
    if entry.exists() and not link.is_symlink():
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(entry, target_is_directory=True)
