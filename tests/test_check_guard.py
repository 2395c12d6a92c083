"""A check never crashes: an exception inside any registered check is a refusal naming the check, its key and
what it raised (orchestrator/config/validate.py's `Check`), with the traceback saved for a report."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from orchestrator.config.errors import ConfigError
from orchestrator.config.validate import CHECKS, validate
from tests.conftest import make_cfg


@pytest.mark.parametrize("check", CHECKS, ids=[f"{c.module}.{c.function}" for c in CHECKS])
def test_an_exception_in_each_check_is_a_refusal_naming_it(check, monkeypatch, tmp_path):
    cfg = make_cfg(runs_dir=tmp_path / "runs")

    def broken(*args, **kwargs):
        raise OSError(5, "Input/output error", str(tmp_path / "a file the check read"))

    monkeypatch.setattr(importlib.import_module(check.module), check.function, broken)
    with pytest.raises(ConfigError) as refused:
        validate(cfg)
    [problem] = [p for p in refused.value.problems if f"{check.module}.{check.function}" in p.rule]
    assert problem.key == check.key
    assert "a file the check read" in problem.rule and "Input/output error" in problem.rule
    saved = Path(re.search(r"the traceback is in (\S+?)\)", problem.rule).group(1))
    assert "Traceback (most recent call last)" in saved.read_text()
    saved.unlink()
