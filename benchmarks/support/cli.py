"""The benchmarks' command line: `key=value` arguments; -h or --help prints the script's docstring (its usage)."""
from __future__ import annotations

import sys


def arguments(argv: list[str], doc: str) -> dict[str, str]:
    if any(a in ("-h", "--help") for a in argv):
        print(doc)
        sys.exit(0)
    loose = [a for a in argv if "=" not in a and not a.startswith("--")]
    if loose:
        sys.exit(f"error: arguments are key=value, not {' '.join(loose)}\n{doc}")
    return dict(a.split("=", 1) for a in argv if "=" in a)
