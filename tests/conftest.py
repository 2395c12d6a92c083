"""Shared helpers: compose configs like the CLI does, and run the CLI in a scratch working directory."""
from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path
from typing import Optional

import pytest
import torch
from hydra.errors import HydraException

from orchestrator.config.compose import compose_config, last_wins  # noqa: F401 (last_wins: the tests' import)
from orchestrator.config.errors import ConfigError, from_hydra
from orchestrator.config.validate import validate

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

# small but real: the default experiment with fewer steps (tests check behaviour, not model quality)
QUICK = ["train.steps=12", "train.eval_every=6", "train.checkpoint_every=6", "train.log_every=6",
         "train.batch_size=8", "train.seq_len=64"]

torch.set_num_threads(1)
# and one per rank in every run the tests start (inherited by the CLI's processes): the two pytest-xdist workers
# share the cores, and a one-rank stage taking every core would oversubscribe them (2-6x slower measured)
os.environ["OMP_NUM_THREADS"] = "1"


def _no_ort_training_reason() -> str | None:
    """Why engine=ort cannot run here, where that is expected: Python 3.12+ has no onnxruntime-training wheel.
    On Python <= 3.11 `.[dev]` installs it, so the engine=ort tests run (and fail if it is missing), as in CI."""
    if sys.version_info[:2] <= (3, 11):
        return None
    from plugins.engines.ort.install import ort_install

    return None if ort_install().can_train else \
        f"engine=ort needs onnxruntime-training, which has no wheel for Python {sys.version_info[0]}.{sys.version_info[1]}"


requires_ort_training = pytest.mark.skipif(_no_ort_training_reason() is not None,
                                           reason=_no_ort_training_reason() or "")


def make_cfg(*overrides: str, runs_dir: Path | None = None):
    """The composed config for these overrides, as `python -m orchestrator` would see it."""
    return compose_config(*overrides, runs_dir=runs_dir, conf=CONF)


def cli_env(**extra: str) -> dict:
    """The environment of a CLI run: this checkout first on the path (the caller's path kept behind it, e.g. wheels
    unpacked aside) and wide rich tables, so that their lines can be matched."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "COLUMNS": "200", **extra}


class _Zygote:
    """tests/cli_zygote.py: one per pytest process, started on first use; it forks each command."""

    def __init__(self):
        self._proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "cli_zygote.py")], cwd=ROOT, env=cli_env(),
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self._pids: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._ended = threading.Condition()
        self._codes: dict[int, int] = {}
        threading.Thread(target=self._answers, daemon=True).start()

    def _answers(self) -> None:
        for line in self._proc.stdout:
            answer = json.loads(line)
            if "pid" in answer:
                self._pids.put(answer["pid"])
            else:
                with self._ended:
                    self._codes[answer["exited"]] = answer["code"]
                    self._ended.notify_all()
        with self._ended:
            self._ended.notify_all()

    def start(self, argv: list[str], cwd: Path, env: dict, stdout: Path, stderr: Path) -> int:
        request = {"argv": argv, "cwd": str(cwd), "env": env, "stdout": str(stdout), "stderr": str(stderr)}
        with self._lock:
            assert self._proc.poll() is None, f"tests/cli_zygote.py ended with {self._proc.returncode}"
            self._proc.stdin.write(json.dumps(request) + "\n")
            return self._pids.get(timeout=60)

    def wait(self, pid: int, timeout: Optional[float]) -> Optional[int]:
        """The command's exit status (-N: killed by signal N), or None if it still runs after timeout seconds."""
        with self._ended:
            self._ended.wait_for(lambda: pid in self._codes or self._proc.poll() is not None, timeout)
            return self._codes.get(pid)


_zygote: Optional[_Zygote] = None


def _forked() -> _Zygote:
    global _zygote
    if _zygote is None:
        _zygote = _Zygote()
    return _zygote


def _group_gone(pgid: int, deadline: float) -> None:
    """Wait for the command's process group (its fork server among them) to end, as reading its output to the end
    did: the server holds that output until it ends."""
    import time

    import psutil

    while time.monotonic() < deadline:
        alive = []
        for proc in psutil.process_iter(["status"]):
            try:
                if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                    alive.append(proc.pid)
            except (ProcessLookupError, psutil.Error):
                pass
        if not alive:
            return
        time.sleep(0.05)


class ForkedCommand:
    """`python -m orchestrator args` in cwd, forked by tests/cli_zygote.py: the part of subprocess.Popen the tests
    use, its output in files (stderr in stdout's file when merged)."""

    def __init__(self, args: list[str], cwd: Path, merged: bool = False):
        import tempfile

        self.args = [sys.executable, "-m", "orchestrator", *args]
        self._dir = tempfile.TemporaryDirectory(prefix="cli-")
        self.stdout_path = Path(self._dir.name) / "stdout"
        self.stderr_path = self.stdout_path if merged else Path(self._dir.name) / "stderr"
        self.stdout_path.touch()
        self.stderr_path.touch()
        self.pid = _forked().start(list(args), cwd, cli_env(), self.stdout_path, self.stderr_path)
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        return self.wait(0)

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        import time

        if self.returncode is None:
            start = time.monotonic()
            self.returncode = _forked().wait(self.pid, timeout)
            if self.returncode is not None:
                _group_gone(self.pid, start + (timeout if timeout is not None else 600) + 30)
        if self.returncode is None and timeout:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def kill(self) -> None:
        import signal

        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def communicate(self, timeout: Optional[float] = None) -> tuple[str, str]:
        """Wait for the end (TimeoutExpired after timeout seconds, the command still running), then its output."""
        self.wait(timeout)
        return self.output()

    def output(self) -> tuple[str, str]:
        out = self.stdout_path.read_text(errors="replace")
        return out, "" if self.stderr_path == self.stdout_path else self.stderr_path.read_text(errors="replace")


