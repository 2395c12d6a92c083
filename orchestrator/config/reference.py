"""The config reference (docs/configuration.md), generated from the schema and conf/ (a test keeps it in sync).

    python -m orchestrator.config.reference
"""
from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any


from omegaconf import OmegaConf

from orchestrator.config.options import CONF, option_using, options_of
from orchestrator.config.schema import GROUP_SCHEMAS, Config



def _show(v: Any) -> str:
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def _compose(conf: Path, overrides: tuple[str, ...] = ()):
    from orchestrator.config.compose import compose_config

    return compose_config(*overrides, conf=conf)


def _rules(meta) -> str:
    rules = []
    if meta.get("choices"):
        rules.append("one of " + ", ".join(_show(c) for c in meta["choices"]))
    bounds = [f"{op} {meta[k]}" for k, op in (("min", ">="), ("max", "<=")) if meta.get(k) is not None]
    if bounds:
        rules.append(" and ".join(bounds))
    if not meta.get("content", True):
        rules.append("not part of cache keys")
    return f" ({'; '.join(rules)})" if rules else ""


def _table(conf: Path, default_cfg, section: str, schemas: dict[str, type]) -> list[str]:
    """One table per section. Values are those of the default experiment; keys that only some options
    have are shown with that option's value and marked."""
    lines = ["", f"**{section}**", "", "| key | default | meaning |", "| --- | --- | --- |"]
    common = set.intersection(*({f.name for f in dataclasses.fields(s)} for s in schemas.values()))
    seen: set = set()
    for schema_name, schema in schemas.items():
        for f in dataclasses.fields(schema):
            # a key every option has: one row; one that only some have: a row per option (its meaning may differ)
            row = f.name if f.name in common else (schema_name, f.name)
            if row in seen or dataclasses.is_dataclass(f.type):
                continue
            seen.add(row)
            cfg, only = default_cfg, ""
            if f.name not in common:
                option = option_using(section, schema_name, conf)
                cfg, only = _compose(conf, (f"{section}={option}",)), f" *({option} only)*"
            value = _show(OmegaConf.select(cfg, f"{section}.{f.name}"))
            lines.append(f"| `{section}.{f.name}` | `{value}` | {f.metadata.get('help', '')}"
                         f"{_rules(f.metadata)}{only} |")
    return lines


def reference_markdown(conf: Path = CONF) -> str:
    lines = ["| group | options (default first) |", "| --- | --- |"]
    for group in GROUP_SCHEMAS:
        lines.append(f"| `{group}` | " + ", ".join(f"`{o}`" for o in options_of(group, conf)) + " |")
    lines.append("| `experiment` | none; " + ", ".join(f"`{p.stem}`" for p in sorted((conf / "experiment").glob(
        "*.yaml"))) + " (phases run in order: docs/experiments.md) |")
    default_cfg = _compose(conf)
    hints = typing.get_type_hints(Config)  # every section without a config group (train, ..., evaluate, sweep)
    own = [(f.name, {f.name: hints[f.name]}) for f in dataclasses.fields(Config)
           if f.name not in GROUP_SCHEMAS and dataclasses.is_dataclass(hints[f.name])]
    for section, schemas in [*GROUP_SCHEMAS.items(), *own]:
        lines += _table(conf, default_cfg, section, schemas)
    top = [f for f in dataclasses.fields(Config) if f.name in ("dry_run", "runs_dir", "cache_dir", "cache_verify",
                                                                "phases")]
    lines += ["", "**top level**", "", "| key | default | meaning |", "| --- | --- | --- |"]
    lines += [f"| `{f.name}` | `{_show(default_cfg[f.name])}` | {f.metadata['help']}{_rules(f.metadata)} |"
              for f in top]
    return "\n".join(lines)


if __name__ == "__main__":
    print(reference_markdown())
