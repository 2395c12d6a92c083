"""How a config key is declared: key() with its help text and rules. Here, on the ground floor, so that a component
below the orchestrator (an objective in plugins/objectives/) declares its own config dataclass, as the schema's
sections do (orchestrator/config/schema/)."""
from __future__ import annotations

from dataclasses import field
from typing import Any, Optional


def key(default: Any, help: str, *, choices: tuple = (), content: bool = True,
        min: Optional[float] = None, max: Optional[float] = None, read_when: Optional[tuple] = None):
    """A config field with its documentation and rules (mutable defaults are copied per instance). read_when:
    (another key, the values it must have) for this key to be read at all; set otherwise, it is refused as a key
    that would do nothing (docs/reliability.md)."""
    meta = {"help": help, "choices": choices, "content": content, "min": min, "max": max, "read_when": read_when}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)
