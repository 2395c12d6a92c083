"""Configuration errors in the user's language: the key, the value, the rule and a fix.

Every check reports a `Problem`; all problems of a config are raised together as one `ConfigError`
before anything starts. Hydra's own composition errors (bad types, unknown keys, missing options) are
translated into the same form.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
from typing import Any, Optional

from common.problem import Problem, _show  # Problem is re-exported: the config language's error type



class ConfigError(Exception):
    def __init__(self, problems: list[Problem]):
        self.problems = list(problems)
        super().__init__(str(self))

    def __str__(self) -> str:
        n = len(self.problems)
        head = f"invalid configuration, nothing was started ({n} problem{'s' if n != 1 else ''}):"
        return "\n".join([head] + [f"  x {p}" for p in self.problems])


def field_help(schema: Optional[type], name: str) -> Optional[dataclasses.Field]:
    if schema is None or not dataclasses.is_dataclass(schema):
        return None
    return next((f for f in dataclasses.fields(schema) if f.name == name), None)


def unknown_key_problem(full_key: str, schema: Optional[type], value: Any = "?", override: str = "") -> Problem:
    name = full_key.rsplit(".", 1)[-1]
    section = full_key.rsplit(".", 1)[0] if "." in full_key else "the top level"
    known = [f.name for f in dataclasses.fields(schema)] if schema and dataclasses.is_dataclass(schema) else []
    close = difflib.get_close_matches(name, known, n=1)
    fix = f"did you mean {full_key.rsplit('.', 1)[0] + '.' if '.' in full_key else ''}{close[0]}? " if close else ""
    fix += f"keys of {section}: {', '.join(known)}" if known else "remove it"
    elsewhere = _option_with_key(section, name)
    if elsewhere:
        fix = f"{full_key} is a key of {elsewhere}: add {elsewhere} to the command (or remove the key); " + fix
    how = f"set by the override '{override}'; " if override else ""
    return Problem(full_key, value, f"{section} has no key '{name}' ({how}every key is declared in "
                   "orchestrator/config/schema/, and Hydra's '+key=' would add it unchecked)", fix)


def _option_with_key(section: str, name: str) -> Optional[str]:
    """`cluster=slurm` when `name` is a key of that option's schema but not of the chosen one's (the first such
    option, the others after it: `objective=dpo (or orpo, simpo)`)."""
    from orchestrator.config.options import option_using
    from orchestrator.config.schema import GROUP_SCHEMAS

    found = [option_using(section, schema_name) for schema_name, schema in GROUP_SCHEMAS.get(section, {}).items()
             if name in {f.name for f in dataclasses.fields(schema)}]
    if not found:
        return None
    return f"{section}={found[0]}" + (f" (or {', '.join(found[1:])})" if len(found) > 1 else "")


_TYPE_WORDS = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false", "String": "a string",
               "bool": "true or false"}


def from_hydra(exc: BaseException, argv: tuple[str, ...] = ()) -> Optional[ConfigError]:
    """Translate a Hydra/OmegaConf composition error (argv: the command line's overrides, to quote them);
    None when it is not one we recognise."""
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    if isinstance(exc, MissingConfigException):
        missing = getattr(exc, "missing_cfg_file", "") or ""
        group, _, option = missing.rpartition("/")
        options = [o for o in (getattr(exc, "options", None) or []) if not o.endswith("_schema")]
        if group and options:
            return ConfigError([Problem(group, option, f"'{option}' is not an option of the config group '{group}' "
                                        f"(the files in conf/{group}/)", f"choose one of: {', '.join(options)}")])
        return ConfigError([Problem("config", missing, str(exc).splitlines()[0], "check the config name and path")])
    group_value = re.match(r"Config group override must be a string or a list\. Got (\w+)", str(exc))
    if group_value:  # `model=null`: Hydra's defaults list takes only option names
        group = next((a.split("=", 1)[0].lstrip("+~") for a in argv if a.split("=", 1)[-1] in ("null", "~")), "group")
        return ConfigError([Problem(group, "null", f"{group} is a config group: it takes the name of one of its "
                                    "options", f"{group}=<option> (python -m orchestrator --help lists them)")])
    if isinstance(exc, OverrideParseException):
        return ConfigError([_unreadable_override(getattr(exc, "override", "") or "", str(exc))])
    if not isinstance(exc, ConfigCompositionException):
        return None
    cause = exc.__cause__
    full_key = getattr(cause, "full_key", None)
    schema = getattr(cause, "object_type", None)
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and full_key:
        given = next((a for a in argv if a.lstrip("+~").split("=", 1)[0] == full_key or
                      a.lstrip("+~").split("=", 1)[0].startswith(full_key + ".")), "")
        inside = next((a for a in argv if "=" in a and re.search(rf"[{{,]\s*{re.escape(full_key)}\s*:",
                                                                    a.split("=", 1)[1])), "")
        if not given and inside:  # a key inside a value: data.mix=[{nope: 1}]
            key = inside.lstrip("+~").split("=", 1)[0]
            return ConfigError([dataclasses.replace(unknown_key_problem(full_key, schema, inside.split("=", 1)[1],
                                                                        inside), key=f"{key}: {full_key}")])
        shown = given.lstrip("+~").split("=", 1)[0] if given else full_key  # trian.steps, not just trian
        problem = unknown_key_problem(full_key, schema, given.split("=", 1)[-1] if given else "?", given)
        return ConfigError([dataclasses.replace(problem, key=shown)])
    if isinstance(cause, ValidationError) and full_key:
        name = full_key.rsplit(".", 1)[-1]
        f = field_help(schema, name)
        msg = str(getattr(cause, "msg", cause)).splitlines()[0]
        m = re.search(r"converted to (\w+)|not a valid (\w+)", msg)
        wanted = _TYPE_WORDS.get(next((g for g in (m.groups() if m else ()) if g), ""), "a value of the declared type")
        meaning = f" ({f.metadata['help']})" if f is not None and "help" in f.metadata else ""
        example = None if f is None else f.default if f.default is not dataclasses.MISSING else \
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if isinstance(example, list):
            wanted = "a list" if wanted == "a value of the declared type" else wanted
            example = "[" + ",".join(map(str, example)) + "]"
        elif isinstance(example, dict):  # as an override writes a mapping, not as Python prints one
            wanted = "a mapping" if wanted == "a value of the declared type" else wanted
            example = "{" + ",".join(f"{k}:{_show(v)}" for k, v in example.items()) + "}"
        fix = f"give {full_key} {wanted}" + (f", e.g. {full_key}={_show(example)}" if example is not None else "")
        return ConfigError([Problem(full_key, getattr(cause, "value", "?"), f"{full_key} must be {wanted}{meaning}",
                                    fix)])
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    ambiguous = re.search(r"Ambiguous value for argument '([^=']+)=([^']*)'", lines[0] if lines else "")
    if ambiguous:  # key=a,b without -m
        key, value = ambiguous.groups()
        return ConfigError([Problem(key, value, f"a comma makes {value} several values, and a command without -m "
                                    "runs one experiment", f"-m {key}={value} to sweep over them, {key}=[{value}] "
                                    f"for a list, or {key}='\"{value}\"' for a string")])
    return ConfigError([Problem("config", "", " ".join(lines),  # Hydra's hints included
                                "fix the override named above (python -m orchestrator --help lists the groups)")])


def _unreadable_override(override: str, said: str) -> Problem:
    """An override Hydra's grammar cannot read: its key, the character at fault, and the fix (ASCII for a look-alike
    character, a closing bracket, or quotes around a value holding spaces, parentheses, `=` or `~`)."""
    import unicodedata

    key, _, value = override.lstrip("+~").partition("=")
    first = said.strip().splitlines()[0] if said.strip() else ""
    caret = re.search(r"\n( *)\^", said)
    at = len(caret.group(1)) - len("LexerNoViableAltException: ") if caret else -1
    near = re.search(r"(?:mismatched|extraneous) input '\s*(.)", said)
    upto = re.search(r"no viable alternative at input '(.*)'", said)
    if not 0 <= at < len(override) and near:
        at = override.find(near.group(1), len(key) + 1)
    elif not 0 <= at < len(override) and upto and override.find(upto.group(1)) >= 0:
        at = override.find(upto.group(1)) + len(upto.group(1)) - 1
        at = at if at < len(override) - 1 else -1  # the end of the override: something is missing, not wrong
    bad = override[at] if 0 <= at < len(override) else ""
    rule = f"the override {override!r} cannot be read by Hydra's override grammar"
    if bad:
        name = unicodedata.name(bad, "")
        rule += f": the character {bad!r}{f' ({name})' if name and not bad.isascii() else ''} at position {at + 1}"
    else:
        rule += f" ({first})"
    ascii_value = unicodedata.normalize("NFKC", value)
    open_brackets = value.count("[") - value.count("]")
    if ascii_value != value and ascii_value.isascii() and _parses(f"{key}={ascii_value}"):
        fix = f"type it in ASCII: {key}={ascii_value}"
    elif open_brackets > 0 and _parses(f"{key}={value}{']' * open_brackets}"):
        fix = f"close the list: {key}={value}{']' * open_brackets}"
    else:
        items = value[1:-1].split(",") if value.startswith("[") and value.endswith("]") else None
        quoted = "[" + ",".join(f'"{i.strip()}"' for i in items) + "]" if items else f'"{value}"'
        fix = f"quote the value (Hydra reads spaces, parentheses, =, ~ and quotes only inside quotes), in the " \
              f"shell: '{key}={quoted}'"
    return Problem(key or "override", value or override, rule, fix)


def _parses(override: str) -> bool:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        OverridesParser.create().parse_override(override)
    except HydraException:
        return False
    return True
