"""Built-in data sources: the Python standard library's source (default), user text files, random tokens."""
from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from pathlib import Path

import numpy as np

from plugins.data import Corpus, DataSource, corpus_from_documents, register_source

_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
_TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst")


def _walk(root: Path, suffixes: tuple[str, ...], skip: set[str] = frozenset()) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        found.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(suffixes))
    return found


def _read(files: list[tuple[str, Path]], max_bytes: int) -> list[tuple[str, bytes]]:
    docs, total = [], 0
    for name, path in files:
        data = path.read_bytes()
        if max_bytes and total + len(data) > max_bytes:
            break
        docs.append((name, data))
        total += len(data)
    return docs


def _fingerprint_files(files: list[tuple[str, Path]], max_bytes: int) -> str:
    h = hashlib.sha256(str(max_bytes).encode())
    for name, path in files:
        st = path.stat()
        h.update(f"{name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


# -- stdlib: the installed Python standard library's .py files (tests excluded) -------------------------

def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_files() -> list[tuple[str, Path]]:
    root = _stdlib_root()
    return [(p.relative_to(root).as_posix(), p) for p in _walk(root, (".py",), _SKIP_DIRS)]


def _load_stdlib(cfg, model_vocab: int) -> Corpus:
    return corpus_from_documents(_read(_stdlib_files(), cfg.max_bytes), cfg)


def _fingerprint_stdlib(cfg) -> str:
    return f"python{sys.version_info[0]}.{sys.version_info[1]}-" + _fingerprint_files(_stdlib_files(), cfg.max_bytes)


# -- text: the user's own files ---------------------------------------------------------------------------

def _text_files(cfg) -> list[tuple[str, Path]]:
    files = []
    for entry in cfg.paths:
        p = Path(entry).expanduser()
        if p.is_dir():
            files.extend((f.as_posix(), f) for f in _walk(p, _TEXT_SUFFIXES, {"__pycache__"}))
        elif p.is_file():
            files.append((p.as_posix(), p))
        else:
            raise FileNotFoundError(f"data.paths entry {entry!r} does not exist")
    return files


def _load_text(cfg, model_vocab: int) -> Corpus:
    return corpus_from_documents(_read(_text_files(cfg), cfg.max_bytes), cfg)


def _fingerprint_text(cfg) -> str:
    return _fingerprint_files(_text_files(cfg), cfg.max_bytes)


# -- synthetic: uniform random tokens over the model's vocabulary --------------------------------------------

def _load_synthetic(cfg, model_vocab: int) -> Corpus:
    rng = np.random.default_rng(0)
    n = cfg.synthetic_tokens
    n_val = max(int(n * cfg.val_fraction), 1)
    stream = rng.integers(0, model_vocab, size=n, dtype=np.int64)
    return Corpus([stream[n_val:]], [stream[:n_val]], model_vocab, packed=True)


register_source("stdlib", DataSource(_load_stdlib, _fingerprint_stdlib, vocab_size=258))
register_source("text", DataSource(_load_text, _fingerprint_text, vocab_size=258))
register_source("synthetic", DataSource(_load_synthetic, lambda cfg: "synthetic-v1", vocab_size=None))
