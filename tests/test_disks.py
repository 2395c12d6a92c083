"""Disks that refuse writes: one that fills mid-run (the whole runs folder, rank logs included, on a small tmpfs
filled while the train stage runs, so that its next checkpoint meets a real ENOSPC), and a read-only cache."""
from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import QUICK, ForkedCommand, run_cli
from tests.test_cli_e2e import _wait_for

pytestmark = pytest.mark.e2e
ARGS = ["data.max_bytes=2000000", "train.steps=220", "train.checkpoint_every=100", "train.eval_every=0",
        "train.log_every=10", "train.batch_size=16", "train.seq_len=96", "tracking=none"]


@contextlib.contextmanager
def small_disk(where: Path, mb: int):
    """A tmpfs of `mb` MB at `where`, unmounted at the end (it needs root, as the SLURM tests' namespaces do)."""
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mb}m", "tmpfs", str(where)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.fail(f"this test mounts a tmpfs, which needs root: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "--lazy", str(where)], check=False)


@contextlib.contextmanager
def read_only(folder: Path):
    """The folder, bind-mounted read-only over itself until the end (root: permissions do not stop root)."""
    subprocess.run(["mount", "--bind", str(folder), str(folder)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(folder)], check=True)
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=False)


def fill(disk: Path, leave: int) -> Path:
    """Take all of the disk's free space but `leave` bytes with one file."""
    st = os.statvfs(disk)
    filler = disk / "filler"
    with open(filler, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, max(st.f_bavail * st.f_frsize - leave, 1))
    return filler


def test_a_disk_that_fills_mid_run_is_named_and_the_same_command_continues_once_freed(tmp_path):
    with small_disk(tmp_path / "disk", 160) as disk:
        proc = ForkedCommand(ARGS, disk, merged=True)
        try:
            history = disk / "runs" / "cache" / "train"
            _wait_for(lambda: any(len(p.read_text().splitlines()) >= 110
                                  for p in history.glob("*.work/scratch/metrics.jsonl")), 300, "110 training steps")
            filler = fill(disk, leave=2**20)  # the checkpoint of step 200 needs about 5 MB
            out, _ = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 1, out[-3000:]
        assert "no space left on the device to write the checkpoint" in out and "step_0000200" in out, out[-3000:]
        assert f"MB free on the disk mounted at {disk}" in out and "MB needed by this rank" in out
        assert "run the same command to continue" in out
        (scratch,) = history.glob("*.work/scratch")
        assert not list((scratch / "checkpoints").glob(".step_*.partial"))  # no half-written folder holds the disk
        assert sorted(p.name for p in (scratch / "checkpoints").glob("step_*")) == ["step_0000100"]

        filler.unlink()
        again = run_cli(ARGS, disk)
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
        assert "resumes from step 100" in again.stdout


def test_a_read_only_cache_serves_a_cached_rerun_and_refuses_a_run_that_must_write(tmp_path):
    first = run_cli([*QUICK, "tracking=none"], tmp_path)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    with read_only(tmp_path / "runs" / "cache"):
        again = run_cli([*QUICK, "tracking=none"], tmp_path)
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
        assert again.stdout.count(" cached ") >= 6 and "Traceback" not in again.stderr
        other = run_cli([*QUICK, "tracking=none", "train.steps=3"], tmp_path)
    assert other.returncode == 2, other.stdout[-3000:] + other.stderr[-3000:]
    assert "x cache_dir=" in other.stderr and "train, checkpoint, aggregate must run and write their outputs" in \
        other.stderr and "Read-only file system" in other.stderr and "Traceback" not in other.stderr
