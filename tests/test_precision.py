"""Mixed precision on CPU: bf16/fp16 compute with fp32 master weights, fp16's loss scaling (skipped steps, the
scale in the checkpoint), precision-independent checkpoints, `auto`, and the refusals before launch."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from orchestrator.config.errors import ConfigError
from orchestrator.config.resolve import resolve_auto
from orchestrator.config.validate import validate
from orchestrator.run import orchestrate
from plugins.data import build_batcher
from storage.fsio import read_json
from plugins.models import get_model
from runtime.optim import build_optimizer
from plugins.parallel.layout import build_layout
from planning.partition import build_plan
from runtime.precision import LossScaler, auto_precision, mfu, peak_flops
from runtime.step import StepSettings, train_step
from runtime.metrics import MemoryProbe
from tests.conftest import DEBUG, QUICK, cache_entry, killed_after, make_cfg, run_cli, run_debug as run


def train_dir(tmp_path: Path, report) -> Path:
    return cache_entry(tmp_path, report, "train")


def metrics(tmp_path: Path, report) -> list[dict]:
    return [json.loads(line) for line in (train_dir(tmp_path, report) / "metrics.jsonl").read_text().splitlines()]


# -- fp16's loss scale --------------------------------------------------------------------------------------------

def _one_process(*overrides: str):
    cfg = make_cfg("precision=fp16", *QUICK, *overrides)
    spec = get_model("gpt")
    layout = build_layout(cfg, build_plan(cfg.model, cfg.parallel), spec, torch.device("cpu"))
    return cfg, layout, [build_optimizer(cfg.optimizer, layout.parts[0])], build_batcher(cfg)


def test_an_overflowing_fp16_step_is_skipped_and_halves_the_scale():
    cfg, layout, optimizers, batcher = _one_process()
    before = {n: p.detach().clone() for n, p in layout.params}
    scaler = LossScaler(True, init_scale=2.0 ** 60, growth_interval=2000)  # the fp16 backward overflows
    row = train_step(layout, optimizers, batcher.train_batch(0), 0, 1e-3, StepSettings.of(cfg),
                     MemoryProbe(torch.device("cpu")), scaler)
    assert not torch.isfinite(row["grad_norm"])
    assert scaler.scale == 2.0 ** 59 and scaler.skipped_steps == 1 and row["amp/skipped_steps"] == 1
    assert all(torch.equal(p, before[n]) for n, p in layout.params), "a skipped step must not change the weights"
    assert not any(optimizers[0].state.values()), "nor the optimizer state"

    scaler.scale = 1024.0
    row = train_step(layout, optimizers, batcher.train_batch(1), 1, 1e-3, StepSettings.of(cfg),
                     MemoryProbe(torch.device("cpu")), scaler)
    assert torch.isfinite(row["grad_norm"]) and scaler.skipped_steps == 1
    assert any(not torch.equal(p, before[n]) for n, p in layout.params)


def test_the_unscaled_norm_equals_the_fp32_norm_of_the_same_gradients():
    """The scaled backward, unscaled by the clip, gives the gradient norm an unscaled backward gives."""
    cfg, layout, optimizers, batcher = _one_process("train.grad_clip=0")
    batch = batcher.train_batch(0)
    norms = []
    for scale in (1.0, 256.0):
        layout.runner.train_step(layout.local_batch(batch.inputs), layout.local_batch(batch.labels),
                                 batch.n_labels, scale)
        norms.append(float(layout.sync_and_clip(StepSettings.of(cfg).grad_clip, scale)))
        for _, p in layout.params:
            p.grad = None
    assert norms[1] == pytest.approx(norms[0], rel=2e-3)


def test_loss_scale_grows_after_finite_steps_and_survives_a_checkpoint():
    s = LossScaler(True, init_scale=8.0, growth_interval=2)
    for _ in range(4):
        assert s.step_ok(torch.tensor(1.0))
    assert s.scale == 32.0
    t = LossScaler(True)
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()
    off = LossScaler(False)
    off.load_state_dict(s.state_dict())  # a bf16/fp32 run ignores an fp16 checkpoint's scale
    assert off.scale == 1.0 and off.metrics() == {}


def test_fp16_run_records_skipped_steps_and_the_scale(tmp_path):
    report = run(tmp_path, "precision=fp16", "precision.init_scale=16777216")
    assert report.exit_code == 0
    rows = metrics(tmp_path, report)
    assert rows[0]["amp/skipped_steps"] == 1 and rows[0]["amp/loss_scale"] == 2.0 ** 23
    skipped = rows[-1]["amp/skipped_steps"]
    assert 1 <= skipped < len(rows) and all(r["loss"] == r["loss"] for r in rows)  # finite, no nan
    summary = read_json(train_dir(tmp_path, report) / "summary.json")
    assert summary["precision"] == "fp16" and summary["loss_scaler"]["skipped_steps"] == skipped
    manifest = read_json(tmp_path / "runs" / "cache" / "checkpoint" / report.results["checkpoint"].key /
                         "manifest.json")
    assert manifest["loss_scaler"] == summary["loss_scaler"] and manifest["trainer"]["precision"] == "fp16"


def test_killed_fp16_run_resumes_with_the_same_losses_and_scale(tmp_path):
    """The scale changes every step (growth after each finite step, halving on overflow): a resumed run that did
    not restore it from the checkpoint would skip other steps and train differently."""
    args = ("precision=fp16", "precision.init_scale=4194304", "precision.growth_interval=1", "train.steps=12")
    reference = run(tmp_path / "a", *args)
    want = metrics(tmp_path / "a", reference)
    assert len({r["amp/loss_scale"] for r in want}) > 2

    with killed_after(7), pytest.raises(KeyboardInterrupt):
        run(tmp_path / "b", *args, name="killed")
    resumed = run(tmp_path / "b", *args, name="resumed")
    assert read_json(train_dir(tmp_path / "b", resumed) / "summary.json")["resumed_from_step"] == 6
    got = metrics(tmp_path / "b", resumed)
    assert [(r["step"], r["loss"], r["amp/loss_scale"], r["amp/skipped_steps"]) for r in got] == \
        [(r["step"], r["loss"], r["amp/loss_scale"], r["amp/skipped_steps"]) for r in want]


# -- checkpoints do not depend on the precision -------------------------------------------------------------------

def test_bf16_aggregate_is_fp32_and_checkpoints_cross_precisions(tmp_path):
    bf16 = run(tmp_path, "precision=bf16", "train.steps=6", name="bf16")
    assert bf16.exit_code == 0
    agg = tmp_path / "runs" / "cache" / "aggregate" / bf16.results["aggregate"].key
    with safe_open(str(agg / "hf" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float32}
    bf16_ckpt = tmp_path / "runs" / "cache" / "checkpoint" / bf16.results["checkpoint"].key
    fp32 = run(tmp_path, "precision=fp32", "train.steps=12", f"train.init_from={bf16_ckpt}", name="fp32")
    assert fp32.exit_code == 0
    assert read_json(train_dir(tmp_path, fp32) / "summary.json")["resumed_from_step"] == 6
    fp32_ckpt = tmp_path / "runs" / "cache" / "checkpoint" / fp32.results["checkpoint"].key
    back = run(tmp_path, "precision=bf16", "train.steps=16", f"train.init_from={fp32_ckpt}", name="back")
    assert back.exit_code == 0
    assert read_json(train_dir(tmp_path, back) / "summary.json")["resumed_from_step"] == 12


def test_bf16_losses_stay_near_fp32_and_summary_names_the_precision(tmp_path):
    fp32, bf16 = run(tmp_path, "precision=fp32", name="fp32"), run(tmp_path, "precision=bf16", name="bf16")
    for a, b in zip(metrics(tmp_path, fp32), metrics(tmp_path, bf16), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-2), a["step"]
    summary = read_json(train_dir(tmp_path, bf16) / "summary.json")
    assert summary["precision"] == "bf16" and summary["mfu"] is None  # no peak FLOP/s for a CPU
    assert summary["attention_kernel"] in ("flash (cpu)", "efficient (cpu)", "math (cpu)")  # not CUDA's kernels
    assert summary["optimizer_impl"] in ("fused", "foreach") and summary["peak_memory_mb"] > 0
    assert bf16.results["train"].summary.endswith("(bf16)")


# -- choices and refusals before launch ---------------------------------------------------------------------------

def test_auto_picks_bf16_only_on_a_cuda_gpu_that_has_it():
    assert auto_precision(True, True, "torch")[0] == "bf16"
    assert auto_precision(True, False, "torch")[0] == "fp32"
    assert auto_precision(False, False, "torch") == ("fp32", "no CUDA GPU")
    from plugins.engines import get_engine

    assert auto_precision(True, True, "ort", get_engine("ort").mixed_precision)[0] == "fp32"  # ORT: fp32 graphs
    cfg = make_cfg()
    assert cfg.precision.name == "auto"
    notes = resolve_auto(cfg)
    assert cfg.precision.name == ("bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32")
    assert notes and notes[0].startswith("precision=auto: ")
    slurm = make_cfg("cluster=slurm", "cluster.gpus_per_task=1")
    resolve_auto(slurm)
    assert slurm.precision.name == "bf16"


def test_explicit_precision_is_kept_and_enters_the_train_key(tmp_path):
    cfg = make_cfg("precision=fp16")
    assert resolve_auto(cfg) == [] and cfg.precision.name == "fp16"
    plans = {p: orchestrate(make_cfg(*DEBUG, f"precision={p}", "dry_run=true", runs_dir=tmp_path / "runs"),
                            tmp_path / p, []) for p in ("fp32", "bf16")}
    keys = {p: {s["stage"]: s["key"] for s in read_json(tmp_path / p / "plan.json")} for p in plans}
    assert keys["fp32"]["export"] == keys["bf16"]["export"] and keys["fp32"]["transform"] == keys["bf16"]["transform"]
    assert keys["fp32"]["train"] != keys["bf16"]["train"]


def test_mixed_precision_with_ort_is_refused():
    with pytest.raises(ConfigError) as e:
        validate(make_cfg("engine=ort", "precision=bf16"))
    p = next(p for p in e.value.problems if p.key == "precision.name")
    assert p.value == "bf16" and "fp32 ONNX graph" in p.rule and "precision=fp32" in p.fix


def test_unknown_precision_exits_2_naming_the_options(workdir):
    result = run_cli(["precision=fp8"], workdir, timeout=120)
    assert result.returncode == 2
    assert "x precision=fp8" in result.stderr and "bf16" in result.stderr and "fp16" in result.stderr


def test_step_times_add_up_to_the_windows_wall_time():
    """Time that no step's own clock sees (on a GPU: the device finishing its queue, waited for at the read-back;
    here a sleep stands in for it) is spread over the window's steps: tokens/s and MFU are not overstated."""
    import time

    from runtime.metrics import MetricsWindow

    cfg, layout, optimizers, batcher = _one_process("train.batch_size=2", "train.seq_len=16")
    window, probe = MetricsWindow(layout), MemoryProbe(torch.device("cpu"))
    t0 = time.perf_counter()
    for step in range(3):
        window.add(train_step(layout, optimizers, batcher.train_batch(step), step, 1e-3, StepSettings.of(cfg), probe))
        time.sleep(0.2)
    rows = window.flush()
    wall = time.perf_counter() - t0
    assert 0.6 <= sum(r["step_time_s"] for r in rows) <= wall
    assert all(r["tokens_per_s"] == pytest.approx(r["tokens"] / r["step_time_s"]) for r in rows)


