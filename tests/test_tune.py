"""tune=layout: every layout of the ranks tried for a few steps, ranked, the winner's command printed (and it runs);
a second tune takes every trial from the cache."""
from __future__ import annotations

import json
import re
import shlex

import pytest

from orchestrator.sweeps.tune import candidates
from tests.conftest import make_cfg, run_cli

pytestmark = pytest.mark.e2e
ARGS = ["tune=layout", "tune.world_size=2", "model=gpt_small", "tune.steps=5", "train.batch_size=8",
        "train.seq_len=64", "tracking=none"]


def test_candidates_cover_every_factorisation_and_dp_mode():
    layouts = {(c["parallel.dp"], c["parallel.hp"], c["parallel.pp"], c["parallel.dp_mode"]) for c in candidates(4)}
    assert layouts == {(4, 1, 1, "replicate"), (4, 1, 1, "shard"), (2, 2, 1, "replicate"), (2, 2, 1, "shard"),
                       (2, 1, 2, "replicate"), (2, 1, 2, "shard"), (1, 4, 1, "replicate"), (1, 2, 2, "replicate"),
                       (1, 1, 4, "replicate")}


def test_candidates_try_each_schedule_and_microbatch_count_on_pipelines():
    found = candidates(2, ["1f1b", "zbv"], [1, 4])
    pipelines = {(c["parallel.pp_schedule"], c["parallel.pp_chunks"], c["parallel.microbatches"])
                 for c in found if c["parallel.pp"] == 2}
    assert pipelines == {("1f1b", 1, 2), ("1f1b", 1, 8), ("zbv", 2, 2), ("zbv", 2, 8)}
    assert [c for c in found if c["parallel.pp"] == 1] == [c for c in candidates(2) if c["parallel.pp"] == 1]


def test_tune_ranks_layouts_and_its_winner_runs(workdir):
    first = run_cli(ARGS, workdir, timeout=900)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    record = json.loads(next((workdir / "runs" / "outputs").rglob("tune.json")).read_text())
    assert len(record["ranking"]) == 4 and all(t["status"] == "ran" for t in record["trials"])
    speeds = [next(t["tokens_per_s"] for t in record["trials"] if t["label"] == label) for label in record["ranking"]]
    assert speeds == sorted(speeds, reverse=True)
    assert (next((workdir / "runs" / "outputs").rglob("tune.png"))).stat().st_size > 1000
    command = re.search(r"^(python -m orchestrator .*)$", first.stdout, re.M).group(1)
    assert command == record["command"]

    again = run_cli(ARGS, workdir, timeout=300)
    assert again.returncode == 0
    second = json.loads(sorted((workdir / "runs" / "outputs").rglob("tune.json"))[-1].read_text())
    assert all(t["status"] == "cached" for t in second["trials"])

    winner = run_cli([*shlex.split(command)[3:], "train.steps=2", "train.eval_every=0"], workdir, timeout=300)
    assert winner.returncode == 0, winner.stdout[-2000:] + winner.stderr[-2000:]


def test_layout_keys_beside_tune_are_refused_and_a_dry_run_plans_every_trial(tmp_path):
    from orchestrator.sweeps.tune import tune, tune_problems

    given = ["tune=layout", "tune.world_size=1", "parallel=ddp2", "memory=level1"]
    cfg = make_cfg(*given, runs_dir=tmp_path / "runs")
    assert {p.key for p in tune_problems(cfg, given)} == {"parallel", "memory"}
    given = ["tune=layout", "tune.world_size=1", "cluster=debug", "tracking=none", "dry_run=true"]
    assert tune(make_cfg(*given, runs_dir=tmp_path / "runs"), tmp_path / "run", given) == 0  # planned, not failed
    assert (tmp_path / "run" / "trials" / "dp1_hp1_pp1" / "plan.json").is_file()
    assert not (tmp_path / "runs" / "cache").exists()
    # a data preview previews the records once and exits 0: no trial is planned, none "fails: not run"
    given = ["tune=layout", "tune.world_size=1", "tracking=none", "data.preview=1"]
    assert tune(make_cfg(*given, runs_dir=tmp_path / "runs"), tmp_path / "preview", given) == 0
    assert not (tmp_path / "preview").exists()


def test_no_layout_that_fits_is_refused_before_any_trial_with_the_nearest_that_does(tmp_path):
    from orchestrator.sweeps.tune import layout_problems

    given = ["tune=layout", "tune.world_size=3", "train.batch_size=8"]  # 3 divides neither the batch nor the heads
    (p,) = layout_problems(make_cfg(*given, runs_dir=tmp_path))
    assert p.key == "tune.world_size" and "dp3 hp1 pp1 replicate, dp3 hp1 pp1 shard: train.batch_size" in p.rule
    assert p.fix.startswith("tune.world_size=2, whose layouts dp2 hp1 pp1 replicate")
    assert layout_problems(make_cfg(*given, "tune.world_size=2", runs_dir=tmp_path)) == []  # the fix holds
    # one rank cannot run it either: the config's own problem, with its own fix
    (p,) = layout_problems(make_cfg(*given, "data=text", "data.paths=[/nonexistent/x.txt]", runs_dir=tmp_path))
    assert p.key == "data.paths"
