"""cluster=slurm against a real 2-node SLURM cluster (scripts/slurm_cluster.sh, NODES=2: each slurmd in a network
namespace of its own; started here if needed).

A failing stage's dependants cancelled and the rerun resuming there, a 2-point sweep with per-point resources and one
shared export, a layout tune whose trials are jobs submitted together, an experiment's three phases submitted at once
and chained by afterok, and requests the scheduler refuses reported with their key. The five stages as jobs on both
nodes (preempted, and ending with one process's losses) and a lost node: test_slurm_recovery.py.
"""
from __future__ import annotations

import json

import mlflow
import pytest

from tests.conftest import run_cli
from tests.test_experiment import make_recipe_files
from tests.slurm_support import SMALL, jobs_of, our_queued_jobs, run_dirs, sacct, slurm  # noqa: F401

pytestmark = pytest.mark.slurm


def test_failed_stage_cancels_dependants_shows_traceback_and_rerun_resumes(slurm, workdir):
    args = ["cluster=slurm", "train.steps=3", *SMALL]
    failed = run_cli(args, workdir, env={"ORCHESTRATOR_FAIL_STAGE": "train"})
    assert failed.returncode == 1, failed.stdout + failed.stderr
    out = failed.stdout
    assert "Traceback" in out and "injected failure: ORCHESTRATOR_FAIL_STAGE=train" in out
    (run_dir,) = run_dirs(workdir)
    jobs = {j["stage"]: j["job_id"] for j in jobs_of(run_dir)}
    states = sacct(list(jobs.values()))
    assert states[jobs["train"]]["state"] == "FAILED"
    assert states[jobs["checkpoint"]]["state"] == "CANCELLED" and states[jobs["aggregate"]]["state"] == "CANCELLED"
    assert "cancelled: needs train" in out

    again = run_cli(args, workdir)
    assert again.returncode == 0, again.stdout + again.stderr
    rerun_dir = next(d for d in run_dirs(workdir) if d != run_dir)
    assert [j["stage"] for j in jobs_of(rerun_dir)] == ["train", "checkpoint", "aggregate"]  # export, transform cached

    client = mlflow.MlflowClient(f"sqlite:///{workdir}/runs/mlflow.db")
    exp = client.get_experiment_by_name("orchestrator")
    stage_runs = client.search_runs([exp.experiment_id], "tags.`orchestrator.kind` = 'stage'")
    by = {(r.data.tags["orchestrator.stage"], r.info.status) for r in stage_runs}
    assert ("train", "FAILED") in by and ("checkpoint", "KILLED") in by and ("train", "FINISHED") in by
    assert not [r for r in stage_runs if r.info.status == "RUNNING"]

    cached = run_cli(args, workdir)  # everything cached: nothing is submitted, and MLflow records it at once
    assert cached.returncode == 0, cached.stdout[-3000:] + cached.stderr[-3000:]
    assert "every stage is cached" in cached.stdout
    (parent,) = client.search_runs([exp.experiment_id], "attributes.status = 'FINISHED' and tags.`orchestrator.kind` = "
                                   "'invocation'", order_by=["attribute.start_time DESC"], max_results=1)
    kids = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert len(kids) == 6 and {k.data.tags["orchestrator.status"] for k in kids} == {"cached"}

    # the jobs' times (sacct's) were recorded: a plan of more steps on these nodes times its stages by them
    planned = run_cli([*args, "train.steps=6", "dry_run=true"], workdir)
    assert planned.returncode == 0 and "  stages: about " in planned.stdout, planned.stdout[-3000:]
    assert " a step: " in planned.stdout and "measured on SLURM partition (the default) " in planned.stdout


