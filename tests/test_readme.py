"""The README's config reference is the one the schema generates, and .ci/run runs the README's commands."""
from __future__ import annotations

from orchestrator.config.reference import reference_markdown
from tests.conftest import ROOT


def test_readme_config_reference_is_current():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("<!-- reference:start -->\n", 1)[1].split("\n<!-- reference:end -->", 1)[0]
    assert block == reference_markdown(), "run `python -m orchestrator.config.reference` and paste it into the README"


def test_ci_runs_the_readme_commands():
    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
    for command in ('pip install -e ".[dev]" -c constraints.txt', "pytest"):
        assert f"```\n{command}\n" in readme or f"\n{command}\n" in readme
        assert f"\n{command}\n" in ci


def test_readme_layout_names_every_module_of_the_orchestrator():
    readme = (ROOT / "README.md").read_text()
    layout = readme.split("## Layout\n", 1)[1].split("\n## ", 1)[0]
    words = set(layout.replace("/", " ").replace(",", " ").replace("(", " ").replace(")", " ").replace(":", " ").split())
    pkg = ROOT / "orchestrator"
    modules = {p.stem for p in pkg.rglob("*.py") if p.name != "__init__.py"}
    folders = {p.name for p in pkg.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    top = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".") and
           not p.name.endswith(".egg-info")} - {"__pycache__", "outputs", "multirun"}  # git-ignored
    assert sorted(modules - words) == [] and sorted(folders - words) == [] and sorted(top - words) == []


def test_every_benchmark_answers_help():
    import subprocess
    import sys

    for script in sorted((ROOT / "benchmarks").glob("*.py")):
        done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120,
                              cwd=ROOT)
        assert done.returncode == 0 and done.stdout.strip(), (script.name, done.stderr[-1000:])
        assert f"python benchmarks/{script.name}" in done.stdout, script.name  # the usage line is in the text
