"""The README's config reference is the one the schema generates, and .ci/run runs the README's commands."""
from __future__ import annotations

from orchestrator.reference import reference_markdown
from tests.conftest import ROOT


def test_readme_config_reference_is_current():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("<!-- reference:start -->\n", 1)[1].split("\n<!-- reference:end -->", 1)[0]
    assert block == reference_markdown(), "run `python -m orchestrator.reference` and paste it into the README"


def test_ci_runs_the_readme_commands():
    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
    for command in ('pip install -e ".[dev]"', "pytest"):
        assert f"```\n{command}\n" in readme or f"\n{command}\n" in readme
        assert f"\n{command}\n" in ci
