"""Nothing lost, nothing stuck: damaged checkpoints and cache entries are set aside and rebuilt, divergence stops
training, text from users and processes is printed as text. (Issue "Nothing lost, nothing stuck"; the rows of
its table are named in each test.)"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from orchestrator.report import console
from storage import checkpoint as ckpt
from storage.fsio import read_json
from tests.conftest import cache_entry as entry, killed_after, run_debug as run


def flip(path: Path, at: float = 0.5, n: int = 64) -> None:
    data = bytearray(path.read_bytes())
    start = int(len(data) * at)
    for i in range(start, min(start + n, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def scratch_checkpoints(tmp_path: Path) -> Path:
    (work,) = (tmp_path / "runs" / "cache" / "train").glob("*.work")
    return work / "scratch" / "checkpoints"


# -- row 1 and 11: a damaged newest checkpoint ------------------------------------------------------------------

def test_damaged_newest_checkpoint_is_set_aside_and_the_run_finishes(tmp_path):
    args = ("train.steps=12", "train.checkpoint_every=3")
    with killed_after(8), pytest.raises(KeyboardInterrupt):
        run(tmp_path, *args, name="killed")
    root = scratch_checkpoints(tmp_path)
    assert [s for s, _ in ckpt.complete_checkpoints(root)] == [3, 6]
    flip(next(ckpt.step_dir(root, 6).glob("*.distcp")))
    (root / "step_0000009").mkdir()  # a folder under a final name without a manifest: never taken

    plan = run(tmp_path, *args, "dry_run=true", name="plan")
    assert plan.results == {}
    note = next(p["note"] for p in read_json(tmp_path / "plan" / "plan.json") if p["stage"] == "train")
    assert note == "resumes from step 3, 2 damaged checkpoint(s) set aside"

    resumed = run(tmp_path, *args, name="resumed")
    assert resumed.exit_code == 0, resumed.results["train"].error
    summary = read_json(entry(tmp_path, resumed, "train") / "summary.json")
    assert summary["resumed_from_step"] == 3 and summary["steps"] == 12
    log = (tmp_path / "resumed" / "stages" / "train" / "rank0.log").read_text()
    assert "skipping a damaged checkpoint: step_0000006" in log and "sha256 differs" in log
    assert "step_0000009" in log and "manifest.json is missing" in log
    assert log.count("set aside as") == 2 and "kept for inspection: remove it when done" in log
    kept = tmp_path / "runs" / "cache" / "train" / ".damaged" / f"{resumed.results['train'].key}-checkpoints"
    assert f"{kept}/step_0000006-" in log  # where the published stage's workspace, now deleted, cannot take it
    assert sorted(p.name.split("-")[0] for p in kept.iterdir()) == ["step_0000006", "step_0000009"]


def test_all_checkpoints_damaged_restarts_from_zero_loudly(tmp_path):
    args = ("train.steps=12", "train.checkpoint_every=3")
    with killed_after(5), pytest.raises(KeyboardInterrupt):
        run(tmp_path, *args, name="killed")
    root = scratch_checkpoints(tmp_path)
    flip(next(ckpt.step_dir(root, 3).glob("*.distcp")))
    run(tmp_path, *args, "dry_run=true", name="plan")
    note = next(p["note"] for p in read_json(tmp_path / "plan" / "plan.json") if p["stage"] == "train")
    assert note == "restarts from step 0: its 1 checkpoint(s) are damaged"
    resumed = run(tmp_path, *args, name="resumed")
    assert resumed.exit_code == 0
    log = (tmp_path / "resumed" / "stages" / "train" / "rank0.log").read_text()
    assert "every checkpoint of this run is damaged (1 set aside): training restarts from step 0" in log


# -- rows 2 and 10: damaged cache entries ---------------------------------------------------------------------------

@pytest.mark.parametrize("stage,victim", [("aggregate", "hf/model.safetensors"), ("export", "model.onnx"),
                                          ("checkpoint", "__0_0.distcp")])
def test_damaged_cache_entry_is_set_aside_and_rebuilt(tmp_path, stage, victim, capsys):
    first = run(tmp_path, name="first")
    assert first.exit_code == 0
    damaged_entry = entry(tmp_path, first, stage)
    flip(damaged_entry / victim)
    again = run(tmp_path, name="again")
    assert again.exit_code == 0
    assert again.results[stage].status == "ran", {n: r.status for n, r in again.results.items()}
    out = capsys.readouterr().out
    assert f"{victim}: sha256 differs" in out and ".damaged" in out
    set_aside = list((tmp_path / "runs" / "cache" / stage / ".damaged").iterdir())
    assert len(set_aside) >= 1 and set_aside[0].name.startswith(first.results[stage].key)
    # the rebuilt entry verifies, and downstream stages that read it ran again or were verified
    from orchestrator.cache.store import Cache

    cache = Cache(tmp_path / "runs" / "cache")
    assert all(cache.verify(n, r.key) == [] for n, r in again.results.items())


def test_an_entry_without_its_record_is_set_aside_and_rebuilt_and_downstream_entries_are_kept(tmp_path, capsys):
    """`rm <cache>/transform/<key>/_entry.json`: every rerun failed (`OSError: Directory not empty` publishing over
    the folder); the entry is now damaged like any other."""
    first = run(tmp_path, name="first")
    assert first.exit_code == 0
    (entry(tmp_path, first, "transform") / "_entry.json").unlink()
    capsys.readouterr()
    again = run(tmp_path, name="again")
    assert again.exit_code == 0, {n: r.error for n, r in again.results.items()}
    status = {n: r.status for n, r in again.results.items()}
    assert status == {"tokenize": "cached", "export": "cached", "transform": "ran", "train": "cached",
                      "checkpoint": "cached", "aggregate": "cached"}, status
    out = capsys.readouterr().out
    assert "_entry.json is missing" in out and "kept for inspection: remove it when done" in out
    (kept,) = (tmp_path / "runs" / "cache" / "transform" / ".damaged").iterdir()
    assert kept.name.startswith(first.results["transform"].key) and (kept / "partition_plan.json").is_file()
    assert run(tmp_path, name="third").exit_code == 0  # healed: every stage cached


def test_an_untouched_entry_is_not_hashed_again_and_any_write_to_it_is(tmp_path, monkeypatch):
    """cache_verify=hash at read speed: the hit after a verified one hashes nothing (the stamps match), a byte flipped
    with its modification time put back is still caught (the change time moved), and full hashes everything."""
    import orchestrator.cache.store
    import storage.fsio

    monkeypatch.setattr(orchestrator.cache.store, "RACY_NS", 0)  # these runs follow each other within seconds
    first = run(tmp_path, name="first")
    assert run(tmp_path, name="second").results["aggregate"].status == "cached"  # hashed, stamps recorded
    hashed: list[str] = []
    real = storage.fsio.sha256_file
    monkeypatch.setattr(storage.fsio, "sha256_file", lambda p, *a: hashed.append(str(p)) or real(p, *a))
    third = run(tmp_path, name="third")
    assert {r.status for r in third.results.values()} == {"cached"} and hashed == []

    victim = entry(tmp_path, first, "aggregate") / "hf" / "model.safetensors"
    before = victim.stat()
    flip(victim)
    import os

    os.utime(victim, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert victim.stat().st_mtime_ns == before.st_mtime_ns and victim.stat().st_size == before.st_size
    fourth = run(tmp_path, name="fourth")
    assert fourth.results["aggregate"].status == "ran" and hashed[0] == str(victim)
    aggregate = tmp_path / "runs" / "cache" / "aggregate"
    assert all(Path(p).is_relative_to(aggregate) for p in hashed)  # the rest: the rebuilt entry's publication

    hashed.clear()
    assert run(tmp_path, "cache_verify=full", name="full").results["aggregate"].status == "cached"
    assert len(hashed) > 10 and any(p.endswith("model.safetensors") for p in hashed)


def test_size_only_verification_skips_hashing_but_catches_truncation(tmp_path):
    first = run(tmp_path, name="first")
    victim = entry(tmp_path, first, "aggregate") / "hf" / "model.safetensors"
    flip(victim)
    assert run(tmp_path, "cache_verify=size", name="sizes").results["aggregate"].status == "cached"
    victim.write_bytes(victim.read_bytes()[:-10])
    assert run(tmp_path, "cache_verify=size", name="truncated").results["aggregate"].status == "ran"


def test_dry_run_reports_a_damaged_entry_without_moving_it(tmp_path):
    first = run(tmp_path, name="first")
    flip(entry(tmp_path, first, "export") / "model.onnx")
    run(tmp_path, "dry_run=true", name="plan")
    plan = {p["stage"]: p for p in read_json(tmp_path / "plan" / "plan.json")}
    assert not plan["export"]["cached"] and "will be set aside" in plan["export"]["note"]
    assert entry(tmp_path, first, "export").exists()


# -- text is printed as text ------------------------------------------------------------------------------------

def test_square_brackets_from_users_and_processes_are_printed_as_text(capsys):
    from rich.panel import Panel

    console.print(Panel("[/__w/pytorch/third_party/gloo/unbound_buffer.cc:78] Timed out", title="x"))
    console.print("error: [/abs/dir]")
    out = capsys.readouterr().out
    assert "[/__w/pytorch/third_party/gloo/unbound_buffer.cc:78]" in out and "[/abs/dir]" in out


def test_metrics_history_is_readable_json(tmp_path):
    report = run(tmp_path)
    rows = [json.loads(line) for line in (entry(tmp_path, report, "train") / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))


# -- row 3: divergence ------------------------------------------------------------------------------------------

def test_divergence_stops_training_before_a_checkpoint_of_its_weights(tmp_path, monkeypatch):
    """optimizer.lr=inf is refused before launch, so a huge finite lr stands in: the weights blow up to inf/nan."""
    report = run(tmp_path, "optimizer.lr=1e30", "optimizer.warmup_steps=0", "train.grad_clip=0", name="bad")
    assert report.exit_code == 1
    assert {n: r.status for n, r in report.results.items()} == {
        "tokenize": "ran", "export": "ran", "transform": "ran", "train": "failed", "checkpoint": "not run", "aggregate": "not run"}
    error = report.results["train"].error
    assert "training diverged" in error and "at step" in error and "Last good checkpoint" in error
    assert "optimizer.lr (now 1e+30)" in error and "train.nonfinite=skip" in error
    (work,) = (tmp_path / "runs" / "cache" / "train").glob("*.work")
    rows = [json.loads(line) for line in (work / "scratch" / "metrics.jsonl").read_text().splitlines()]
    bad = next(r for r in rows if not (math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])))
    assert f"at step {bad['step']}" in error
    saved = [step for step, _ in ckpt.complete_checkpoints(work / "scratch" / "checkpoints")]
    assert all(step < bad["step"] for step in saved), (saved, bad["step"])  # no checkpoint of diverged weights


def test_skip_mode_drops_nonfinite_steps_and_stops_after_too_many(tmp_path):
    report = run(tmp_path, "optimizer.lr=1e30", "optimizer.warmup_steps=0", "train.grad_clip=0",
                 "train.nonfinite=skip", "train.max_nonfinite_skips=3", name="skip")
    assert report.exit_code == 1
    error = report.results["train"].error
    assert "3 steps in a row without a finite gradient (train.max_nonfinite_skips=3)" in error


def test_aggregate_names_nonfinite_weights_instead_of_a_mismatch():
    import torch

    from storage.safetensors_shards import same_bits
    from stages.aggregate import nonfinite

    nan = torch.tensor([1.0, float("nan")])
    assert same_bits(nan, torch.tensor([1.0, float("nan")]))  # the bytes are compared: a NaN equals itself
    assert not same_bits(nan, torch.tensor([1.0, 2.0]))
    assert nonfinite(nan) and nonfinite(torch.tensor([float("inf")])) and not nonfinite(torch.tensor([1.0]))
    assert not nonfinite(torch.tensor([3], dtype=torch.int64))


def test_weights_that_turn_nan_mid_run_stop_it_and_the_last_good_checkpoint_is_named(tmp_path, monkeypatch):
    import torch

    import stages.train

    real = stages.train.train_step

    def poisoned(layout, *args, **kwargs):
        if args[2] == 7:  # the 8th step: a weight turns NaN, as after an exploding update
            with torch.no_grad():
                layout.params[0][1].fill_(float("nan"))
        return real(layout, *args, **kwargs)

    monkeypatch.setattr(stages.train, "train_step", poisoned)
    report = run(tmp_path, name="nan")
    error = report.results["train"].error
    assert report.results["checkpoint"].status == "not run"
    assert "loss nan" in error and "at step 8" in error and "stopped at step 12 without saving" in error
    assert "Last good checkpoint: the checkpoint of step 6" in error
    (work,) = (tmp_path / "runs" / "cache" / "train").glob("*.work")
    assert [s for s, _ in ckpt.complete_checkpoints(work / "scratch" / "checkpoints")] == [6]


# -- row 12: a full disk ----------------------------------------------------------------------------------------

def _dcp_failure(kind: str) -> BaseException:
    """What DCP raises on a full disk: torch.save's zip writer's error (FINDINGS), or DCP's own CheckpointException
    (a BaseException) wrapping each rank's OSError."""
    if kind == "zip writer":
        return RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException("CheckpointException ranks:dict_keys([0])",
                               {0: (OSError(28, "No space left on device"), None)})