def test_mfu_and_peaks():
    assert peak_flops(torch.device("cpu"), "bf16", False) is None
    assert mfu(124_000_000, 329_000.0, 989e12) == pytest.approx(0.2475, rel=1e-3)
    assert mfu(1, None, 1.0) is None and mfu(1, 1.0, None) is None


def test_gpu_benchmark_says_it_needs_cuda_and_runs_on_request_on_the_cpu():
    import subprocess
    import sys

    from tests.conftest import ROOT

    script = str(ROOT / "benchmarks" / "gpu.py")
    if not torch.cuda.is_available():
        done = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and "needs a CUDA GPU" in done.stderr and "device=cpu" in done.stderr
    done = subprocess.run([sys.executable, script, "device=cpu", "model=gpt_tiny", "batch=4", "seq=32", "steps=2",
                           "rounds=1", "log_every=2", "modes=fp32,bf16"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith(("fp32 ", "bf16 "))]
    assert len(lines) == 2 and all("optimizer fused" in line for line in lines)


def test_the_gpu_suite_stops_at_once_without_a_gpu_and_says_where_to_run_it():
    """gpu_tests/ (not collected by `pytest`) checks what needs a CUDA GPU; here it must refuse, not pass."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    if torch.cuda.is_available():
        pytest.fail("this test checks the GPU suite's refusal on a machine without CUDA; run `pytest gpu_tests -n 0`")
    done = subprocess.run([sys.executable, "-m", "pytest", "gpu_tests", "-n", "0", "-q", "-p", "no:cacheprovider"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "torch.cuda.is_available() is False" in done.stdout and "pytest gpu_tests -n 0" in done.stdout
