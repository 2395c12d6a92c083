"""Every parallel layout trains like one process; checkpoints move between layouts; ranks fail cleanly.

Real `python -m orchestrator` runs (local cluster: one process per rank, gloo, one thread each), fp32,
dropout 0, tied embeddings, the same seed and data. A constant learning rate makes a 3-step run the first
half of a 6-step run, so checkpoints taken at step 3 can be continued and compared. (Six steps take every path ten
did: Adam's state after its first steps, an evaluation and a save mid-run and at the end, a resumed optimizer.)
"""
from __future__ import annotations

import json
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml

from storage import checkpoint as ckpt
from storage import consolidate
from plugins.data import build_batcher
from storage.fsio import read_json
from plugins.models import get_model
from runtime.optim import build_optimizer
from tests.conftest import (ROOT, cli_env, last_wins, make_cfg, requires_ort_training, run_cli, run_folder,
                            run_sweep)

pytestmark = pytest.mark.e2e

STEPS, HALF = 4, 2
COMMON = ["train.batch_size=8", "train.seq_len=32", f"train.eval_every={HALF}", f"train.checkpoint_every={HALF}",
          "train.eval_batches=2", "optimizer.schedule=constant", "optimizer.warmup_steps=0", "tracking=none",
          "train.progress=false"]
LAYOUTS = {
    "single": ["parallel=single"],
    "ddp2-replicate": ["parallel=ddp2", "parallel.dp_mode=replicate"],
    "ddp2-shard": ["parallel=ddp2", "parallel.dp_mode=shard"],
    "megatron_hp2": ["parallel=megatron_hp2"],
    "megatron_hp2-sp-lp": ["parallel=megatron_hp2", "parallel.sequence_parallel=true", "parallel.loss_parallel=true"],
    "megatron_hp4": ["parallel=megatron_hp4"],
    # a zero-bubble schedule (the backward split into input and weight passes) under FSDP2: plain 1F1B on pp=2 is a
    # part of the dp2_hp2_pp2 layouts
    "dp2_pp2-zbv-shard": ["parallel=pipeline_pp2", "parallel.dp=2", "parallel.dp_mode=shard",
                          "parallel.pp_schedule=zbv", "parallel.pp_chunks=2"],
    "pipeline_pp4_interleaved": ["parallel=pipeline_pp4_interleaved"],
    "dp2_hp2_pp2-replicate": ["parallel=dp2_hp2_pp2", "parallel.dp_mode=replicate"],
    "dp2_hp2_pp2-shard": ["parallel=dp2_hp2_pp2", "parallel.dp_mode=shard"],
    # no data parallelism: the tied embedding's vocab-parallel gradient arrives Replicate (FSDP reshards it otherwise);
    # and recomputation by operator (memory=level3: runtime/recompute.py) under tensor parallelism and a pipeline
    "hp2_pp2-recompute-ops": ["parallel=dp2_hp2_pp2", "parallel.dp=1", "memory=level3"],
    "megatron_hp2-sp-lp-recompute-layers": ["parallel=megatron_hp2", "parallel.sequence_parallel=true",
                                            "parallel.loss_parallel=true", "memory=level1"],
    "ddp2-shard-recompute-selective": ["parallel=ddp2", "parallel.dp_mode=shard", "memory=level2"],
}
RTOL = 1e-5
ORT_RTOL = 1e-4  # engine=ort against engine=torch: ONNX Runtime's kernels round differently


