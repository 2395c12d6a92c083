"""A variant's peak memory measured alone: the benchmark runs itself again in a fresh process with `--one=<json>`,
which prints the process's VmHWM (this process image's high-water mark; ru_maxrss would carry the parent's over fork
and exec) after the variant's steps."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional


def one_spec(argv: list[str]) -> Optional[list]:
    """The variant given by `--one=`, if this is the fresh process."""
    spec = next((a.split("=", 1)[1] for a in argv if a.startswith("--one=")), None)
    return None if spec is None else json.loads(spec)


def print_peak() -> None:
    hwm = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM:"))
    print(int(hwm.split()[1]) / 2**20)


def peak_gb(script: str, spec: list[Any]) -> float:
    """GB: the script's variant `spec`, alone in a fresh process."""
    out = subprocess.run([sys.executable, script, f"--one={json.dumps(spec)}"], capture_output=True, text=True,
                         check=True)
    return float(out.stdout.strip().splitlines()[-1])
