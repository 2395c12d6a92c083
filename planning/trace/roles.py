"""The distinct rank roles of a layout, each traced in a process of its own (planning/trace/role.py forks one per
role: a fake process group can be made once per process). Data- and tensor-parallel positions are symmetric (the
same shapes, the same collectives), so a role is a pipeline stage's rank: the first, the middle and the last; one
role without a pipeline. The mesh is (pp, dp, hp), so stage rank s's first rank is s * dp * hp.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def role_ranks(parallel) -> list[int]:
    stages = sorted({0, parallel.pp // 2, parallel.pp - 1})
    return [s * parallel.dp * parallel.hp for s in stages]


def trace_roles(config, timeout: float = 900.0, jobs: int = 0) -> list[dict]:
    """Each role's figures (role.py's JSON), first stage first: one process, which forks one per role, up to `jobs`
    at once (0: one per CPU core). config: the resolved config, or its YAML (as the orchestrator hands it, like a
    stage's process reads its own). A role that fails raises with the stderr's end."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(config) if isinstance(config, str) else config
    ranks = role_ranks(cfg.parallel)
    jobs = jobs or max(1, min(len(ranks), os.cpu_count() or 1))
    with tempfile.TemporaryDirectory(prefix="trace-") as scratch:
        config = Path(scratch) / "config.yaml"
        OmegaConf.save(cfg, config, resolve=True)
        argv = [sys.executable, "-m", "planning.trace.role", str(config), *map(str, ranks), "--jobs", str(jobs)]
        try:
            done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"tracing ranks {ranks} took over {timeout:.0f} s") from e
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or len(lines) < len(ranks):
        raise RuntimeError(f"tracing ranks {ranks} failed (exit status {done.returncode}):\n"
                           + "\n".join(done.stderr.strip().splitlines()[-15:]))
    return [json.loads(line) for line in lines[-len(ranks):]]
