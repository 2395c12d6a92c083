"""The code a stage runs: every project module it reaches through its imports, found by reading them.

A stage's cache key hashes the source of these modules. The list is derived, never kept by hand (hand-kept lists
drift from the imports, and an edit to a module missing from them served every stage from the old cache): starting
at the stage's module, every `import` and `from ... import` of a project package (anywhere in a file: a function's
lazy import counts), the packages' `__init__` files that importing runs, and the same for each module found.
Imports are read with `ast` and resolved to files, so nothing is imported to find out.
"""
from __future__ import annotations

import ast
import hashlib
import threading
from functools import lru_cache
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]
# CPython 3.11's AST construction is not thread-safe: two threads parsing at once (sweep points planning side by
# side) raised "SystemError: AST constructor recursion depth mismatch (before=48, after=43)" under CI's load
# (python/cpython#106905). One parse at a time.
_PARSING = threading.Lock()
PACKAGES = ("stages", "plugins", "storage", "planning", "runtime", "common", "orchestrator")  # what a stage may reach


def module_file(module: str, root: Path) -> Optional[Path]:
    """The file of a project module (a package's __init__.py), or None when it is not one."""
    if module.split(".")[0] not in PACKAGES:
        return None
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@lru_cache(maxsize=None)
def _imported(module: str, path: Path) -> frozenset[str]:
    """The modules an import statement in this file names, with the packages importing them runs (each file read
    once per process: the stages reach many of the same modules)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    with _PARSING:
        tree = ast.parse(path.read_text(), str(path))
    for node in _statements(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package this module is in, up level - 1
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)  # a submodule, where it is one
    found = set()
    for name in names:
        parts = name.split(".")
        found.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))  # parents' __init__ run first
    return frozenset(found)


def _statements(tree: ast.AST):
    """Every statement of a module, nested ones included (an import is a statement: the expressions, most of a
    module's nodes, need no visit)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            todo.extend(getattr(node, field, ()) or ())


@lru_cache(maxsize=None)
def reached(module: str, root: Path = ROOT) -> tuple[str, ...]:
    """Every project module that importing `module` runs, itself included, sorted."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        current = todo.pop()
        path = module_file(current, root)
        if current in seen or path is None:
            continue
        seen.add(current)
        todo.extend(_imported(current, path) - seen)
    return tuple(sorted(seen))


@lru_cache(maxsize=None)
def source_hash(module: str, root: Path = ROOT) -> str:
    """sha256 of a project module's source file."""
    path = module_file(module, root)
    if path is None:
        raise ImportError(f"{module} is not a module of the project under {root}")
    return hashlib.sha256(path.read_bytes()).hexdigest()


def code_material(module: str, root: Optional[Path] = None) -> dict[str, str]:
    """{module: its source's hash} for what a stage's module reaches: the key's code part (the tree at root,
    default this checkout)."""
    root = root or ROOT
    return {m: source_hash(m, root)[:16] for m in reached(module, root)}
