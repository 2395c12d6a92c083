"""Every `python -m orchestrator` command of docs/ is checked as its dry run checks it before planning: composed as
the CLI composes it and validated by every rule (orchestrator/phases.py's check: a run's, or each phase's), so that no
page shows a command the orchestrator refuses. The paths a page names stand for the reader's files: they are made
here (a corpus, JSON Lines records, chats, a tiny Llama folder); a sweep's points are each value's first
combination. The README's own commands run whole (tests/test_readme_examples.py)."""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from orchestrator.phases import check
from orchestrator.config.errors import ConfigError
from plugins.data.indexed_dataset import write_index
from tests.conftest import ROOT, make_cfg

# lines whose placeholder needs a run of the reader's own (a checkpoint's key), or that are not the orchestrator's
# command: each names why
EXEMPT = {"train.init_from=runs/cache/checkpoint/<key>": "a checkpoint of the reader's earlier run"}


def docs_commands() -> list[tuple[str, list[str]]]:
    """(page, the command's arguments) for every `python -m orchestrator` line of docs/*.md's code blocks."""
    found = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        for lang, block in re.findall(r"```(\w*)\n(.*?)```", page.read_text(), re.S):
            if lang == "python":
                continue
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                if line.startswith("python -m orchestrator ") or line.strip() == "python -m orchestrator" or \
                        line.startswith("python -m orchestrator  "):
                    found.append((page.name, shlex.split(line.split("  #")[0].split(" # ")[0])[3:]))
    return found


def help_commands() -> list[tuple[str, list[str]]]:
    """`python -m orchestrator --help`'s common commands (orchestrator/config/help.py), checked as the pages' are."""
    from orchestrator.config.help import COMMANDS as SHOWN

    return [("--help", shlex.split(command)[3:]) for command, _ in SHOWN if "--cfg" not in command]


COMMANDS = docs_commands() + help_commands()


@pytest.fixture(scope="module")
def readers_files(tmp_path_factory) -> Path:
    """The files the pages' commands name, made where they name them (relative paths: in this folder)."""
    tmp = tmp_path_factory.mktemp("reader")
    made = subprocess.run([sys.executable, str(ROOT / "scripts" / "tiny_chat_model.py"), "tiny-llama", "--chats",
                           "chats.jsonl", "--pairs", "pairs.jsonl", "--records", "2000"], cwd=tmp,
                          capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-2000:]
    text = "".join(f"line {i} of a document in the reader's corpus, with some words in it\n" for i in range(3000))
    for folder in ("corpus", "data", "sft", "fineweb", "web", "code"):
        (tmp / folder).mkdir(exist_ok=True)
    for folder in ("corpus", "fineweb", "web", "code"):
        (tmp / folder / "notes.txt").write_text(text)
    (tmp / "data" / "train.jsonl").write_text("".join(json.dumps({"body": line}) + "\n" for line in text.splitlines()))
    (tmp / "sft" / "train.jsonl").write_text("".join(json.dumps({"prompt": f"{i} + 1 =", "completion": f" {i + 1}"})
                                                     + "\n" for i in range(3000)))
    (tmp / "sft" / "chats.jsonl").write_text((tmp / "chats.jsonl").read_text())
    pairs = [json.loads(line) for line in (tmp / "pairs.jsonl").read_text().splitlines()]
    (tmp / "feedback.jsonl").write_text("".join(json.dumps({"prompt": p["prompt"], "completion": p[side],
                                                            "label": side == "chosen"}) + "\n"
                                                for p in pairs for side in ("chosen", "rejected")))
    (tmp / "megatron").mkdir()  # a corpus tokenized for Megatron-LM (docs/models-and-data.md)
    docs = [np.arange(1, 40 + i, dtype=np.uint16) for i in range(30)]
    (tmp / "megatron" / "web_text_document.bin").write_bytes(np.concatenate(docs).tobytes())
    write_index(str(tmp / "megatron" / "web_text_document"), np.uint16, [len(d) for d in docs])
    (tmp / "my_tasks").mkdir()  # an lm-eval task of the reader's own (docs/evaluate.md)
    questions = tmp / "my_tasks" / "questions.jsonl"  # loaded by lm-eval before launch: a real task, data and all
    questions.write_text("".join(json.dumps({"question": f"{i} + 1 =", "choices": [f" {i + 1}", f" {i}"], "answer": 0})
                                 + "\n" for i in range(8)))
    (tmp / "my_tasks" / "my_task.yaml").write_text(
        f"task: my_task\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {questions}\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: answer\nmetric_list:\n  - metric: acc\n")
    return tmp


def as_run_here(args: list[str], tmp: Path) -> list[str]:
    """The command with the reader's paths pointing at the files made here, its sweep at its first point, and
    dry_run=true (the SLURM ones need no SLURM then). model=llama_1b with a Llama folder: the tiny one made here has
    llama_tiny's shape (a real 1B folder takes 5 GB)."""
    where = {"/path/to/gpt2": "tiny-llama", "/path/to/llama-instruct": "tiny-llama", "/path/to/llama": "tiny-llama",
             "/data/fineweb-edu": "fineweb", "/shared/fineweb-edu-10BT": "fineweb", "/data/web": "web",
             "/data/code": "code", "/data/my_tasks": "my_tasks", "/data/megatron": "megatron",
             "runs/outputs/<date>/<time>/stages/aggregate/output/hf": "tiny-llama"}  # a fine-tune's: a Llama too
    out = []
    sweep = "-m" in args
    for a in args:
        if a == "-m":
            continue
        for placeholder, here in where.items():
            a = a.replace(placeholder, str(tmp / here))
        if sweep and "=" in a:
            override = OverridesParser.create().parse_override(a)
            if override.is_sweep_override():
                value = override.value()
                first = value.start if override.is_interval_sweep() else next(iter(override.sweep_string_iterator()))
                a = f"{override.get_key_element()}={first}"
        if a.startswith("hydra") or a.startswith("hydra/"):
            continue  # the sweeper's settings: orchestrator/sweeps/check.py's (tests/test_hpo.py)
        out.append("plan.trace=false" if a == "plan.trace=true" else a)  # checked without tracing 70B for a minute:
        # tests/test_trace.py checks the trace, and docs/trace.md's verdicts are its figures
    if any("tiny-llama" in a for a in out) and "model=llama_1b" in out:
        out[out.index("model=llama_1b")] = "model=llama_tiny"
    return out if "dry_run=true" in out else [*out, "dry_run=true"]


def test_the_pages_have_their_commands():
    pages = {page for page, _ in COMMANDS}
    assert len(COMMANDS) >= 35 and {"models-and-data.md", "slurm-and-sweeps.md", "layouts.md"} <= pages


@pytest.mark.parametrize("page,args", COMMANDS, ids=[f"{p}: {' '.join(a)}" for p, a in COMMANDS])
def test_every_docs_command_passes_its_checks(page, args, readers_files, monkeypatch):
    if any(k in " ".join(args) for k in EXEMPT):
        assert any(k in " ".join(args) for k in EXEMPT)  # listed with its reason above
        return
    monkeypatch.chdir(readers_files)
    overrides = as_run_here(args, readers_files)
    cfg = make_cfg(*overrides, runs_dir=readers_files / "runs")
    try:
        check(cfg, overrides)
    except ConfigError as e:
        pytest.fail(f"{page}: python -m orchestrator {' '.join(args)}\n{e}")
