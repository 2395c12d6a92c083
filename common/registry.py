"""Named specs of one pluggable kind (models, data sources, engines): the built-in ones register when their module is
imported, third-party packages through an entry-point group (`[project.entry-points."orchestrator.models"]` and so
on), whose functions are called once, on the first lookup. Lookups come from threads too (a sweep's points side by
side), so that first load happens under a lock: no thread sees the registry half-filled."""
from __future__ import annotations

import threading
from importlib.metadata import entry_points
from typing import Generic, TypeVar

Spec = TypeVar("Spec")


class Registry(Generic[Spec]):
    def __init__(self, key: str, group: str):
        self.key, self.group = key, group  # the config key that names an entry; the entry-point group
        self._specs: dict[str, Spec] = {}
        self._loaded = False
        self._lock = threading.Lock()

    def register(self, name: str, spec: Spec) -> None:
        self._specs[name] = spec

    def _load_plugins(self) -> None:
        if self._loaded:
            return
        with self._lock:
            if not self._loaded:
                for ep in entry_points(group=self.group):
                    ep.load()()
                self._loaded = True

    def names(self) -> list[str]:
        """Every registered name: the built-in ones and those third-party packages add."""
        self._load_plugins()
        return sorted(self._specs)

    def get(self, name: str) -> Spec:
        self._load_plugins()
        if name not in self._specs:
            raise KeyError(f"{self.key}={name!r} is not registered; known: {', '.join(sorted(self._specs))}")
        return self._specs[name]