@pytest.mark.parametrize("kind", ["zip writer", "CheckpointException"])
def test_full_disk_during_a_checkpoint_is_named_and_leaves_no_partial_folder(tmp_path, monkeypatch, kind):
    """The save at step 12 meets a full disk, with 1 MB left on it (tests/test_full_disk.py fills a real one)."""
    import shutil
    from collections import namedtuple

    import torch.distributed.checkpoint as dcp

    real_save, real_usage = dcp.save, shutil.disk_usage
    calls = {"n": 0}

    def full_disk(state, storage_writer):
        calls["n"] += 1
        if calls["n"] == 2:
            storage_writer.root.mkdir(parents=True, exist_ok=True)
            (storage_writer.root / "__0_0.distcp").write_bytes(b"half")
            raise _dcp_failure(kind)
        return real_save(state, storage_writer=storage_writer)

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(dcp, "save", full_disk)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(2**30, 2**30 - 2**20, 2**20) if calls["n"] >= 2
                        else real_usage(p))
    report = run(tmp_path, name="full")
    error = report.results["train"].error
    assert report.results["train"].status == "failed"
    assert "no space left on the device to write the checkpoint" in error and "step_0000012" in error
    assert "1.0 MB free on the disk mounted at" in error and "MB needed" in error
    assert "run the same command to continue" in error
    (work,) = (tmp_path / "runs" / "cache" / "train").glob("*.work")
    assert not list((work / "scratch" / "checkpoints").glob(".step_*.partial"))
    assert [s for s, _ in ckpt.complete_checkpoints(work / "scratch" / "checkpoints")] == [6]
    monkeypatch.undo()
    again = run(tmp_path, name="again")
    assert again.exit_code == 0
    assert read_json(entry(tmp_path, again, "train") / "summary.json")["resumed_from_step"] == 6


