"""The memory estimate: in the plan, a refusal when it cannot fit, and within 25% of what training really takes
(the worst rank's peak RSS on this CPU, what `top` shows) for gpt_small in four layouts."""
from __future__ import annotations

import json
import re
import sqlite3
from pathlib import Path

import pytest

from planning.plan import memory_line, partition_plan, plan_of
from planning.plan_time import time_line
from planning.estimate import estimate, step_flops
from storage.disk_speed import PROBE_BYTES, RECORDS, rates_for, record
from tests.conftest import make_cfg, run_cli, run_sweep

COMMON = ["model=gpt_small", "train.batch_size=8", "train.seq_len=256", "train.steps=3", "train.eval_every=0",
          "train.checkpoint_every=0", "tracking=none", "train.progress=false"]


def test_the_plan_states_the_estimate():
    line = memory_line(plan_of(make_cfg()))
    assert line.startswith("memory: ") and "GB per rank at its peak" in line and "available RAM" in line


def test_the_plan_states_the_evaluate_stage_s_memory_and_time_and_refuses_what_cannot_fit():
    """lm-eval's runtime, the fp32 weights, a batch's logits and log-softmax over the longest sequence, ONNX Runtime's
    copy with evaluate.onnx; the time floor over the shipped task's data file."""
    plain = make_cfg("evaluate.tasks=[arith_mc]")
    onnx = make_cfg("evaluate.tasks=[arith_mc]", "evaluate.onnx=true")
    weights = 4 * partition_plan(plain)["n_parameters"]
    logits = 2 * 8 * plain.model.max_seq_len * plain.model.vocab_size * 4
    assert plan_of(onnx).stages["evaluate"].peak - plan_of(plain).stages["evaluate"].peak == int(1.2 * weights)
    assert plan_of(plain).stages["evaluate"].peak >= weights + logits
    assert "evaluate " in memory_line(plan_of(onnx)) and "ONNX Runtime's copy" in memory_line(plan_of(onnx))
    assert "evaluate" not in memory_line(plan_of(make_cfg()))
    evaluate = time_line(plain, plan_of(plain), saving=False).split("\n")[-1]
    assert re.match(r"  evaluate: at least [\d.,]+ m?s for its tasks' [\d.]+ KB of local data, each", evaluate), evaluate
    from planning.plan import check

    huge = make_cfg("evaluate.tasks=[arith_mc]", "evaluate.batch_size=4096", "model.max_seq_len=4096",
                    "model.vocab_size=65536")
    assert any(p.key == "evaluate.batch_size" for p in check(huge, plan_of(huge), disk=False))


def test_lora_s_frozen_base_is_counted_without_gradients_or_state_and_offered_where_a_full_fine_tune_does_not_fit():
    """llama_1b on a 16 GB SLURM task: a full fine-tune (29 GB) is refused with peft=lora among the fixes, which the
    plan then counts at 13 GB (the base's weights and the adapters, the adapters' gradients and AdamW state only)."""
    from planning.plan import check

    args = ("model=llama_1b", "train.init_from=hf:/x", "cluster=slurm", "cluster.mem_per_task_gb=16", "dry_run=true")
    (refused,) = [p for p in check(make_cfg(*args), plan_of(make_cfg(*args)), disk=False) if p.key == "parallel"]
    assert refused.fix.startswith("peft=lora (a LoRA fine-tune of this model needs about 13."), refused.fix
    lora = plan_of(make_cfg(*args, "peft=lora")).rank
    full = plan_of(make_cfg(*args)).rank
    assert lora.parameters == full.parameters + lora.gradients and lora.optimizer < full.optimizer / 100
    lora_cfg = make_cfg(*args, "peft=lora")
    assert lora.gradients < full.gradients / 100 and check(lora_cfg, plan_of(lora_cfg), disk=False) == []


