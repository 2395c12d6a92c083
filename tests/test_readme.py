"""The README's config reference is the one the schema generates, and .ci/run runs the README's commands."""
from __future__ import annotations

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


def test_every_benchmark_answers_help():
    import subprocess
    import sys

    for script in sorted((ROOT / "benchmarks").glob("*.py")):
        done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120,
                              cwd=ROOT)
        assert done.returncode == 0 and done.stdout.strip(), (script.name, done.stderr[-1000:])
        assert f"python benchmarks/{script.name}" in done.stdout, script.name  # the usage line is in the text
