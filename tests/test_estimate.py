"""The memory estimate: in the plan, a refusal when it cannot fit, and within 25% of what training really takes
(the worst rank's peak RSS on this CPU, what `top` shows) for gpt_small in four layouts."""
from __future__ import annotations

import json
import re

import pytest

from planning.plan import memory_line, partition_plan, time_line
from planning.estimate import estimate, step_flops
from tests.conftest import make_cfg, run_cli, run_folder

COMMON = ["model=gpt_small", "train.batch_size=8", "train.seq_len=256", "train.steps=3", "train.eval_every=0",
          "train.checkpoint_every=0", "tracking=none", "train.progress=false"]


def test_the_plan_states_the_estimate():
    line = memory_line(make_cfg())
    assert line.startswith("memory: ") and "GB per rank at its peak" in line and "available RAM" in line


def test_the_plan_states_a_floor_on_time():
    cfg = make_cfg("model=gpt_small", "train.steps=1000")
    n = partition_plan(cfg)["n_parameters"]
    tokens = cfg.train.batch_size * cfg.train.seq_len
    assert step_flops(cfg, n) == tokens * (6 * n + 12 * cfg.model.n_layers * cfg.model.d_model * cfg.train.seq_len)
    line = time_line(cfg)
    assert re.match(r"time: [\d.,]+ TFLOP per step; matmuls here run at [\d,]+ GFLOP/s \(\d+ CPU thread", line), line
    assert "so a step takes at least" in line and "1000 steps at least" in line
    assert "not estimated here" in time_line(make_cfg("cluster=slurm"))


def test_sharding_recomputation_and_more_ranks_lower_it():
    def total(*o):
        cfg = make_cfg("model=gpt_small", *o)
        return estimate(cfg, partition_plan(cfg)).total
    assert total("parallel=ddp2", "parallel.dp_mode=shard") < total("parallel=ddp2")
    assert total("memory=level1") < total() and total("parallel=megatron_hp2") < total()
    assert total("parallel=pipeline_pp2") < total() and total("precision=bf16") < total()


@pytest.mark.e2e
@pytest.mark.parametrize("layout", ["single", "ddp2", "megatron_hp2", "pipeline_pp2"])
def test_within_a_quarter_of_the_measured_peak(layout, workdir):
    args = [*COMMON, f"parallel={layout}"]
    result = run_cli(args, workdir)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    run_dir = run_folder(result)
    measured = json.loads((run_dir / "stages/train/output/summary.json").read_text())["peak_memory_mb"]
    cfg = make_cfg(*args)
    estimated = estimate(cfg, partition_plan(cfg)).total / 2**20
    assert 0.75 <= measured / estimated <= 1.25, (measured, estimated)
