"""The catalogue of bad inputs: every one is refused before anything starts, with the key, the value, the rule and a
fix; legal but unwise settings run with a one-line warning in the plan. docs/reliability.md "What gets refused, and how" lists
the same cases (a test keeps them in step)."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from common.problem import _show
from orchestrator.config.errors import ConfigError
from orchestrator.config.validate import warnings
from tests.conftest import ROOT, make_cfg, problems_of, run_cli
from tests.fix_overrides import applied, first_fix, not_fixed
from tests.refusal_catalogue import CATALOGUE, write_corpus

# Cases whose fix names key=value overrides that a test cannot apply as they stand, and why. A fix with no override
# in it (prose: "a regular text file") is not listed; every other fix's first override a test can apply is applied
# (tests/fix_overrides.py reads them), and the same refusal must not come back.
FIX_NOT_APPLIED = {
    "cluster.partition=gpu": "cluster=slurm, the fix, needs SLURM's commands, which the test machine may lack",
    "train.steps=4,8": "the first fix is a sweep (-m), checked point by point; [4,8] is for keys that take lists",
    "train.init_from=/runs/my run (1)/step_0000100": "the fix quotes the user's own path, which does not exist here",
    "parallel.pp_schedule=foo": "with parallel.pp=1, the fix's gpipe is refused next as doing nothing (no pipeline): "
                                "plugins/parallel/rules.py checks that after the schema's choices",
    "model.d_model=65536 model.n_layers=64": "each fix lessens the memory; no one of them fits a 4 TB model",
    "data=megatron": "the fix names an example prefix (/data/corpus_text_document): the user's corpus",
    "objective=dpo": "the fix names an example file of pairs (pairs.jsonl)",
    "objective=kto": "the fix names an example file of unpaired records (feedback.jsonl)",
    "data.chosen_field=better": "data.format=preference, the fix, needs files of pairs and a preference objective",
    "cluster=slurm +cluster.time_min.eval=5": "the fix's key replaces the one given (eval is no stage): it is not added",
    "++phases.a.train.steps=5 train.steps=7": "the fix moves the command's value into the phase: the command's own "
                                             "override goes, which a key=value alone cannot say",
    "++phases.a.dry_run=true": "the fix moves the phase's value out of it: the phase's own goes (~), which a key=value "
                               "alone cannot say",
}
ROOTS = set(make_cfg().keys())


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def test_the_catalogue_has_sixty_cases_or_more():
    assert len(CATALOGUE) >= 60


@pytest.mark.parametrize("overrides,key,words", CATALOGUE, ids=[" ".join(c[0]) for c in CATALOGUE])
def test_refused_with_key_value_rule_and_fix(overrides, key, words, corpus, tmp_path, monkeypatch):
    case, overrides = overrides, [o.replace("{tmp}", str(corpus)) for o in overrides]
    found = [p for p in problems_of(overrides, tmp_path / "runs") if p.key == key]
    assert found, f"{overrides}: nothing reported for {key}"
    p = found[0]
    assert words in p.rule + " " + p.fix, str(p)
    assert p.rule and p.fix and _show(p.value) != "", str(p)
    shown = str(ConfigError([p]))
    assert f"x {key}=" in shown and "rule:" in shown and "fix:" in shown
    assert not (tmp_path / "runs" / "cache").exists()
    fix = first_fix(overrides, p.fix, ROOTS)
    if fix is not None and " ".join(case) not in FIX_NOT_APPLIED:  # every fix fixes: applied, it holds
        monkeypatch.chdir(tmp_path)  # a relative path a fix names (sqlite:///runs/mlflow.db) lands here
        fixed = applied(overrides, fix)
        back = not_fixed(p, fix, problems_of(fixed, tmp_path / "fixed"))
        assert not back, f"{fixed}: the fix {p.fix!r} does not hold: " + "; ".join(map(str, back))


@pytest.mark.parametrize("args,key", [
    (["data=text", "data.paths=[/nonexistent/corpus.txt]"], "data.paths"),
    (["tracking.uri=http://127.0.0.1:9"], "tracking.uri"),
    (["optimizer.lr=nan"], "optimizer.lr"),
    (["tune=layout", "tune.world_size=0"], "tune.world_size"),  # checked before any layout is listed
    (["tune=layout", "tune.world_size=3", "train.batch_size=8"], "tune.world_size"),  # no layout of 3 fits
    (["train.steps=４"], "train.steps"),  # a lexer error names the key
    (["-m", "data.max_bytes=16000000,10"], "data.max_bytes"),
    (["-m", "optimizer.lr=1e-3,3e-4", "data=text", "data.paths=[/abs/dir]", "dry_run=true"], "data.paths"),
    # the boundary: Hydra's own keys and errors, and whole sweeps with their search spaces, before anything is written
    (["hydra.run.dir=/proc/orchestrator/run"], "hydra.run.dir"),
    (["runs_dir=${oc.env:ORCHESTRATOR_UNSET_VARIABLE}"], "hydra.run.dir"),
    (["model=null"], "model"),
    (["-m", "parallel.hp=1,3"], "parallel.hp"),  # the first point is valid: nothing of it may run either
    (["-m", "optimizer.lr=interval(1e-4,1e-3)"], "optimizer.lr"),
    (["-m", "train.steps=range(5,5)"], "train.steps"),
    (["-m", "hydra/sweeper=optuna", "optimizer.lr=tag(log,interval(0,1e-3))"], "optimizer.lr"),
    (["-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=4", "parallel.hp=choice(1,3)"], "parallel.hp"),
    (["-m", "hydra/sweeper=optuna", "hydra.sweeper.n_jobs=0", "optimizer.lr=interval(1e-4,1e-3)"],
     "hydra.sweeper.n_jobs"),
    (["-m", "hydra/sweeper=optuna", "hydra.sweeper.storage=sqlite:///optuna.db", "optimizer.lr=interval(1e-4,1e-3)"],
     "hydra.sweeper.storage"),  # the orchestrator keeps the study (orchestrator/sweeps/study.py)
])
def test_the_command_exits_2_and_writes_nothing(args, key, workdir):
    """Through the real command (a sweep is checked point by point, data included, before any point runs), which
    writes nothing before it refuses."""
    result = run_cli(args, workdir, timeout=300)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert f"x {key}=" in result.stderr and "rule:" in result.stderr and "fix:" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert not (workdir / "runs").exists(), "written before the refusal: no run or sweep folder, no cache, no store"


def test_checks_that_stopped_on_an_input_become_refusals_or_pass(corpus, tmp_path, workdir):
    """Two inputs whose checks once stopped with "report this": a data.preview in a sweep (its points preview, not
    train: the sweep's time line leaves them out) runs; a DatasetDict with no train split is refused once, by the
    data rule, not again by the plan's check that reads the same folder. And data.long_documents=refuse on chats,
    once refused as read only with data.packing_strategy=bfd: auto is bfd for chats."""
    from datasets import Dataset, DatasetDict

    assert problems_of(["data=text", f"data.paths=[{corpus}/chats.jsonl]", "data.format=chat",
                        f"data.chat_template={corpus}/chatml.jinja", "data.long_documents=refuse",
                        "train.eval_batches=1"], tmp_path) == []

    DatasetDict({"test": Dataset.from_dict({"text": ["hello world " * 50] * 20})}).save_to_disk(tmp_path / "no_train")
    found = problems_of(["data=text", f"data.paths=[{tmp_path}/no_train]"], tmp_path / "runs")
    assert [p.key for p in found] == ["data.split"] and "none of them" in found[0].rule
    done = run_cli(["-m", "optimizer.lr=1e-3,3e-4", "data.preview=1", "tracking=none"], workdir, timeout=300)
    assert done.returncode == 0 and "report this" not in done.stderr + done.stdout, done.stderr[-2000:]
    assert done.stdout.count("data.preview=1: nothing was started") == 2


def test_an_unexpected_error_is_one_line_naming_the_file_that_holds_its_traceback():
    from orchestrator.boundary import unexpected

    try:
        raise RuntimeError("a [bold]bug[/bold]\nsecond line")
    except RuntimeError as e:
        line = unexpected(e)
    assert "\n" not in line and line.startswith("error: RuntimeError: a [bold]bug[/bold] (an unexpected error")
    saved = Path(re.search(r"the traceback is in (\S+?);", line).group(1))
    assert "Traceback (most recent call last)" in saved.read_text() and "second line" in saved.read_text()
    saved.unlink()


def test_legal_but_unwise_settings_run_with_a_warning(tmp_path):
    many = make_cfg("parallel=dp2_hp2_pp2")
    notes = warnings(many)
    if (os.cpu_count() or 1) < 8:
        assert any("8 ranks (dp*hp*pp) on" in n and "share cores" in n for n in notes)
    assert any("reduce-overhead" in n for n in warnings(make_cfg("triton=on", "triton.mode=reduce-overhead")))
    assert warnings(make_cfg()) == []
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    letters = {c: i for i, c in enumerate(["[UNK]", "<eos>", *"abcdefghijklmnopqrstuvwxyz+=?"])}  # no digits
    tok = Tokenizer(models.WordPiece(vocab=letters, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="[UNK]").save_pretrained(tmp_path)
    notes = warnings(make_cfg("evaluate.tasks=[arith_mc]", f"data.tokenizer=hf:{tmp_path}", "model.vocab_size=64"))
    assert any("16 of the 16 answers of arith_mc's first 4 questions hold data.tokenizer's unknown token" in n
               for n in notes), notes


def test_the_fixes_not_applied_are_catalogue_cases():
    assert set(FIX_NOT_APPLIED) <= {" ".join(overrides) for overrides, _, _ in CATALOGUE}


def test_docs_list_every_case():
    readme = (ROOT / "docs" / "reliability.md").read_text()
    section = readme.split("## What gets refused, and how\n", 1)[1].split("\n## ", 1)[0]
    for overrides, key, _ in CATALOGUE:
        assert re.search(re.escape(f"`{' '.join(overrides)}`"), section), overrides
