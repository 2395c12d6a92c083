"""The README as a new user follows it: every command of "Using it" (on the tiny model, a few steps; the SLURM one
as a dry run, which needs no SLURM) and every Python block of the README and docs/, pasted as they are."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT, run_cli

pytestmark = pytest.mark.e2e
SHORT = ["train.steps=2", "train.batch_size=4", "train.seq_len=32", "train.eval_every=0", "train.checkpoint_every=0",
         "tracking=none"]


def _section(title: str) -> str:
    return (ROOT / "README.md").read_text().split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def using_it_commands() -> list[list[str]]:
    block = _section("Using it").split("```\n", 2)[1]
    commands = []
    for line in block.splitlines():
        if line.startswith("python -m orchestrator"):
            args = shlex.split(line.split("  #")[0])[3:]
            commands.append(args)
    return commands


def python_blocks() -> list[str]:
    """Every Python block of the README and of docs/ (the topic pages' examples run as the README's do)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [textwrap.dedent(b) for page in pages for b in re.findall(r"```python\n(.*?)```", page.read_text(), re.S)]


def test_the_readme_has_the_examples_this_test_runs():
    assert len(using_it_commands()) >= 9 and len(python_blocks()) >= 3


def test_every_using_it_command_and_python_block_works_as_pasted(workdir, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "notes.txt").write_text("a line of text for the corpus\n" * 400)
    outputs = {}
    for args in using_it_commands():
        args = [a.replace("/path/to/corpus", str(corpus)) for a in args if not a.startswith("train.steps=")]
        extra = [] if "--cfg" in args else SHORT
        if "hydra/sweeper=optuna" in args:  # a study of 2 trials takes the path of Optuna's default 20
            extra = [*extra, "hydra.sweeper.n_trials=2"]
        result = run_cli([*args, *extra], workdir, timeout=600)
        assert result.returncode == 0, f"{args}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
        found = re.search(r"^outputs: (\S+)", result.stdout, re.M)
        if found and not args:
            outputs["default"] = found.group(1)
    run_dir = outputs["default"]
    for block in python_blocks():
        code = block.replace("runs/outputs/<date>/<time>", run_dir)
        done = subprocess.run([sys.executable, "-c", code], cwd=workdir, capture_output=True, text=True, timeout=300,
                              env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
        assert done.returncode == 0, f"{code}\n{done.stderr[-3000:]}"


def test_the_offline_fine_tuning_walk_through_runs_as_pasted(tmp_path):
    """docs/models-and-data.md's "Offline" block, line by line in an empty folder: the tiny Llama and its chats made
    with transformers, the preview (nothing started), the fine-tune through every stage (2 steps, in one process)
    with the model folder's own tokenizer (data.tokenizer=auto)."""
    page = (ROOT / "docs" / "models-and-data.md").read_text()
    block = page.split("### Offline: a tiny Llama fine-tuned on chats\n", 1)[1].split("```shell\n", 1)[1]
    lines = block.split("```", 1)[0].strip().splitlines()
    assert [line.split()[:3] for line in lines] == [["python", "scripts/tiny_chat_model.py", "tiny-llama"]] + \
        [["python", "-m", "orchestrator"]] * 2
    made = subprocess.run([sys.executable, str(ROOT / lines[0].split()[1]), *shlex.split(lines[0])[2:]],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-2000:]
    assert (tmp_path / "tiny-llama" / "chat_template.jinja").is_file() and (tmp_path / "chats.jsonl").is_file()
    shown = run_cli(shlex.split(lines[1])[3:] + ["tracking=none"], tmp_path, timeout=300)
    assert shown.returncode == 0 and "line 2 as the model sees it" in shown.stdout, shown.stdout[-3000:]
    assert "⟦" in shown.stdout and "nothing was started" in shown.stdout
    args = [a for a in shlex.split(lines[2])[3:] if not a.startswith("train.steps=")]
    done = run_cli(args + SHORT + ["cluster=debug"], tmp_path, timeout=600)  # every stage in one process: quicker
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "data.tokenizer=auto: hf:tiny-llama (train.init_from's own)" in done.stdout  # the folder's, not bytes
    assert re.search(r"aggregate\s+│ ran", done.stdout), done.stdout[-3000:]
    # docs/preference.md's recipe goes on from this fine-tune: its pairs made, then the experiment of three phases in
    # one command (conf/experiment/sft_dpo.yaml): the same fine-tune, DPO from its hf/ folder (the start and the
    # reference), and arith_chat on the DPO's model
    page = (ROOT / "docs" / "preference.md").read_text()
    block = page.split("## Offline: tiny model, SFT, then DPO, then a score\n", 1)[1].split("```shell\n", 1)[1]
    steps = block.split("```", 1)[0].strip().splitlines()
    assert steps == [lines[0] + " --pairs pairs.jsonl", "python -m orchestrator experiment=sft_dpo"], steps
    made = subprocess.run([sys.executable, str(ROOT / steps[0].split()[1]), *shlex.split(steps[0])[2:]],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert made.returncode == 0 and (tmp_path / "pairs.jsonl").is_file(), made.stderr[-2000:]
    few = ["phases.sft.train.steps=2", "phases.dpo.train.steps=2", "++phases.score.evaluate.limit=8"]
    recipe = run_cli(shlex.split(steps[1])[3:] + few + [a for a in SHORT if not a.startswith("train.steps=")]
                     + ["cluster=debug"], tmp_path, timeout=600)
    out = recipe.stdout
    assert recipe.returncode == 0, out[-3000:] + recipe.stderr[-3000:]
    assert "objective: dpo (sigmoid, beta 0.1)" in out and "reward acc" in out
    # its SFT phase trains as the command above did (the model folder made again: its files' times are new, so the
    # phase runs again, to the same losses)
    fine_tune = re.search(r"│ train\s+│ ran\s+│[^│]*│ (loss [\d.]+, eval [\d.]+)", done.stdout).group(1)
    assert re.search(rf"sft/train\s+│ ran\s+│[^│]*│ {fine_tune}", out), (fine_tune, out[-9000:])
    assert re.search(r"dpo/reference\s+│ ran", out) and re.search(r"score/evaluate\s+│ ran .*arith_chat/acc", out)
