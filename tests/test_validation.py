"""Every validation rule: a bad config fails before anything starts, naming key, value, rule and fix."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from hydra.errors import HydraException

from orchestrator.errors import ConfigError, from_hydra
from orchestrator.validate import validate
from tests.conftest import CONF, make_cfg, run_cli


def problems_of(*overrides: str) -> list:
    cfg = make_cfg(*overrides)
    try:
        validate(cfg, overrides)
    except ConfigError as e:
        return e.problems
    return []


def test_default_config_is_valid():
    assert problems_of() == []


@pytest.mark.parametrize("group", ["model", "parallel", "optimizer", "memory", "triton", "engine", "data",
                                   "cluster", "tracking"])
def test_every_option_composes_and_validates(group):
    """Each option validates; the only problems allowed are the machine's (no SLURM commands here)."""
    for option in sorted(p.stem for p in (CONF / group).glob("*.yaml")):
        overrides = [f"{group}={option}"] + (["data.paths=[README.md]"] if option == "text" else [])
        allowed = {("cluster", "slurm")} if not shutil.which("sbatch") else set()
        got = {(p.key, str(p.value)) for p in problems_of(*overrides)}
        assert got <= allowed, (group, option, got)


RULES = [
    # overrides, the key the error must name, words the rule must contain
    (["parallel.hp=3"], "parallel.hp", "model.n_heads=4"),
    (["cluster.nprocs=3"], "cluster.nprocs", "one process per rank"),
    (["model.n_heads=5"], "model.n_heads", "divisible"),
    (["parallel=pipeline_pp4_interleaved", "model.n_layers=12"], "parallel.pp_chunks", "pipeline stages"),
    (["parallel=pipeline_pp2", "parallel.microbatches=1"], "parallel.microbatches", "at least 2 microbatches"),
    (["parallel.pp=2", "parallel.microbatches=2", "parallel.pp_schedule=interleaved_1f1b"],
     "parallel.pp_chunks", "pp_chunks >= 2"),
    (["parallel.pp=4", "parallel.pp_chunks=2", "parallel.microbatches=2", "parallel.pp_schedule=zbv"],
     "parallel.microbatches", "at least 4 microbatches"),
    (["parallel.pp=2", "parallel.pp_chunks=1", "parallel.microbatches=2", "parallel.pp_schedule=zbv"],
     "parallel.pp_chunks", "pp_chunks == 2"),
    (["parallel.pp=2", "parallel.pp_chunks=2", "parallel.microbatches=2", "parallel.pp_schedule=1f1b"],
     "parallel.pp_chunks", "pp_chunks == 1"),
    (["parallel=pipeline_pp4_interleaved", "parallel.microbatches=9", "train.batch_size=18"],
     "parallel.microbatches", "not a multiple of its 2 rounds"),
    (["train.init_from=/nonexistent"], "train.init_from", "complete checkpoint folder"),
    (["parallel.pp_chunks=2"], "parallel.pp_chunks", "need a pipeline"),
    (["parallel=ddp2", "train.batch_size=15"], "train.batch_size", "divisible by 2"),
    (["parallel.microbatches=3"], "train.batch_size", "divisible by 3"),
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel", "parallel.hp > 1"),
    (["parallel=megatron_hp2", "parallel.sequence_parallel=true", "train.seq_len=63"], "train.seq_len", "split"),
    (["parallel.loss_parallel=true"], "parallel.loss_parallel", "parallel.hp > 1"),
    (["cluster=debug", "parallel=ddp2"], "cluster", "inside this process"),
    (["train.seq_len=256"], "train.seq_len", "model.max_seq_len=128"),
    (["model.vocab_size=200"], "model.vocab_size", "token ids up to 257"),
    (["data=text"], "data.paths", "needs files"),
    (["parallel.dp_mode=foo"], "parallel.dp_mode", "one of replicate, shard"),
    (["parallel.pp_schedule=foo"], "parallel.pp_schedule", "one of gpipe"),
    (["model.dropout=1.5"], "model.dropout", "between 0.0 and 0.95"),
    (["train.steps=0"], "train.steps", ">= 1"),
    (["memory.level=3"], "memory.level", "one of 0, 1, 2"),
    (["engine.opset=18"], "engine.opset", "between 14 and 17"),
    (["engine=ort", "triton=on"], "triton.enabled", "need a CUDA GPU"),
    (["engine=ort", "parallel=megatron_hp2", "parallel.sequence_parallel=true"], "parallel.sequence_parallel",
     "runs each unit"),
    (["+parallel.foo=1"], "parallel.foo", "has no key 'foo'"),
    (["+foo=1"], "foo", "has no key 'foo'"),
    (["+model.n_head=2"], "model.n_head", "has no key 'n_head'"),
]