def outputs(result: subprocess.CompletedProcess) -> Path:
    """The run folder of a finished invocation (its stages/<name>/output links into the cache)."""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return run_folder(result)


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "stages/train/output/metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """The module's runs share one cache (the export runs once), and find LAYOUTS as presets of a config group
    `layout` (conf/layout/<name>.yaml, written from LAYOUTS), which a sweep takes as `+layout=a,b,c`."""
    work = tmp_path_factory.mktemp("layouts")
    for name, overrides in LAYOUTS.items():
        preset: dict = {"defaults": []}
        for override in overrides:
            key, value = override.split("=", 1)
            if "." in key:
                group, leaf = key.split(".", 1)
                preset.setdefault(group, {})[leaf] = yaml.safe_load(value)
            else:
                preset["defaults"].append({f"override /{key}": value})
        (work / "conf" / "layout").mkdir(parents=True, exist_ok=True)
        (work / "conf" / "layout" / f"{name}.yaml").write_text("# @package _global_\n" + yaml.safe_dump(preset))
    return work


def sweep(args: list[str], names: list[str], workdir: Path) -> dict[str, Path]:
    """The layouts `names` as one sweep, `python -m orchestrator -m +layout=...`: name -> the point's run folder."""
    points = run_sweep([f"hydra.searchpath=[file://{workdir / 'conf'}]", f"+layout={','.join(names)}", *args], workdir)
    return {overrides.removeprefix("+layout="): run_dir for overrides, run_dir in points.items()}


# Layouts whose parity with one process other tests' runs take: hp=4 trains the second half from a dp2_hp2_pp2
# checkpoint in test_checkpoint_reshards_into_other_layouts, against these runs' steps; ddp2-shard and
# megatron_hp2-sp-lp run here with recomputation (memory=level2, level1), and without it on Llama's packed documents
# (LLAMA_LAYOUTS) and in bf16 (BF16_LAYOUTS)
TAKEN_ELSEWHERE = ("megatron_hp4", "ddp2-shard", "megatron_hp2-sp-lp")


@pytest.fixture(scope="module")
def runs(workdir) -> dict[str, Path]:
    """STEPS steps in every layout, one after another, sharing one cache (the export runs once)."""
    return sweep([*COMMON, f"train.steps={STEPS}"], [name for name in LAYOUTS if name not in TAKEN_ELSEWHERE], workdir)


def assert_close(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= RTOL * abs(w), f"{what}[{i}]: {g!r} vs {w!r} (rel {abs(g - w) / abs(w):.1e})"


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name not in ("single", *TAKEN_ELSEWHERE)])
def test_layout_matches_one_process(runs, layout):
    got, want = rows(runs[layout]), rows(runs["single"])
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert_close([r["loss"] for r in got], [r["loss"] for r in want], "loss")
    assert_close([r["grad_norm"] for r in got], [r["grad_norm"] for r in want], "global grad norm")
    assert_close([r["eval_loss"] for r in got if "eval_loss" in r], [r["eval_loss"] for r in want if "eval_loss" in r],
                 "eval loss")


def test_layout_is_recorded_in_plan_and_manifest(runs):
    run = runs["dp2_hp2_pp2-shard"]
    manifest = read_json(run / "stages/checkpoint/output/manifest.json")
    assert manifest["trainer"] == {"world_size": 8, "dp": 2, "hp": 2, "pp": 2, "dp_mode": "shard",
                                   "optimizer": "adamw", "seed": 1234, "precision": "fp32"}
    plan = manifest["partition_plan"]
    assert plan["layout"]["world_size"] == 8 and len(plan["pipeline"]) == 2
    assert plan["parameters"]["layers.0.attn.wq.weight"]["shard_shape"] == [32, 64]
    assert ckpt.verify(run / "stages/checkpoint/output") == []
    summary = read_json(run / "stages/train/output/summary.json")
    assert summary["layout"]["dp_mode"] == "shard"


def test_pipeline_runs_record_their_timeline(runs):
    for layout in ("dp2_pp2-zbv-shard", "pipeline_pp4_interleaved", "dp2_hp2_pp2-shard"):
        out = runs[layout] / "stages/train/output"
        timeline = read_json(out / "pipeline_timeline.json")
        pp = int(re.search(r"pp(\d)", layout).group(1))
        assert sorted(r["rank"] for r in timeline["ranks"]) == list(range(pp))
        assert all({e[1] for e in r["events"]} >= {"F"} for r in timeline["ranks"])
        assert (out / "pipeline_timeline.png").stat().st_size > 5000
        assert all(0 <= r["pipeline_idle_fraction"] < 1 for r in rows(runs[layout]))


