"""The whole DAG in this process (cluster=debug): outputs, failure propagation, resume at the failed stage."""
from __future__ import annotations

import json

import pytest
import torch

from storage import consolidate
from storage.fsio import read_json
from plugins.models import get_model
from tests.conftest import DEBUG, cache_entry as entry, killed_after, make_cfg, run_debug as run


def test_every_stage_writes_its_outputs(tmp_path):
    report = run(tmp_path)
    assert report.exit_code == 0
    assert {n: r.status for n, r in report.results.items()} == dict.fromkeys(
        ["tokenize", "export", "transform", "train", "checkpoint", "aggregate"], "ran")
    assert (entry(tmp_path, report, "export") / "model.onnx").is_file()
    assert read_json(entry(tmp_path, report, "export") / "io_schema.json")["input_names"] == ["input_ids"]
    assert "layers.0.attn.wq.weight" in read_json(entry(tmp_path, report, "transform") / "partition_plan.json")[
        "parameters"]
    train = entry(tmp_path, report, "train")
    summary = read_json(train / "summary.json")
    rows = [json.loads(line) for line in (train / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "input_density", "label_density",
                "memory/rss_pre_forward_mb", "memory/rss_post_forward_mb", "memory/rss_post_backward_mb"):
        assert key in rows[0], key
    assert [r["step"] for r in rows if "eval_loss" in r] == [6, 12]
    assert (train / "loss_curve.png").stat().st_size > 1000
    manifest = read_json(entry(tmp_path, report, "checkpoint") / "manifest.json")
    assert manifest["step"] == 12 and manifest["trainer"]["world_size"] == 1
    assert manifest["partition_plan"]["layout"]["world_size"] == 1 and manifest["config_key"]
    agg = entry(tmp_path, report, "aggregate")
    assert read_json(agg / "manifest.json")["verification"]["eval_loss"] == pytest.approx(
        summary["final_eval_loss"], rel=1e-6)
    # the aggregated checkpoint is usable by a plain program
    cfg = make_cfg(*DEBUG)
    model = get_model("gpt").build(cfg.model)
    consolidate.load(agg, model)
    assert torch.isfinite(model(torch.zeros(1, 4, dtype=torch.long))).all()
    # tracking=none: no MLflow store, no artifact folder
    assert not (tmp_path / "runs" / "mlflow.db").exists() and not (tmp_path / "runs" / "mlartifacts").exists()
    assert report.parent_run_id is None


def test_rerun_is_cached_and_lr_change_reuses_export_and_transform(tmp_path):
    run(tmp_path, name="first")
    again = run(tmp_path, name="again")
    assert {r.status for r in again.results.values()} == {"cached"}
    other = run(tmp_path, "optimizer.lr=3e-4", name="lr")
    assert {n: r.status for n, r in other.results.items()} == {
        "tokenize": "cached", "export": "cached", "transform": "cached", "train": "ran", "checkpoint": "ran", "aggregate": "ran"}


def test_dry_run_starts_nothing(tmp_path):
    report = run(tmp_path, "dry_run=true")
    assert report.results == {}
    assert not (tmp_path / "runs" / "cache").exists()
    plan = read_json(tmp_path / "run" / "plan.json")
    assert [p["stage"] for p in plan] == ["tokenize", "export", "transform", "train", "checkpoint", "aggregate"]
    assert all(not p["cached"] and p["command"] for p in plan)


def test_failed_stage_stops_dependants_and_rerun_resumes_there(tmp_path, monkeypatch):
    import stages.train

    def broken(cfg, tokens=None, row_inputs=None):
        raise RuntimeError("injected data failure")

    monkeypatch.setattr(stages.train, "build_batcher", broken)
    first = run(tmp_path, name="first")
    assert first.exit_code == 1
    assert {n: r.status for n, r in first.results.items()} == {
        "tokenize": "ran", "export": "ran", "transform": "ran", "train": "failed", "checkpoint": "not run", "aggregate": "not run"}
    assert "injected data failure" in first.results["train"].error
    assert not (tmp_path / "runs" / "cache" / "checkpoint").exists()
    monkeypatch.undo()

    second = run(tmp_path, name="second")
    assert second.exit_code == 0
    assert {n: r.status for n, r in second.results.items()} == {
        "tokenize": "cached", "export": "cached", "transform": "cached", "train": "ran", "checkpoint": "ran", "aggregate": "ran"}


def test_failed_aggregate_verification_publishes_nothing(tmp_path, monkeypatch):
    import dataclasses

    from plugins.engines.registry import ENGINES

    # an engine whose every eval loss fails the aggregate's check
    monkeypatch.setitem(ENGINES._specs, "torch", dataclasses.replace(ENGINES.get("torch"), eval_rtol=-1.0))
    first = run(tmp_path, name="first")
    assert first.results["aggregate"].status == "failed"
    assert "differs from the train stage's final eval loss" in first.results["aggregate"].error
    key = first.results["aggregate"].key
    assert not (tmp_path / "runs" / "cache" / "aggregate" / key).exists()
    monkeypatch.undo()
    assert run(tmp_path, name="second").results["aggregate"].status == "ran"


def test_a_kill_during_a_background_write_resumes_from_the_checkpoint_before(tmp_path, monkeypatch):
    """train.async_checkpoint=async, the run killed while step 6's checkpoint is written in the background (its
    write held until then): nothing of it is published, and the same command resumes from step 3 with the losses of
    a run never stopped."""
    import threading

    from torch.distributed.checkpoint.filesystem import _FileSystemWriter

    args = ["train.steps=12", "train.checkpoint_every=3", "train.async_checkpoint=async"]
    reference = run(tmp_path / "a", *args)
    held, release, real = threading.Event(), threading.Event(), _FileSystemWriter.write_data

    def write_data(self, plan, planner):
        if ".step_0000006.partial" in str(self.path) and not held.is_set():
            held.set()
            release.wait(120)
            raise OSError("killed")  # nothing of this write reaches the disk, as under a kill
        return real(self, plan, planner)

    monkeypatch.setattr(_FileSystemWriter, "write_data", write_data)
    with killed_after(7), pytest.raises(KeyboardInterrupt):
        run(tmp_path / "b", *args, name="killed")
    assert held.is_set()
    try:
        resumed = run(tmp_path / "b", *args, name="resumed")
    finally:
        release.set()
    train = entry(tmp_path / "b", resumed, "train")
    assert read_json(train / "summary.json")["resumed_from_step"] == 3
    got = [json.loads(r) for r in (train / "metrics.jsonl").read_text().splitlines()]
    want = [json.loads(r) for r in (entry(tmp_path / "a", reference, "train") / "metrics.jsonl").read_text()
            .splitlines()]
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):  # the run continues exactly: every loss, every evaluation
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-6, abs=0), g["step"]
        if "eval_loss" in w:
            assert g["eval_loss"] == pytest.approx(w["eval_loss"], rel=1e-6, abs=0), g["step"]


