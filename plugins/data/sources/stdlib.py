"""data=stdlib, the default source: the installed Python standard library's .py files (tests excluded), read in
pieces as the user's files are (plugins/data/sources/files.py), fingerprinted with the Python version."""
from __future__ import annotations

import functools
import os
import sys
import sysconfig
from pathlib import Path

from plugins.data.file_corpus import check_amount, fingerprint_files
from plugins.data.registry import DataSource, register_source

_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def _walk(root: Path, suffixes: tuple[str, ...], skip: set[str] = frozenset()) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        found.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(suffixes))
    return found


def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@functools.lru_cache(maxsize=1)
def _stdlib_files() -> list[tuple[str, Path]]:
    """(the installed standard library does not change under a running process: listed once, not per check)"""
    root = _stdlib_root()
    return [(p.relative_to(root).as_posix(), p) for p in _walk(root, (".py",), _SKIP_DIRS)]


def _check_stdlib(cfg) -> list[tuple]:
    return check_amount(_stdlib_files(), cfg)


def _fingerprint_stdlib(cfg) -> str:
    return f"python{sys.version_info[0]}.{sys.version_info[1]}-" + fingerprint_files(_stdlib_files(), cfg.max_bytes)


register_source("stdlib", DataSource(_fingerprint_stdlib, check=_check_stdlib, files=lambda cfg: _stdlib_files()))