@pytest.fixture(scope="module")
def five_steps(workdir) -> Path:
    """The first half of runs["dp2_hp2_pp2-shard"] (a constant learning rate): its checkpoint is continued elsewhere."""
    return outputs(run_cli([*COMMON, f"train.steps={HALF}", *LAYOUTS["dp2_hp2_pp2-shard"]], workdir))


def test_checkpoint_reshards_into_other_layouts(runs, workdir, five_steps):
    """HALF steps in dp2_hp2_pp2, then HALF more in megatron_hp4 and in single from that checkpoint: the same
    losses as STEPS uninterrupted steps in dp2_hp2_pp2."""
    checkpoint = (five_steps / "stages/checkpoint/output").resolve()
    reference = [r["loss"] for r in rows(runs["dp2_hp2_pp2-shard"])][HALF:]
    for layout in ("megatron_hp4", "single"):
        result = run_cli([*COMMON, f"train.steps={STEPS}", f"train.init_from={checkpoint}", *LAYOUTS[layout]], workdir)
        cont = outputs(result)
        assert f"train: continues the checkpoint of step {HALF} ({checkpoint}): the {STEPS - HALF} steps from step " \
               f"{HALF} to {STEPS} run" in result.stdout, result.stdout  # and the plan's times count those
        got = rows(cont)
        assert [r["step"] for r in got] == list(range(HALF + 1, STEPS + 1)), layout
        assert read_json(cont / "stages/train/output/summary.json")["resumed_from_step"] == HALF
        assert_close([r["loss"] for r in got], reference, f"{layout} continuing dp2_hp2_pp2")
    # what it requires of a checkpoint is checked with the plan: the optimizer whose state it holds, its checksums
    from orchestrator.config.errors import ConfigError
    from orchestrator.config.validate import validate

    def refusal(*overrides: str) -> str:
        with pytest.raises(ConfigError) as e:
            validate(make_cfg(*COMMON, f"train.steps={STEPS}", *overrides, runs_dir=workdir / "runs"))
        return "\n".join(str(p) for p in e.value.problems if p.key == "train.init_from")

    assert "holds adamw's state" in refusal(f"train.init_from={checkpoint}", "optimizer=sgd")
    damaged = workdir / "damaged"
    shutil.copytree(checkpoint, damaged)
    victim = max((p for p in damaged.rglob("*.distcp")), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert f"{victim.relative_to(damaged)}: sha256 differs from the manifest" in refusal(f"train.init_from={damaged}")


def test_aggregated_checkpoint_continues_in_plain_pytorch(runs, five_steps):
    """The aggregated dp2_hp2_pp2 checkpoint: a plain model scores the distributed eval loss, and a plain
    loop with a plain optimizer loaded from it continues exactly like the distributed run."""
    aggregated = five_steps / "stages/aggregate/output"
    verification = read_json(aggregated / "manifest.json")["verification"]
    distributed = read_json(five_steps / "stages/train/output/summary.json")["final_eval_loss"]
    assert abs(verification["eval_loss"] - distributed) <= RTOL * distributed

    cfg = make_cfg(*COMMON, f"train.steps={STEPS}")
    spec = get_model("gpt")
    model = spec.build(cfg.model)
    optimizer = build_optimizer(cfg.optimizer, model)
    consolidate.load(aggregated, model, optimizer)
    batcher = build_batcher(cfg)
    losses = []
    for step in range(HALF, STEPS):
        batch = batcher.train_batch(step)
        loss = spec.loss(model(batch.inputs), batch.labels) / batch.n_labels
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert_close(losses, [r["loss"] for r in rows(runs["dp2_hp2_pp2-shard"])][HALF:], "plain continuation")


def test_a_killed_rank_fails_the_run_and_the_rerun_resumes(tmp_path):
    args = last_wins([*COMMON, "parallel=ddp2", "train.steps=40", "train.checkpoint_every=10", "train.eval_every=20"])
    env = cli_env()
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    scratch = tmp_path / "runs" / "cache" / "train"
    try:
        deadline = time.monotonic() + 300
        while not any(scratch.glob("*.work/scratch/checkpoints/step_0000010/manifest.json")):
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its step-10 checkpoint"
            time.sleep(0.05)
        started = psutil.Process(proc.pid).children(recursive=True)  # the fork server and the ranks
        ranks = [p for p in started if p.name() == "train.rank1"]
        assert len(ranks) == 1
        killed_at = time.monotonic()
        ranks[0].send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
        ended_after = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1
    assert "rank 1 of 2: killed by signal SIGKILL" in out, out[-4000:]
    assert ended_after < 60, f"took {ended_after:.0f} s to notice (process-group timeout is 300 s)"
    _, leftovers = psutil.wait_procs(started, timeout=15)
    assert leftovers == [], "processes left running"
    work = next(scratch.glob("*.work/scratch/checkpoints"))
    for step_dir in work.iterdir():
        if step_dir.name.startswith("step_"):
            assert ckpt.verify(step_dir) == [], step_dir  # complete ones verify
        else:
            assert not (step_dir / ckpt.MANIFEST).exists(), step_dir  # partial ones never have a manifest
    assert not any(scratch.glob("*/summary.json"))

    result = run_cli(args, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "resumes from step" in result.stdout
    summary = read_json(outputs(result) / "stages/train/output/summary.json")
    assert summary["resumed_from_step"] >= 10 and summary["steps"] == 40


# -- model=llama_tiny: RoPE, RMSNorm, SwiGLU and grouped-query attention in the same layouts, fine-tuned on -------
# prompt/completion records packed as whole documents (a document mask and restarting positions in every block of
# every stage, the prompts' labels -100, records longer than a row cut in pieces)

LLAMA_LAYOUTS = ["single", "ddp2-shard", "megatron_hp2-sp-lp", "pipeline_pp4_interleaved", "dp2_hp2_pp2-replicate"]
LLAMA_ORT = ["single"]  # engine=ort refuses rows of whole documents: it is compared on plain text
# one record a row, padded (data.packing=false): the rows dealt so that dp ranks hold equal real tokens, each rank
# trimming the padding after its last label (another width on each rank, and on one process)
LLAMA_PADDED = ["single", "ddp2-replicate"]


def sums(path: Path) -> Path:
    """Prompt/completion records of a few to a few dozen bytes (rows of 33 tokens hold several; some are longer)."""
    rng = random.Random(0)
    with open(path, "w") as f:
        for i in range(400):
            a, b = rng.randint(0, 999), rng.randint(0, 99)
            prompt = f"{a}+{b}=" + (" (show the work)" * rng.randint(1, 3) if i % 15 == 0 else "")
            f.write(json.dumps({"prompt": prompt, "completion": f"{a + b}"}) + "\n")
    return path


@pytest.fixture(scope="module")
def llama_runs(workdir) -> dict[str, Path]:
    records = ["data=text", f"data.paths=[{sums(workdir / 'sums.jsonl')}]", "data.format=prompt_completion"]
    llama = [*COMMON, f"train.steps={STEPS}", "model=llama_tiny"]
    runs = sweep([*llama, *records], LLAMA_LAYOUTS, workdir)
    runs.update({f"padded-{k}": v for k, v in sweep([*llama, *records, "data.packing=false"], LLAMA_PADDED,
                                                    workdir).items()})
    runs.update({f"text-{name}": outputs(run_cli([*llama, *LAYOUTS[name]], workdir)) for name in LLAMA_ORT})
    runs.update({f"ort-{name}": outputs(run_cli([*llama, "engine=ort", *LAYOUTS[name]], workdir))
                 for name in LLAMA_ORT})
    return runs


@pytest.mark.parametrize("layout", [name for name in LLAMA_LAYOUTS if name != "single"] +
                         [f"padded-{name}" for name in LLAMA_PADDED if name != "single"])
def test_llama_layout_matches_one_process(llama_runs, layout):
    got, want = rows(llama_runs[layout]), rows(llama_runs["padded-single" if "padded" in layout else "single"])
    if "padded" in layout:  # the straggler's share of real tokens is recorded each step
        assert all(1 <= r["rank_tokens_max_over_mean"] < 1.5 for r in got)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert_close([r["loss"] for r in got], [r["loss"] for r in want], "loss")
    assert_close([r["grad_norm"] for r in got], [r["grad_norm"] for r in want], "global grad norm")
    assert_close([r["eval_loss"] for r in got if "eval_loss" in r], [r["eval_loss"] for r in want if "eval_loss" in r],
                 "eval loss")
    assert 0 < want[0]["label_density"] < 0.5  # the prompts' labels are -100, and each record's after its <eos>


@requires_ort_training
@pytest.mark.parametrize("layout", LLAMA_ORT)
def test_llama_on_ort_matches_torch(llama_runs, layout):
    summary = read_json(llama_runs[f"ort-{layout}"] / "stages/train/output/summary.json")
    assert summary["engine"] == "ort" and summary["engine_fallbacks"] == {}
    for g, w in zip(rows(llama_runs[f"ort-{layout}"]), rows(llama_runs[f"text-{layout}"]), strict=True):
        assert abs(g["loss"] - w["loss"]) <= ORT_RTOL * w["loss"], (g["step"], g["loss"], w["loss"])


# -- precision=bf16: the same layouts in mixed precision ----------------------------------------------------------

# ddp2-replicate and pipeline_pp2 are parts of dp2_hp2_pp2-replicate; ddp2-shard is FSDP2's own mixed precision
BF16_LAYOUTS = ["single", "ddp2-shard", "megatron_hp2", "dp2_hp2_pp2-replicate"]
BF16_VS_FP32 = 2e-2    # bf16 compute (8-bit mantissa) against fp32, every step (measured: at most 3.3e-4 over 10)
BF16_LAYOUTS_AGREE = 1e-2  # two bf16 layouts: other reduction orders and casts (autocast vs FSDP2; measured 3.3e-4)


@pytest.fixture(scope="module")
def bf16_runs(workdir) -> dict[str, Path]:
    return sweep([*COMMON, f"train.steps={STEPS}", "precision=bf16"], BF16_LAYOUTS, workdir)


def _worst(got: list[dict], want: list[dict]) -> float:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    return max(abs(g["loss"] - w["loss"]) / abs(w["loss"]) for g, w in zip(got, want))


@pytest.mark.parametrize("layout", BF16_LAYOUTS)
def test_bf16_trains_every_layout_near_fp32(runs, bf16_runs, layout):
    summary = read_json(bf16_runs[layout] / "stages/train/output/summary.json")
    assert summary["precision"] == "bf16"
    fp32 = runs.get(layout, runs["single"])  # ddp2-shard's fp32 run is with recomputation: one process's losses
    assert _worst(rows(bf16_runs[layout]), rows(fp32)) <= BF16_VS_FP32


@pytest.mark.parametrize("layout", [name for name in BF16_LAYOUTS if name != "single"])
def test_bf16_layouts_agree_with_each_other(bf16_runs, layout):
    assert _worst(rows(bf16_runs[layout]), rows(bf16_runs["single"])) <= BF16_LAYOUTS_AGREE


# -- engine=ort: the same layouts with each block's units in ONNX Runtime ------------------------------------

ORT_LAYOUTS = ["single", "dp2_hp2_pp2-replicate", "dp2_hp2_pp2-shard"]  # hp and pp alone are parts of these


@pytest.fixture(scope="module")
def ort_runs(workdir) -> dict[str, Path]:
    return sweep([*COMMON, f"train.steps={STEPS}", "engine=ort"], ORT_LAYOUTS, workdir)


@requires_ort_training
@pytest.mark.parametrize("layout", ORT_LAYOUTS)
def test_ort_losses_match_torch(runs, ort_runs, layout):
    got, want = rows(ort_runs[layout]), rows(runs[layout])
    summary = read_json(ort_runs[layout] / "stages/train/output/summary.json")
    assert summary["engine"] == "ort" and summary["engine_fallbacks"] == {}
    for g, w in zip(got, want, strict=True):
        assert abs(g["loss"] - w["loss"]) <= ORT_RTOL * w["loss"], (g["step"], g["loss"], w["loss"])


@requires_ort_training
@pytest.mark.parametrize("layout", ["single", "dp2_hp2_pp2-replicate"])  # a unit's gradients whatever dp_mode reduces
def test_ort_gradients_match_torch(ort_runs, layout):
    transform = (ort_runs[layout] / "stages/transform/output").resolve()
    world = read_json(transform / "partition_plan.json")["layout"]["world_size"]
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
                             str(ROOT / "tests" / "grad_parity_rank.py"), str(transform),
                             *COMMON, "engine=ort", *LAYOUTS[layout]],
                            capture_output=True, text=True, timeout=600, env=cli_env())
    found = re.search(r'^(\{"worst".*)$', result.stdout, re.M)
    assert found, result.stdout[-2000:] + result.stderr[-3000:]
    parity = json.loads(found.group(1))
    assert parity["fallbacks"] == {} and parity["compared"] > 0
    assert parity["worst"] <= 1.0, parity  # every gradient within 1e-4 relative (floor 1e-6 of the largest)


