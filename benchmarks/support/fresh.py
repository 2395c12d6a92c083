"""A variant's peak memory measured alone: the benchmark runs itself again in a fresh process with `--one=<json>`,
which prints the process's peak (runtime.machine.peak_rss_bytes: VmHWM) after the variant's steps."""
from __future__ import annotations

import json
import subprocess
import sys
from typing import Any, Optional


def one_spec(argv: list[str]) -> Optional[list]:
    """The variant given by `--one=`, if this is the fresh process."""
    spec = next((a.split("=", 1)[1] for a in argv if a.startswith("--one=")), None)
    return None if spec is None else json.loads(spec)


def print_peak() -> None:
    from runtime.machine import peak_rss_bytes

    print(peak_rss_bytes() / 2**30)


def peak_gb(script: str, spec: list[Any]) -> float:
    """GB: the script's variant `spec`, alone in a fresh process."""
    out = subprocess.run([sys.executable, script, f"--one={json.dumps(spec)}"], capture_output=True, text=True,
                         check=True)
    return float(out.stdout.strip().splitlines()[-1])