def test_sweep_runs_points_concurrently_with_their_own_resources_and_one_export(slurm, workdir):
    result = run_cli(["-m", "cluster=slurm", "parallel=single,ddp2", "train.steps=4", *SMALL], workdir,
                     timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    dirs = run_dirs(workdir)
    assert len(dirs) == 2
    jobs = [j for d in dirs for j in jobs_of(d)]
    assert len({j["job_id"] for j in jobs if j["stage"] == "export"}) == 1          # submitted once, shared
    assert sorted(j["tasks"] for j in jobs if j["stage"] == "train") == [1, 2]
    trains = sacct([j["job_id"] for j in jobs if j["stage"] == "train"])
    spans = sorted((t["start"], t["end"]) for t in trains.values())
    assert spans[1][0] < spans[0][1], f"the two train jobs did not overlap: {spans}"

    summary = json.loads(next((workdir / "runs" / "multirun").rglob("sweep_summary.json")).read_text())
    rows = summary["points"]
    assert [r["status"] for r in rows] == ["ok"] * 2
    assert {r["layout"] for r in rows} == {"dp1 hp1 pp1", "dp2 hp1 pp1"}
    assert rows[0]["final_loss"] == pytest.approx(rows[1]["final_loss"], rel=1e-5)  # one layout's loss, the other's
    assert "final loss" in result.stdout and "tokens/s" in result.stdout

    client = mlflow.MlflowClient(f"sqlite:///{workdir}/runs/mlflow.db")
    exp = client.get_experiment_by_name("orchestrator")
    (sweep,) = client.search_runs([exp.experiment_id], "tags.`orchestrator.kind` = 'sweep'")
    assert sweep.info.status == "FINISHED"
    points = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{sweep.info.run_id}'")
    assert len(points) == 2
    for p in points:
        stages = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{p.info.run_id}'")
        assert sorted(s.data.tags["orchestrator.stage"] for s in stages) == \
            ["aggregate", "checkpoint", "export", "tokenize", "train", "transform"]
        assert all(s.info.status == "FINISHED" for s in stages)


def test_tune_submits_every_trial_at_once_and_ranks_them(slurm, workdir):
    result = run_cli(["cluster=slurm", "tune=layout", "tune.world_size=2", "tune.steps=4", "tracking=none", *SMALL],
                     workdir, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    record = json.loads(next((workdir / "runs").rglob("tune.json")).read_text())
    assert len(record["ranking"]) == 4 and all(t["status"] == "ran" for t in record["trials"])
    trains = [j["job_id"] for d in run_dirs(workdir) for j in jobs_of(d) if j["stage"] == "train"]
    spans = sorted((t["start"], t["end"]) for t in sacct(trains).values())
    assert len(spans) == 4 and any(b[0] < a[1] for a, b in zip(spans, spans[1:])), f"no two trials overlapped: {spans}"
    assert "cluster=slurm" in record["command"] and "tune" not in record["command"]


def test_oversized_request_is_refused_at_submission_and_nothing_stays_queued(slurm, workdir):
    result = run_cli(["cluster=slurm", "parallel=megatron_hp4", "cluster.cpus_per_task=64", *SMALL], workdir)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "cluster.cpus_per_task=64" in result.stderr and "More processors requested than permitted" in result.stderr
    assert "fix:  cluster.cpus_per_task=" in result.stderr
    assert next((workdir / "runs").rglob("plan.json"))  # planned, submitted in part, then cancelled:
    assert not our_queued_jobs(workdir)


def test_an_experiment_submits_its_phases_at_once_each_waiting_on_the_model_it_starts_from(slurm, workdir):
    """experiment=sft_dpo (docs/experiments.md): SFT, DPO and a score submitted by one command before any job ran;
    the stages that read a phase's start wait on the job of the aggregate that writes it (as SLURM holds them), the
    others do not. Submitted only (cluster.wait=false), then cancelled: following jobs to their end is every other
    SLURM test's path, and the chain is what this one adds."""
    import subprocess

    make_recipe_files(workdir)
    args = ["experiment=sft_dpo", "cluster=slurm", "cluster.wait=false", "phases.sft.train.steps=2",
            "phases.dpo.train.steps=2", "train.batch_size=4", "train.seq_len=32", "train.eval_every=0",
            "train.checkpoint_every=0"]
    try:
        result = run_cli(args, workdir, timeout=600)
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
        jobs = {d.name: {j["stage"]: j for j in jobs_of(d)} for d in run_dirs(workdir)}
        assert set(jobs) == {"sft", "dpo", "score"}
        sft, dpo, score = jobs["sft"], jobs["dpo"], jobs["score"]
        made_by_sft, made_by_dpo = sft["aggregate"]["job_id"], dpo["aggregate"]["job_id"]
        assert made_by_sft in dpo["train"]["after"] and made_by_sft in dpo["reference"]["after"]
        assert made_by_dpo in score["train"]["after"]
        assert not dpo["tokenize"]["after"]  # what does not read the start runs beside the earlier phase
        held = subprocess.run(["scontrol", "show", "job", score["train"]["job_id"]], capture_output=True,
                              text=True).stdout
        assert f"afterok:{made_by_dpo}" in held, held  # as SLURM holds it
        client = mlflow.MlflowClient(f"sqlite:///{workdir}/runs/mlflow.db")
        exp = client.get_experiment_by_name("orchestrator")
        (experiment,) = client.search_runs([exp.experiment_id], "tags.`orchestrator.kind` = 'experiment'")
        phases = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{experiment.info.run_id}'")
        assert experiment.data.tags["orchestrator.status"] == "submitted"
        assert sorted(p.data.tags["orchestrator.phase"] for p in phases) == ["dpo", "score", "sft"]
    finally:
        queued = our_queued_jobs(workdir)
        if queued:
            subprocess.run(["scancel", *queued], capture_output=True, timeout=60)