ZERO_BUBBLE = {schedule: ["parallel.pp=2", "parallel.pp_chunks=2", f"parallel.pp_schedule={schedule}",
                          "parallel.microbatches=4"] for schedule in ("zbv", "interleaved_zb")}


@requires_ort_training
@pytest.mark.parametrize("schedule", list(ZERO_BUBBLE))
def test_ort_zero_bubble_schedules_match_torch_and_one_process(runs, workdir, schedule):
    """torch splits a zero-bubble backward into input and weight passes: the ORT units answer both."""
    ort, torch_ = (rows(outputs(run_cli([*COMMON, f"train.steps={STEPS}", f"engine={engine}",
                                         *ZERO_BUBBLE[schedule]], workdir))) for engine in ("ort", "torch"))
    for o, t, one in zip(ort, torch_, rows(runs["single"]), strict=True):
        assert abs(o["loss"] - t["loss"]) <= ORT_RTOL * t["loss"], (o["step"], o["loss"], t["loss"])
        assert abs(o["loss"] - one["loss"]) <= ORT_RTOL * one["loss"], (o["step"], o["loss"], one["loss"])


@requires_ort_training
def test_ort_new_batch_size_rebuilds_nothing(ort_runs, workdir):
    """Batch and sequence length are dynamic axes: export and transform come from the cache."""
    result = run_cli([*COMMON, f"train.steps={STEPS}", "engine=ort", "train.batch_size=4", "train.seq_len=48",
                      "dry_run=true"], workdir)
    plan = {p["stage"]: p for p in json.loads(Path(re.search(r"plan written to (\S+)\)", result.stdout)
                                                     .group(1)).read_text())}
    assert plan["export"]["cached"] and plan["transform"]["cached"], result.stdout
    assert not plan["train"]["cached"]