def test_a_plan_for_a_declared_device_answers_whether_a_rank_fits_it():
    """cluster.device on a CPU: llama_1b's full fine-tune (29 GB a rank) fits an H100's 79.2 GiB and not an A100
    40GB's, whose refusal offers the device that holds it; the memory line names the device."""
    from planning.plan import check

    args = ("model=llama_1b", "train.init_from=hf:/x", "cluster=slurm", "dry_run=true")
    h100 = make_cfg(*args, "cluster.device=h100_80gb")
    plan = plan_of(h100)
    assert plan.rank_limit == int(79.2 * 2**30) and check(h100, plan, disk=False) == []
    assert "of 79.2 GB (NVIDIA H100 SXM 80GB's memory (cluster.device=h100_80gb))" in memory_line(plan, 0)
    a100 = make_cfg(*args, "cluster.device=a100_40gb", "train.batch_size=64")
    (refused,) = [p for p in check(a100, plan_of(a100), disk=False) if p.key == "parallel"]
    assert "exceeds the 39.4 GB a rank may use (NVIDIA A100 40GB's memory" in refused.rule
    assert "cluster.device=a100_80gb (79.2 GiB)" in refused.fix or "cluster.device=h100_80gb" in refused.fix


def test_the_plan_states_floors_on_time_for_the_steps_and_the_saves(tmp_path):
    cache = tmp_path / "cache"
    cfg = make_cfg("model=gpt_small", "train.steps=1000", "train.checkpoint_every=300", f"cache_dir={cache}")
    n = partition_plan(cfg)["n_parameters"]
    tokens = cfg.train.batch_size * cfg.train.seq_len
    assert step_flops(cfg, n) == tokens * (6 * n + 12 * cfg.model.n_layers * cfg.model.d_model * cfg.train.seq_len)
    steps, saves = time_line(cfg, plan_of(cfg)).split("\n")
    assert re.match(r"time: [\d.,]+ TFLOP per step; matmuls here run at [\d,]+ GFLOP/s \(\d+ CPU thread", steps), steps
    assert "so a step takes at least" in steps and "1000 steps at least" in steps
    # saves at 300, 600, 900 and the last step; nothing measured here yet: a 64 MB file, written then removed (a
    # floor for a larger checkpoint: a write cache takes a small file faster than a whole save)
    checkpoint = plan_of(cfg).stages["checkpoint"].writes
    assert checkpoint > PROBE_BYTES
    assert re.match(rf"  saves: 4 checkpoint\(s\) of {checkpoint / 2**20:.1f} MB, each at least [\d.,]+ m?s at [\d,]+ "
                    rf"MB/s \(a 64.0 MB file written and fsynced now\): the steps wait for each", saves), saves
    assert "the aggregate's" in saves and list(cache.iterdir()) == []
    rates = re.findall(r"at ([\d,]+) MB/s \(a 64.0 MB file", saves)
    assert len(rates) == 2 and rates[0] == rates[1]  # one file measured the disk for both
    # a save measured here before, of at least half the size, times the next ones; a smaller one does not
    record(cache, "checkpoint", checkpoint // 3, 1.0)
    record(cache, "checkpoint", checkpoint // 2, 2.0)
    assert re.search(rf"each about 4.0 s at [\d,]+ MB/s \(checkpoint of {checkpoint / 2 / 2**20:.1f} MB measured here, "
                     r"\d{4}-\d\d-\d\d \d\d:\d\d\)", _time_line(cfg)), _time_line(cfg)
    record(cache, "checkpoint", 10**9, 0.0)  # no time: nothing kept
    assert rates_for(cache, {"checkpoint": checkpoint})["checkpoint"].bytes_per_s == checkpoint // 2 / 2.0
    (cache / RECORDS).write_text("{not json")  # a damaged record file: measured afresh, then written anew
    assert rates_for(cache, {"checkpoint": checkpoint})["checkpoint"].floor
    record(cache, "checkpoint", checkpoint, 3.0)
    assert rates_for(cache, {"checkpoint": checkpoint})["checkpoint"].bytes_per_s == checkpoint / 3.0

    assert "written in the background" in _time_line(make_cfg("train.async_checkpoint=async", f"cache_dir={cache}"))
    assert "not estimated here" in _time_line(make_cfg("cluster=slurm", f"cache_dir={cache}"))
    assert "\n" not in time_line(cfg, plan_of(cfg), saving=False)  # train and aggregate cached: nothing to write
    dry = make_cfg("dry_run=true", f"cache_dir={tmp_path / 'dry'}")
    assert "measured when the run starts" in _time_line(dry) and not (tmp_path / "dry").exists()


def _time_line(cfg) -> str:
    """The plan's lines on time for cfg, its plan made as validation makes it."""
    return time_line(cfg, plan_of(cfg))


def _timing(cfg):
    """What cfg's stage times are kept and found by, as a run works it out (orchestrator/run_plan.py)."""
    from planning.stage_time import timing_of

    return timing_of(cfg, plan_of(cfg))


def _expected(cfg, stages: list[str], store: Path, first_step: int = 0) -> dict:
    """plan_time.expected_times for cfg, by its timing."""
    from planning.plan_time import expected_times

    return expected_times(cfg, _timing(cfg), stages, store, first_step=first_step)


def test_the_plan_times_each_stage_by_what_ran_here_before_scaled_to_this_run(tmp_path):
    """A train run recorded on this machine and layout: a new run's steps take its median step time scaled by their
    FLOPs, and the time besides the steps as it was; another stage its recorded time, more for more parameters,
    never less; a stage never run here has no figure, and the train stage of a layout never run here its floor,
    each said so. After the run, each stage against its plan."""
    from dataclasses import replace

    from planning import stage_time
    from planning.plan_time import actual_line, planned_lines

    cfg = make_cfg("train.steps=10", "train.eval_every=5", "train.checkpoint_every=5", f"cache_dir={tmp_path}")
    timing = _timing(cfg)
    n = timing.n_parameters
    out = tmp_path / "train"
    out.mkdir()
    step_s = [0.5, 0.5, 0.5] + [0.1] * 7
    ended = [100.0 + sum(step_s[:i + 1]) + (0.4 if i >= 5 else 0.0) for i in range(10)]  # paused 0.4 s after step 5
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "loss": 1.0, "step_time_s": step_s[i],
                                                           "time": ended[i]}) + "\n" for i in range(10)))
    (out / "summary.json").write_text(json.dumps({"resumed_from_step": 0}))
    # 2.2 s of steps and a 0.4 s pause: 0.4 s to start and end; then the stages of a model of half the parameters
    # (twice the time for this one) and of four times them (no less than it took)
    stage_time.record(timing, cfg.train, "train", 3.0, out, tmp_path)
    stage_time.record(replace(timing, n_parameters=n // 2), cfg.train, "export", 4.0, out, tmp_path)
    stage_time.record(replace(timing, n_parameters=n * 4), cfg.train, "transform", 1.0, out, tmp_path)

    # twice the tokens a step, 100 steps, evaluated and saved at 25, 50 and 75 (and at the end): 3 pauses
    twice = make_cfg("train.steps=100", f"train.batch_size={2 * cfg.train.batch_size}", "train.eval_every=25",
                     f"cache_dir={tmp_path}")
    planned = _expected(twice, ["export", "transform", "train", "aggregate"], tmp_path)
    assert planned["train"].seconds == pytest.approx(100 * 0.2 + 0.4 + 3 * 0.4) and not planned["train"].floor
    assert planned["export"].seconds == pytest.approx(8.0) and planned["transform"].seconds == 1.0
    assert planned["aggregate"] is None
    first, train, unknown = planned_lines(planned)
    assert first == "  stages: at least 30.6 s for the 4 that run (export 8.0 s, transform 1.0 s, train 21.6 s)"
    assert train.startswith("  train: 200 ms a step: 100 ms at ") and train.endswith(
        "400 ms to start and end, as then, and 3 evaluation(s) and save(s) between steps at 400 ms each")
    assert unknown == "  not measured here yet (their first run on this machine): aggregate"
    assert actual_line(planned, {"train": 25.0, "aggregate": 3.0}) == (
        "time against the plan: the stage the plan timed took 25.0 s, 1.16x of 21.6 s planned (train 25.0 s for "
        "21.6 s, aggregate 3.0 s (no estimate))")
    assert actual_line(planned, {"aggregate": 3.0}).startswith("time against the plan: no stage that ran had an")

    other = _expected(make_cfg("parallel=ddp2", f"cache_dir={tmp_path}"), ["train"], tmp_path)["train"]
    assert other.floor and "no run of this layout measured here yet" in other.source
    (out / "summary.json").write_text(json.dumps({"resumed_from_step": 4}))  # a continued run: not a measure
    stage_time.record(_timing(twice), twice.train, "train", 99.0, out, tmp_path)
    assert _expected(twice, ["train"], tmp_path)["train"].seconds == pytest.approx(21.6)
    # continuing step 60's checkpoint: the 40 steps left and the one pause (at 75) between them, not all 100
    assert _expected(twice, ["train"], tmp_path, first_step=60)["train"].seconds == pytest.approx(
        40 * 0.2 + 0.4 + 0.4)
    # SLURM: the nodes' records only (the partition and what a task asks), never this host's, and no floor
    slurm = make_cfg("train.steps=10", "train.eval_every=5", "train.checkpoint_every=5", "cluster=slurm",
                     f"cache_dir={tmp_path}")
    assert _expected(slurm, ["train"], tmp_path) == {"train": None}
    assert planned_lines({"train": None}, stage_time.where(slurm)) == [
        "  stages: none of the 1 that run measured on SLURM partition (the default) yet"]
    (out / "summary.json").write_text(json.dumps({"resumed_from_step": 0}))
    stage_time.record(_timing(slurm), slurm.train, "train", 3.0, out, tmp_path)  # as follow records a job
    on_nodes = _expected(slurm, ["train", "export"], tmp_path)
    assert on_nodes["train"].seconds == pytest.approx(10 * 0.1 + 0.4 + 0.4) and on_nodes["export"] is None
    assert "measured on SLURM partition (the default) " in on_nodes["train"].source
    assert planned_lines(on_nodes, stage_time.where(slurm))[-1] == \
        "  not measured on SLURM partition (the default) yet: export"
    other_nodes = make_cfg("train.steps=10", "cluster=slurm", "cluster.gpus_per_task=1", f"cache_dir={tmp_path}")
    assert _expected(other_nodes, ["train"], tmp_path) == {"train": None}


def test_sharding_recomputation_and_more_ranks_lower_it():
    def total(*o):
        cfg = make_cfg("model=gpt_small", *o)
        return estimate(cfg, partition_plan(cfg)).total
    assert total("parallel=ddp2", "parallel.dp_mode=shard") < total("parallel=ddp2")
    assert total("memory=level1") < total() and total("parallel=megatron_hp2") < total()
    assert total("parallel=pipeline_pp2") < total() and total("precision=bf16") < total()


def test_a_tied_head_counts_once_where_it_shares_the_embedding_and_again_where_it_is_a_copy():
    """One process holds gpt_small's embedding and head as one tensor: the model's parameters, once each. Two
    pipeline stages each hold one: the last stage's head is a copy of the first's embedding."""
    from planning.estimate import _held_by_rank
    from plugins.models import get_model

    cfg = make_cfg("model=gpt_small")
    unique = sum(p.numel() for p in get_model("gpt").build(cfg.model).parameters())
    head = cfg.model.d_model * partition_plan(cfg)["parameters"]["lm_head.weight"]["shard_shape"][0]
    assert _held_by_rank(partition_plan(cfg)) == {0: unique}
    assert sum(_held_by_rank(partition_plan(make_cfg("model=gpt_small", "parallel=pipeline_pp2"))).values()) \
        == unique + head


MEASURED = ["single", "ddp2", "megatron_hp2", "pipeline_pp2"]


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[str, Path]:
    """The layouts trained as one sweep (the tokens and the export shared): layout -> its run folder."""
    points = run_sweep([*COMMON, f"parallel={','.join(MEASURED)}"], tmp_path_factory.mktemp("estimate"))
    return {overrides.removeprefix("parallel="): run_dir for overrides, run_dir in points.items()}


@pytest.mark.e2e
@pytest.mark.parametrize("layout", MEASURED)
def test_within_a_quarter_of_the_measured_peak(layout, measured):
    measured_mb = json.loads((measured[layout] / "stages/train/output/summary.json").read_text())["peak_memory_mb"]
    cfg = make_cfg(*COMMON, f"parallel={layout}")
    estimated = estimate(cfg, partition_plan(cfg)).total / 2**20
    assert 0.75 <= measured_mb / estimated <= 1.25, (measured_mb, estimated)


@pytest.mark.e2e
def test_a_calibration_times_a_few_steps_of_the_layout_before_the_plan_and_deletes_their_model(tmp_path):
    """plan.calibrate_steps on a fresh machine: 4 steps of the run (an evaluation and a save mid-way) are timed
    before its plan, which then times the train stage by them (with its one pause), not by its floor; their model
    leaves the cache."""
    args = ["plan.calibrate_steps=4", "train.steps=12", "train.eval_every=6", "model.n_layers=1", "train.batch_size=4",
            "train.seq_len=32", "cluster=debug"]
    done = run_cli(args, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    calibration, run = done.stdout.split("─ the run ─", 1)
    assert "calibration (plan.calibrate_steps=4): no run of this layout was timed" in calibration
    assert "memory: " not in calibration and "memory: " in run  # the run's plan says it, once
    assert "no run of this layout" not in run
    (train,) = [line for line in run.splitlines() if line.startswith("  train: ")]
    assert " a step: " in train and "and 1 evaluation(s) and save(s) between steps at " in train, train
    trains = [r for r in json.loads((tmp_path / "runs" / "cache" / ".stage_times.json").read_text())
              if r["stage"] == "train"]
    assert len(trains) == 2 and trains[0]["pause_s"] > 0 and trains[1]["pause_s"] > 0  # the calibration's, the run's
    kept = [p for p in (tmp_path / "runs" / "cache" / "train").iterdir() if (p / "_entry.json").is_file()]
    assert len(kept) == 1 and json.loads((kept[0] / "summary.json").read_text())["steps"] == 12
    with sqlite3.connect(tmp_path / "runs" / "mlflow.db") as db:  # tracked as the run is (MLflow's cost timed too)
        kinds = sorted(v for (v,) in db.execute("SELECT value FROM tags WHERE key = 'orchestrator.kind'"))
    assert kinds == ["calibration", "invocation"] + ["stage"] * (4 + 6)


def test_a_calibration_is_wanted_only_before_a_longer_run_s_train_that_nothing_here_timed(tmp_path):
    from orchestrator.calibration import wanted
    from planning import stage_time

    def asks(*overrides: str, to_run=("train",), until=None) -> bool:
        cfg = make_cfg("plan.calibrate_steps=8", *overrides)
        return wanted(cfg, list(to_run), tmp_path, until, _timing(cfg))

    assert asks("train.steps=100")
    assert not asks("train.steps=8") and not asks("train.steps=100", "plan.calibrate_steps=0")  # it times itself
    assert not asks("train.steps=100", to_run=("aggregate",)) and not asks("train.steps=100", until="train")
    assert not asks("train.steps=100", "dry_run=true") and not asks("train.steps=100", "data.preview=2")
    out = tmp_path / "train"  # a run of this layout timed here: the next is planned by it, not calibrated
    out.mkdir()
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "step_time_s": 0.1}) + "\n" for i in range(9)))
    (out / "summary.json").write_text(json.dumps({"resumed_from_step": 0}))
    timed = make_cfg("train.steps=9")
    stage_time.record(_timing(timed), timed.train, "train", 2.0, out, tmp_path)
    assert not asks("train.steps=100") and asks("train.steps=100", "train.batch_size=2") is False  # FLOPs scale
    assert asks("train.steps=100", "parallel=ddp2")  # another layout: nothing comparable
