"""The README's config reference is the one the schema generates, and .ci/run runs the README's commands."""
from __future__ import annotations

import json
from pathlib import Path

from orchestrator.config.reference import reference_markdown
from tests.conftest import ROOT


def test_config_reference_is_current():
    page = (ROOT / "docs" / "configuration.md").read_text()
    block = page.split("<!-- reference:start -->\n", 1)[1].split("\n<!-- reference:end -->", 1)[0]
    assert block == reference_markdown(), \
        "run `python -m orchestrator.config.reference` and paste it into docs/configuration.md"


def test_links_of_the_readme_and_docs_lead_somewhere():
    """Every relative link of README.md and docs/*.md names a file that exists, and a heading of it when it has an
    #anchor (GitHub's anchors: lower case, punctuation dropped, spaces to hyphens)."""
    import re

    def anchors(page: str) -> set[str]:
        return {re.sub(r"[^\w\- ]", "", h.lower()).strip().replace(" ", "-")
                for h in re.findall(r"(?m)^#+ (.+)$", page)}

    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert len(pages) >= 10 and len((ROOT / "README.md").read_text().splitlines()) <= 250
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists() or (anchor and file.suffix == ".md" and anchor not in anchors(file.read_text())):
                broken.append(f"{page.name}: {target}")
    assert broken == []


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


ANSWER_HELP = """
import contextlib, io, json, runpy, sys, traceback
answers = {}
for script in sys.argv[1:]:
    sys.argv, out = [script, "--help"], io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code or 0
    except BaseException:
        code = traceback.format_exc()[-1000:]
    answers[script] = [code, out.getvalue()]
print(json.dumps(answers))
"""


def test_every_benchmark_answers_help():
    """Each script as `python benchmarks/<name>.py --help` runs it, one after another in one process (torch is
    imported once, not once per script)."""
    import subprocess
    import sys

    scripts = sorted(str(p) for p in (ROOT / "benchmarks").glob("*.py"))
    done = subprocess.run([sys.executable, "-c", ANSWER_HELP, *scripts], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    answers = json.loads(done.stdout.splitlines()[-1])
    assert len(answers) == len(scripts) >= 10
    for script, (code, text) in answers.items():
        name = Path(script).name
        assert code == 0 and text.strip(), (name, code)
        assert f"python benchmarks/{name}" in text, name  # the usage line is in the text
