"""The options of the config tree conf/: which files each group offers, the defaults, and which option is built on
which schema. (The schemas registered with Hydra sit in the same groups; they are not options.)"""
from __future__ import annotations

from pathlib import Path

import yaml

CONF = Path(__file__).resolve().parents[2] / "conf"


def defaults(conf: Path = CONF) -> dict[str, str]:
    """group -> its default option (config.yaml's defaults list)."""
    return {k: str(v) for entry in yaml.safe_load((conf / "config.yaml").read_text())["defaults"]
            if isinstance(entry, dict) for k, v in entry.items() if "/" not in k and not k.startswith("override")}


def options_of(group: str, conf: Path = CONF) -> list[str]:
    """The options of a group, its default first."""
    options = sorted(p.stem for p in (conf / group).glob("*.yaml"))
    default = defaults(conf).get(group)
    if default in options:
        options.insert(0, options.pop(options.index(default)))
    return options


def option_using(group: str, schema_name: str, conf: Path = CONF) -> str:
    """An option file of a group built on the given schema (e.g. optimizer/sgd.yaml on sgd_schema): the group's
    default when it is (data=stdlib, which runs as it is, not data=chat, which needs files), else a `*_tiny` one
    (model=llama_tiny runs anywhere, llama2_70b does not), else the first."""
    default = defaults(conf).get(group)
    paths = sorted((conf / group).glob("*.yaml"), key=lambda p: (p.stem != default, not p.stem.endswith("_tiny"),
                                                                  p.stem))
    for path in paths:
        if schema_name in (yaml.safe_load(path.read_text()) or {}).get("defaults", []):
            return path.stem
    raise LookupError(f"no option of {group} uses {schema_name}")