@pytest.mark.parametrize("overrides,key,words", RULES, ids=[" ".join(r[0]) for r in RULES])
def test_rule(overrides, key, words):
    found = [p for p in problems_of(*overrides) if p.key == key]
    assert found, f"no problem reported for {key}: {problems_of(*overrides)}"
    p = found[0]
    assert words in p.rule, p.rule
    assert p.fix, "every problem suggests a fix"
    text = str(ConfigError(found))
    assert key in text and "rule:" in text and "fix:" in text


def test_hp_fix_lists_valid_degrees():
    p = next(p for p in problems_of("parallel.hp=3") if p.key == "parallel.hp")
    assert "{1, 2, 4}" in p.fix


def test_unknown_key_suggests_the_close_one():
    p = next(p for p in problems_of("+model.n_head=2") if p.key == "model.n_head")
    assert "did you mean model.n_heads" in p.fix


def test_all_problems_are_reported_together():
    keys = {p.key for p in problems_of("train.steps=0", "model.dropout=2", "+parallel.foo=1")}
    assert {"train.steps", "model.dropout", "parallel.foo"} <= keys


def test_ort_kernels_need_cuda_and_ort_triton():
    if torch.cuda.is_available():
        pytest.fail("this test checks the refusal on a machine without CUDA")
    p = next(p for p in problems_of("engine=ort", "triton=on") if p.key == "triton.enabled")
    assert "need a CUDA GPU and ORT's Triton build" in p.rule and "no CUDA device" in p.rule
    assert "engine=torch triton=on" in p.fix
    assert problems_of("engine=torch", "triton=on") == []


@pytest.mark.parametrize("override,key,words", [
    ("parallel.dp=abc", "parallel.dp", "must be an integer"),
    ("dry_run=maybe", "dry_run", "must be true or false"),
    ("parallel.foo=1", "parallel.foo", "has no key 'foo'"),
    ("model=nonexistent", "model", "not an option of the config group 'model'"),
])
def test_hydra_composition_errors_are_translated(override, key, words):
    with pytest.raises(HydraException) as info:
        make_cfg(override)
    err = from_hydra(info.value)
    assert err is not None
    p = err.problems[0]
    assert p.key == key and words in p.rule, p
    assert p.fix


def test_missing_option_lists_the_options():
    with pytest.raises(HydraException) as info:
        make_cfg("model=nonexistent")
    fix = from_hydra(info.value).problems[0].fix
    assert "gpt_tiny" in fix and "schema" not in fix


@pytest.mark.parametrize("args,key", [
    (["parallel.hp=3"], "parallel.hp=3"),
    (["+parallel.foo=1"], "parallel.foo"),
    (["parallel.dp=abc"], "parallel.dp=abc"),
    (["model=nonexistent"], "model=nonexistent"),
])
def test_cli_rejects_before_starting_anything(args, key, workdir: Path):
    result = run_cli(args, workdir)
    assert result.returncode == 2, result.stderr
    assert "nothing was started" in result.stderr
    assert key in result.stderr and "rule:" in result.stderr and "fix:" in result.stderr
    assert "Traceback" not in result.stderr
    runs = workdir / "runs"
    assert not (runs / "cache").exists() and not (runs / "mlflow.db").exists()
