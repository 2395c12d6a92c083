"""The key=value overrides a refusal's fix offers, read from its text, for tests/test_fixes_hold.py to apply.

A fix is prose with overrides in it: "model.vocab_size=320 or more, or data.vocab_size=2048". The overrides next to
each other (only spaces or shell quotes between them) are one alternative: "engine=torch triton=on". A value runs to
the first space, shell quote or closing bracket outside brackets, or to a comma or semicolon before a space, less
the sentence's last punctuation; a key followed by a space ("data.paths= the files") names no value."""
from __future__ import annotations

import re

_KEY = re.compile(r"(?:(?<=[\s'(])|^)(-m\s+)?([+~]?[A-Za-z_][\w.\[\]]*)=(?=\S)")
_PLACEHOLDERS = ("<", "...", "/path/to")  # hf:<folder>, [...]: the user's own values, no override


def alternatives(fix: str) -> list[list[tuple[str, str, bool]]]:
    """The fix's alternatives in order, each a list of (key, value, swept: given after -m)."""
    groups: list[list[tuple[str, str, bool]]] = []
    end = None
    for m in _KEY.finditer(fix):
        if end is not None and m.start() < end:
            continue
        value, stop = _value(fix, m.end())
        if not value:
            continue
        if not (groups and re.fullmatch(r"[\s']*", fix[end:m.start()])):
            groups.append([])
        groups[-1].append((m.group(2), value, bool(m.group(1))))
        end = stop
    return groups


def mechanical(group: list[tuple[str, str, bool]], roots: set[str]) -> bool:
    """An alternative a test can apply as it is: keys of the config, no placeholder, not a sweep."""
    return all(re.split(r"[.\[]", key.lstrip("+~"))[0] in roots and not swept and
               not any(p in value for p in _PLACEHOLDERS) for key, value, swept in group)


def applied(overrides: list[str], group: list[tuple[str, str, bool]]) -> list[str]:
    """The overrides with the fix's: each replaces the override of its key (all of them, once), or is added."""
    out = list(overrides)
    for key, value, _ in group:
        same = [i for i, o in enumerate(out) if o.lstrip("+~").split("=", 1)[0] == key.lstrip("+~")]
        for i in reversed(same[1:]):
            del out[i]
        if same:
            out[same[0]] = f"{key}={value}"
        else:
            out.append(f"{key}={value}")
    return out


def _value(text: str, i: int) -> tuple[str, int]:
    depth, quoted, j = 0, False, i
    while j < len(text):
        c = text[j]
        if c == '"':
            quoted = not quoted
        elif quoted:
            pass
        elif c in "[{(":
            depth += 1
        elif c in "]})":
            if depth == 0:
                break
            depth -= 1
        elif depth == 0 and (c.isspace() or c == "'" or (c in ",;" and (j + 1 == len(text) or text[j + 1].isspace()))):
            break
        j += 1
    value = text[i:j]
    while value and value[-1] in ".?:":
        value, j = value[:-1], j - 1
    return value, j


def first_fix(overrides: list[str], fix: str, roots: set[str]) -> list[tuple[str, str, bool]] | None:
    """The fix's first alternative a test can apply (None: it has none). An override the input already holds is
    the fix's reference to it ("data.packing=false (data=preference sets it)"), not a change."""
    return next((g for g in alternatives(fix) if mechanical(g, roots) and applied(overrides, g) != overrides), None)


def not_fixed(problem, group: list[tuple[str, str, bool]], after: list) -> list:
    """What comes back once the fix is applied: the same problem (its key and rule), or a value the fix gave refused
    in turn."""
    given = {key.lstrip("+~") for key, _, _ in group}
    return [q for q in after if (q.key, q.rule) == (problem.key, problem.rule) or q.key in given]
