"""Resume follows the run, not the key: an interrupted train stage is continued after a code change (a new key)
or with another layout (a new key, and a node lost on the way), with the losses of a run never interrupted."""
from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path

import psutil
import pytest

import orchestrator.cache.code_keys as code_keys
from storage.fsio import read_json
from tests.conftest import QUICK, ForkedCommand, cache_entry, killed_after, last_wins, run_debug

ARGS = ["train.steps=12", "train.checkpoint_every=4", "train.eval_every=12", "train.log_every=4",
        "train.batch_size=8", "train.seq_len=32", "model.n_layers=2"]
LOSS_TOLERANCE = 1e-5


def losses(metrics: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


def train_note(run_dir: Path) -> str:
    return next(p["note"] for p in read_json(run_dir / "plan.json") if p["stage"] == "train") or ""


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[float]:
    tmp = tmp_path_factory.mktemp("uninterrupted")
    report = run_debug(tmp, *ARGS)
    return losses(cache_entry(tmp, report, "train") / "metrics.jsonl")


def test_a_code_change_resumes_from_the_interrupted_attempt(tmp_path, monkeypatch, uninterrupted):
    copy = tmp_path / "tree"  # the project's code in a copy: its edit changes the keys as `git pull` would
    for package in code_keys.PACKAGES:
        shutil.copytree(code_keys.ROOT / package, copy / package, ignore=shutil.ignore_patterns("__pycache__"))

    def use_tree() -> None:
        monkeypatch.setattr(code_keys, "ROOT", copy)
        code_keys.source_hash.cache_clear()
        code_keys.reached.cache_clear()

    use_tree()
    with killed_after(9), pytest.raises(KeyboardInterrupt):
        run_debug(tmp_path, *ARGS, name="killed")
    with open(copy / "runtime" / "metrics.py", "a") as f:
        f.write("# a comment: what a fix pulled in, or pip install -U, does to the train stage's key\n")
    use_tree()
    run_debug(tmp_path, *ARGS, "train.resume=false", "dry_run=true", name="plan-fresh")
    assert "resumes" not in train_note(tmp_path / "plan-fresh")  # train.resume=false still starts over
    report = run_debug(tmp_path, *ARGS, name="after-the-fix")
    assert report.exit_code == 0, report.results["train"].error
    assert train_note(tmp_path / "after-the-fix") == "resumes from step 8, written by other code"
    summary = read_json(cache_entry(tmp_path, report, "train") / "summary.json")
    assert summary["resumed_from_step"] == 8 and summary["steps"] == 12
    assert losses(cache_entry(tmp_path, report, "train") / "metrics.jsonl") == \
        pytest.approx(uninterrupted, abs=LOSS_TOLERANCE)


def test_another_layout_resumes_and_back_after_a_lost_rank(tmp_path, uninterrupted):
    """single, interrupted at step 5 -> dp2 hp2 pp2 continues from 4, loses a rank after its step-8 checkpoint ->
    single again continues from 8: the 12 losses of a run that never stopped."""
    with killed_after(5), pytest.raises(KeyboardInterrupt):
        run_debug(tmp_path, *ARGS, name="single-killed")

    big = last_wins([*QUICK, *ARGS, "parallel=dp2_hp2_pp2", "cluster=local", "tracking=none",
                     f"runs_dir={tmp_path / 'runs'}", f"hydra.run.dir={tmp_path / 'big'}"])
    proc = ForkedCommand(big, tmp_path, merged=True)
    scratch = tmp_path / "runs" / "cache" / "train"
    started = []
    try:
        deadline = time.monotonic() + 400
        while not any(scratch.glob("*.work/scratch/checkpoints/step_0000008/manifest.json")):
            assert proc.poll() is None and time.monotonic() < deadline, "the 8-rank run ended before step 8"
            time.sleep(0.05)
        started = psutil.Process(proc.pid).children(recursive=True)
        (rank,) = [p for p in started if p.name() == "train.rank5"]
        rank.send_signal(signal.SIGKILL)  # a node lost: its ranks die
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        psutil.wait_procs(started, timeout=15)
    assert proc.returncode == 1 and "rank 5 of 8: killed by signal SIGKILL" in out, out[-3000:]
    assert train_note(tmp_path / "big") == "resumes from step 4, written by layout dp1 hp1 pp1"

    report = run_debug(tmp_path, *ARGS, name="single-again")
    assert report.exit_code == 0, report.results["train"].error
    assert train_note(tmp_path / "single-again").startswith("resumes from step 8, written by layout dp2 hp2 pp2")
    assert read_json(cache_entry(tmp_path, report, "train") / "summary.json")["resumed_from_step"] == 8
    assert losses(cache_entry(tmp_path, report, "train") / "metrics.jsonl") == \
        pytest.approx(uninterrupted, abs=LOSS_TOLERANCE)