def run_cli(args: list[str], cwd: Path, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m orchestrator args...` in cwd; the run's files land in cwd/runs. With env (variables added): a fresh
    interpreter, as what they set may be read at import (PYTHONPATH, a library's settings)."""
    if env:
        return subprocess.run([sys.executable, "-m", "orchestrator", *last_wins(args)], cwd=cwd, env=cli_env(**env),
                              capture_output=True, text=True, timeout=timeout)
    command = ForkedCommand(last_wins(args), cwd)
    try:
        out, err = command.communicate(timeout)
    except subprocess.TimeoutExpired:
        command.kill()
        command.wait(30)
        raise
    return subprocess.CompletedProcess(command.args, command.returncode, out, err)


def signal_cli(args: list[str], cwd: Path, ready, sig: int = 15, wait_s: float = 300) -> tuple[int, str, float]:
    """`python -m orchestrator args...` in cwd, signalled (its process group, as a terminal or `kill -- -PGID`
    does) once ready(lines printed so far) holds: (exit code, its output, seconds it took to stop)."""
    import time

    command = ForkedCommand(last_wins(args), cwd, merged=True)
    try:
        deadline = time.monotonic() + wait_s
        while not ready(command.output()[0].splitlines(keepends=True)):
            assert time.monotonic() < deadline and command.poll() is None, command.output()[0][-3000:]
            time.sleep(0.05)
        os.killpg(command.pid, sig)
        signalled = time.monotonic()
        command.wait(timeout=120)
        took = time.monotonic() - signalled
    finally:
        if command.poll() is None:
            command.kill()
            command.wait(30)
    return command.returncode, command.output()[0], took


def run_folder(result: subprocess.CompletedProcess) -> Path:
    """The run folder a CLI invocation printed (`outputs: <folder>`)."""
    import re

    return Path(re.search(r"^outputs: (\S+)", result.stdout, re.M).group(1))


def run_sweep(args: list[str], cwd: Path, timeout: float = 1800) -> dict[str, Path]:
    """`python -m orchestrator -m args...` (one process plans every point and starts its ranks, as a user's sweep
    does): each point's overrides -> its run folder."""
    import json
    import re

    result = run_cli(["-m", *args], cwd, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    folder = Path(re.search(r"^sweep in (\S+)$", result.stdout, re.M).group(1))
    points = json.loads((folder / "sweep_summary.json").read_text())["points"]
    return {p["overrides"]: Path(p["run_dir"]) for p in points}


DEBUG = ["cluster=debug", "tracking=none", *QUICK]


def run_debug(tmp_path: Path, *overrides: str, name: str = "run"):
    """The whole DAG in this process (cluster=debug), files under tmp_path/runs, the run folder tmp_path/name."""
    from orchestrator.run import orchestrate

    cfg = make_cfg(*DEBUG, *overrides, runs_dir=tmp_path / "runs")
    return orchestrate(cfg, tmp_path / name, last_wins([*DEBUG, *overrides]))


def cache_entry(tmp_path: Path, report, stage: str) -> Path:
    return tmp_path / "runs" / "cache" / stage / report.results[stage].key


@contextlib.contextmanager
def killed_after(steps: int):
    """Within the block, the train stage's step raises KeyboardInterrupt after `steps` steps: it stands in for a
    kill (nothing after that point runs; the checkpoints written before it stay)."""
    import stages.train

    real, calls = stages.train.train_step, {"n": 0}

    def dies(*args, **kwargs):
        if calls["n"] == steps:
            raise KeyboardInterrupt
        calls["n"] += 1
        return real(*args, **kwargs)

    stages.train.train_step = dies
    try:
        yield
    finally:
        stages.train.train_step = real


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    d = tmp_path / "work"
    d.mkdir()
    return d


def pytest_sessionfinish(session):
    """Once every worker is done (xdist's controller, or the one process of -n 0): stop a SLURM cluster the tests
    started (tests/slurm_support.py)."""
    if not hasattr(session.config, "workerinput"):
        from tests.slurm_support import stop_if_started_here

        stop_if_started_here()


# The files that take minutes, longest first (CI's durations). xdist hands whole files to the workers in collection
# order; a long file handed out last runs alone at the end while the other workers idle (longest first: the short
# files fill in around the long ones).
LONGEST_FIRST = ("test_layouts.py", "test_slurm_recovery.py", "test_slurm.py", "test_kernels.py",
                 "test_readme_examples.py", "test_cli_e2e.py", "test_disks.py", "test_install.py", "test_hpo.py",
                 "test_tune.py", "test_sweep_and_slurm_config.py", "test_first_hour.py", "test_hf.py",
                 "test_evaluate.py", "test_lora.py", "test_recovery.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's tests keep their order


def problems_of(overrides: list[str], runs: Path) -> list:
    """Compose as the CLI does, then validate: the problems a user would be shown (none: accepted)."""
    own_dirs = any(o.startswith(("runs_dir=", "cache_dir=")) for o in overrides)
    try:
        cfg = make_cfg(*overrides, runs_dir=None if own_dirs else runs)
    except HydraException as e:
        translated = from_hydra(e, tuple(overrides))
        assert translated is not None, f"untranslated Hydra error: {e}"
        return translated.problems
    try:
        if cfg.get("phases"):  # an experiment: its phases composed from the overrides, as the command composes them
            from orchestrator.phases import check_phases

            check_phases(cfg, overrides if own_dirs else [*overrides, f"runs_dir={runs}"])
        else:
            validate(cfg, overrides)
    except ConfigError as e:
        return e.problems
    return []