def test_too_little_disk_for_the_checkpoints_is_refused_before_launch(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from orchestrator.config.errors import ConfigError
    from orchestrator.config.validate import validate
    from tests.conftest import make_cfg

    usage = namedtuple("usage", "total used free")
    free = 5 * 2**20
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(2**30, 2**30 - free, free))
    with pytest.raises(ConfigError) as e:
        validate(make_cfg(runs_dir=tmp_path))
    (p,) = [p for p in e.value.problems if p.key == "cache_dir"]
    assert "MB free" in p.rule and "keep_checkpoints" not in p.fix  # one checkpoint does not fit either
    # room for two 11 MB checkpoints and the aggregate's 8 MB, not three: keeping one is offered, and it holds
    free = 35 * 2**20
    with pytest.raises(ConfigError) as e:
        validate(make_cfg(runs_dir=tmp_path))
    (p,) = [p for p in e.value.problems if p.key == "cache_dir"]
    assert "3 on disk at once" in p.rule and "train.keep_checkpoints=1" in p.fix
    validate(make_cfg("train.keep_checkpoints=1", runs_dir=tmp_path))
    # keeping "all" counts the checkpoints the run writes: one, for two steps
    validate(make_cfg("train.steps=2", "train.keep_checkpoints=1000000", runs_dir=tmp_path))


