"""What a newcomer meets in the first hour: --help, pasted dry-run commands, follow on a local run, tidy run
folders, loading the trained model in one line."""
from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import torch

import orchestrator
from orchestrator.config.options import options_of
from orchestrator.config.schema import GROUP_SCHEMAS
from tests.conftest import QUICK, cli_env, run_cli, run_folder


def test_help_names_every_group_and_option_and_no_schema(workdir):
    result = run_cli(["--help"], workdir, timeout=60)
    assert result.returncode == 0
    for group in GROUP_SCHEMAS:
        line = next(line for line in result.stdout.splitlines() if line.strip().startswith(group + " "))
        assert all(o in line for o in options_of(group)), line
    assert "_schema" not in result.stdout and "dry_run=true" in result.stdout and "docs/configuration.md" in result.stdout


def test_a_default_run_its_folder_and_its_model_in_one_line(workdir):
    result = run_cli([*QUICK, "tracking=none"], workdir)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    run_dir = run_folder(result)
    assert f"the trained model: {run_dir / 'stages/aggregate/output'}" in result.stdout
    assert not list(run_dir.rglob("*.log")) or all(p.stat().st_size > 0 for p in run_dir.rglob("*.log"))
    assert not (run_dir / "orchestrator.log").exists()
    mode = stat.S_IMODE((run_dir / "plan.json").stat().st_mode)
    assert mode == stat.S_IMODE((run_dir / "config.yaml").stat().st_mode), oct(mode)

    model = orchestrator.load(run_dir)
    assert not model.training and model(torch.tensor([[1, 2, 3]])).shape == (1, 3, 320)
    model, optimizer = orchestrator.load(run_dir / "stages/aggregate/output", optimizer=True)
    assert optimizer.state  # the moments came back too

    followed = subprocess.run([sys.executable, "-m", "orchestrator.follow", str(run_dir)], cwd=workdir, text=True,
                              capture_output=True, env=cli_env(), timeout=60)
    assert followed.returncode == 2 and "only a run submitted with cluster=slurm" in followed.stderr.lower()


def test_the_commands_a_dry_run_prints_run_when_pasted(workdir):
    result = run_cli([*QUICK, "tracking=none", "dry_run=true", "data.tasks=1"], workdir)  # one process: pasteable
    assert result.returncode == 0
    command = next(line for line in result.stdout.splitlines() if line.startswith("tokenize: "))
    argv = command.split(": ", 1)[1].split()
    pasted = subprocess.run(argv, cwd=workdir, capture_output=True, text=True, timeout=300,
                            env=cli_env())
    assert pasted.returncode == 0, pasted.stdout[-2000:] + pasted.stderr[-2000:]
    assert json.loads(Path(argv[-1]).read_text())["stage"] == "tokenize"


def test_a_profile_of_chosen_steps_is_a_chrome_trace_with_cpu_ops(tmp_path):
    from tests.conftest import cache_entry, run_debug

    report = run_debug(tmp_path, "train.profile=[3,5]")
    assert report.exit_code == 0
    (trace,) = (cache_entry(tmp_path, report, "train") / "profile").glob("profile_rank0_steps3-5.json")
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("cat") == "cpu_op" and e.get("name", "").startswith("aten::") for e in events)
    log = (tmp_path / "run" / "stages" / "train" / "rank0.log").read_text()
    assert "profile of steps 3-5" in log and "aten::" in log
