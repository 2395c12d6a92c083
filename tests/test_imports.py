"""The repository's import graph, read with `ast` (every import statement, at module level or inside a function):
no module imports a module that imports it back, and imports point down the layers DESIGN.md gives."""
from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

PACKAGES = ("orchestrator", "stages", "plugins", "storage", "planning", "runtime", "common", "hydra_plugins", "tests",
            "benchmarks")
# the floors, top to bottom: a module imports its own floor and those below, never one above (DESIGN.md)
FLOORS = ("orchestrator", "stages", "planning", "plugins", "runtime", "storage", "common")
# the orchestrator's own rule owners, whose check(cfg) validation collects (the config language imports nothing else)
OWNER_RULES = ("orchestrator.tracking.store_check", "orchestrator.cluster.rules", "orchestrator.cache.store")


def _modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every Python file of the repository's packages and scripts."""
    found = {}
    for top in PACKAGES:
        for path in (root / top).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The repository module an import of `name` loads (`a.b.func` -> `a.b`), or None for third-party names."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = _modules(root)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, up level-1 packages
                    parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(parts + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            edges |= {t for t in (_resolve(x, modules) for x in targets) if t}
        edges.discard(name)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each as a path that closes."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_sees_a_circle_through_a_function_level_import(tmp_path: Path):
    (tmp_path / "orchestrator").mkdir()
    (tmp_path / "orchestrator" / "__init__.py").write_text("")
    (tmp_path / "orchestrator" / "a.py").write_text("from orchestrator.b import thing\n")
    (tmp_path / "orchestrator" / "b.py").write_text("def thing():\n    from orchestrator import a\n")
    (tmp_path / "orchestrator" / "c.py").write_text("from . import a\n")
    graph = import_graph(tmp_path)
    assert graph["orchestrator.c"] == {"orchestrator.a"}
    assert cycles(graph) == [["orchestrator.a", "orchestrator.b"]]


def test_no_import_cycles_in_the_repository():
    assert cycles(import_graph()) == []


def _layer_violations(graph: dict[str, set[str]]) -> list[str]:
    def top(m: str) -> str:
        return m.split(".")[0]

    bad = []
    for m, targets in graph.items():
        for t in targets:
            if top(m) in FLOORS and top(t) in FLOORS and FLOORS.index(top(t)) < FLOORS.index(top(m)):
                bad.append(f"{m} -> {t}: {top(m)} is below {top(t)} (floors: {' > '.join(FLOORS)})")
            if top(m) == "stages" and top(t) == "orchestrator":
                bad.append(f"{m} -> {t}: stages do not import the orchestrator")
            if top(m) == "stages" and top(t) == "stages" and m != "stages" and t not in ("stages", "stages.base"):
                bad.append(f"{m} -> {t}: a stage never imports another stage (they meet through files)")
            if m.startswith("orchestrator.config") and top(t) == "orchestrator" and not t.startswith("orchestrator.config") \
                    and not (m == "orchestrator.config.validate" and t in OWNER_RULES):
                bad.append(f"{m} -> {t}: the config language imports nothing else of the orchestrator")
            if m.startswith("orchestrator.cluster") and t in ("orchestrator.run", "orchestrator.sweeps.launcher",
                                                              "orchestrator.__main__"):
                bad.append(f"{m} -> {t}: cluster modules are used by run and sweep, not the other way")
            if top(m) != "tests" and top(t) == "tests":
                bad.append(f"{m} -> {t}: only tests import tests (what a benchmark shares with them lives below, "
                           "e.g. orchestrator.config.compose)")
    return bad


def test_imports_point_down_the_layers():
    assert _layer_violations(import_graph()) == []


def test_an_import_up_a_floor_is_named():
    bad = _layer_violations({"storage.checkpoint": {"plugins.models.registry"},
                             "plugins.data.rules": {"common.problem"}, "benchmarks.lora": {"tests.conftest"},
                             "tests.test_lora": {"tests.conftest"}})
    assert bad == ["storage.checkpoint -> plugins.models.registry: storage is below plugins "
                   "(floors: orchestrator > stages > planning > plugins > runtime > storage > common)",
                   "benchmarks.lora -> tests.conftest: only tests import tests (what a benchmark shares with them "
                   "lives below, e.g. orchestrator.config.compose)"]