@requires_ort_training
def test_ort_fallback_to_torch_is_recorded(tmp_path):
    """ELU has no gradient in ONNX Runtime: with engine.fallback=torch the MLP units run on torch, the
    attention units on ORT, and MLflow says so."""
    args = [*COMMON, "train.steps=4", "engine=ort", "model.activation=elu", "tracking=mlflow"]
    result = run_cli([*args, "engine.fallback=torch"], tmp_path)
    run_dir = outputs(result)
    fallbacks = read_json(run_dir / "stages/train/output/summary.json")["engine_fallbacks"]
    assert list(fallbacks) == ["mlp"] and "gradient graph" in fallbacks["mlp"]
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/runs/mlflow.db")
    train = next(r for r in client.search_runs([client.get_experiment_by_name("orchestrator").experiment_id])
                 if r.info.run_name == "train")
    assert "GetGradientForOp" in train.data.tags["engine.fallback.mlp"]
    assert train.data.metrics["engine/fallback_units"] == 1 and train.data.metrics["engine/ort_units"] == 1


@requires_ort_training
def test_ort_failure_stops_with_orts_message(tmp_path):
    result = run_cli([*COMMON, "train.steps=4", "engine=ort", "model.activation=elu", "engine.fallback=fail"], tmp_path)
    assert result.returncode == 1
    assert "stage transform failed" in result.stdout
    assert "ONNX Runtime cannot build the gradient graph of the mlp graph" in result.stdout
    assert "GetGradientForOp" in result.stdout