# -- row 14: the tracking store fails during training ----------------------------------------------------------

def test_a_store_that_breaks_during_training_does_not_stop_it(tmp_path, monkeypatch, caplog):
    import stages.train

    real = stages.train.train_step

    def store_breaks(layout, *args, **kwargs):
        if args[2] == 5:
            (tmp_path / "runs" / "mlflow.db").write_bytes(b"this is not a database " * 4096)
        return real(layout, *args, **kwargs)

    monkeypatch.setattr(stages.train, "train_step", store_breaks)
    report = run(tmp_path, "tracking=mlflow", name="broken")
    assert {r.status for r in report.results.values()} == {"ran"}, {n: r.error for n, r in report.results.items()}
    rows = (entry(tmp_path, report, "train") / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 12  # every step is in the files
    warned = [r for r in caplog.records if "MLflow tracking failed" in r.getMessage() and r.levelname == "WARNING"]
    assert len(warned) == 1 and "[SQL:" not in warned[0].getMessage(), [r.getMessage() for r in warned]  # once
    assert "file is not a database" in (tmp_path / "broken" / "mlflow_failed.txt").read_text()

    # ... and the run folder puts the run into a store afterwards, every step included
    import mlflow

    from orchestrator.tracking.resync import resync

    uri = f"sqlite:///{tmp_path / 'fresh.db'}"
    parent = resync(tmp_path / "broken", uri)
    client = mlflow.MlflowClient(uri)
    children = client.search_runs([client.get_run(parent).info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent}'")
    by_stage = {r.data.tags["orchestrator.stage"]: r for r in children}
    assert set(by_stage) == {"tokenize", "export", "transform", "train", "checkpoint", "aggregate"}
    history = client.get_metric_history(by_stage["train"].info.run_id, "loss")
    assert [m.step for m in history] == list(range(1, 13))
    now_ms = time.time() * 1000  # each step keeps the time it was taken at, a moment ago
    assert all(now_ms - 3_600_000 < m.timestamp <= now_ms for m in history), [m.timestamp for m in history]
    assert client.get_run(parent).data.tags["orchestrator.resynced_from"] == str((tmp_path / "broken").resolve())
