"""Installs where users are: the dependencies resolve as binary wheels on every supported Python, and engine=ort
without ONNX Runtime's training build is refused before launch with the package and the extra to install."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
import types

import pytest
from packaging.requirements import Requirement

from orchestrator.config.errors import ConfigError
from plugins.engines.ort.rules import install_problems as ort_install_problems
from tests.conftest import ROOT, make_cfg, requires_ort_training, run_cli

PYTHONS = ("3.11", "3.12", "3.13")
# pip accepts only the exact tags given with --platform: name every manylinux a Linux x86_64 machine takes
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(17, 29)] + \
    ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]
SOURCE_ONLY = {"antlr4-python3-runtime", "rouge_score", "sqlitedict", "word2number"}  # pure Python, published as
# source archives only (they build anywhere; the last three come with lm-eval)


def _pins() -> list[str]:
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    return [line for line in lines if line.strip() and not line.startswith("#") and
            line.split("==")[0].strip() not in SOURCE_ONLY]


def _ranges() -> list[str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]


def _for_python(requirements: list[str], python: str) -> list[str]:
    """The requirements whose markers hold on `python` (pip would evaluate them for the Python running pip)."""
    env = {"python_version": python, "python_full_version": f"{python}.0", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}
    reqs = [Requirement(r) for r in requirements]
    return [str(r).split(";")[0] for r in reqs if r.marker is None or r.marker.evaluate(env)]


def _resolve(requirements: list[str], python: str, folder) -> subprocess.Popen:
    """Each requirement resolved on its own (no dependencies) as a wheel for `python` on Linux x86_64, against
    the index pip is configured with (CI's): a pip process, whose report `_picked` reads. Markers are evaluated for
    `python`."""
    requirements = _for_python(requirements, python)
    argv = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps",
            "--only-binary=:all:", "--python-version", python, "--target", str(folder / "target"),
            "--report", str(folder / "report.json"), "--quiet", *[f"--platform={p}" for p in PLATFORMS],
            *requirements]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})


def _picked(proc: subprocess.Popen, python: str, folder) -> dict[str, str] | str:
    """name -> version pip picked, or what pip said when a requirement has no wheel."""
    _, stderr = proc.communicate(timeout=600)
    errors = "\n".join(line for line in stderr.splitlines() if not line.startswith("WARNING: Location"))
    if proc.returncode != 0:
        return f"Python {python}: no wheel for a requirement\n{errors[-3000:]}"
    return {i["metadata"]["name"].lower(): i["metadata"]["version"]
            for i in json.loads((folder / "report.json").read_text())["install"]}


@pytest.fixture(scope="module")
def resolved(tmp_path_factory) -> dict[tuple[str, str], dict[str, str] | str]:
    """The pins and the ranges for every Python, resolved by six pip processes at once: most of their time is
    spent waiting on the index."""
    procs = {}
    try:
        for python in PYTHONS:
            for what, requirements in (("pins", _pins()), ("ranges", _ranges())):
                folder = tmp_path_factory.mktemp(f"{what}-{python}")
                procs[python, what] = (_resolve(requirements, python, folder), folder)
        return {key: _picked(proc, key[0], folder) for key, (proc, folder) in procs.items()}
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.install
@pytest.mark.parametrize("python", PYTHONS)
def test_every_pin_and_every_core_range_resolves_as_a_wheel(python, resolved):
    pinned, ranged = resolved[python, "pins"], resolved[python, "ranges"]
    assert isinstance(pinned, dict), pinned
    assert isinstance(ranged, dict), ranged
    assert pinned["torch"].split("+")[0] == "2.13.0"
    assert ("onnxruntime-training" in pinned) == (python == "3.11")  # the ort extra's marker
    assert {"torch", "onnx", "hydra-core", "mlflow", "submitit"} <= ranged.keys()


def test_the_ort_extra_is_skipped_where_it_has_no_wheel():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert all("python_version < '3.12'" in r for r in extras["ort"])
    assert any(r.startswith("orchestrator[") and "ort" in r for r in extras["dev"])
    assert not any("onnxruntime" in r for r in _ranges())  # the core needs no ONNX Runtime


# -- engine=ort refused before launch --------------------------------------------------------------------------------

@pytest.fixture
def no_onnxruntime(monkeypatch):
    """As if no ONNX Runtime were installed: `import onnxruntime` raises ModuleNotFoundError."""
    for name in [m for m in sys.modules if m == "onnxruntime" or m.startswith("onnxruntime.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "onnxruntime", None)


@pytest.fixture
def inference_onnxruntime(monkeypatch):
    """As if the inference-only build were installed: the module imports, its C API has no training classes."""
    ort = types.ModuleType("onnxruntime")
    ort.__version__ = "1.23.2"
    capi = types.ModuleType("onnxruntime.capi")
    pybind = types.ModuleType("onnxruntime.capi._pybind_state")
    pybind.InferenceSession = object
    ort.capi, capi._pybind_state = capi, pybind
    for name, module in (("onnxruntime", ort), ("onnxruntime.capi", capi), ("onnxruntime.capi._pybind_state", pybind)):
        monkeypatch.setitem(sys.modules, name, module)


def test_missing_training_build_names_the_package_and_the_extra(no_onnxruntime):
    (p,) = ort_install_problems(python=(3, 11))
    assert (p.key, p.value) == ("engine", "ort")
    assert "onnxruntime-training" in p.rule and "not installed" in p.rule
    assert "pip install -e '.[ort]'" in p.fix and "engine=torch" in p.fix
    (p,) = ort_install_problems(python=(3, 12))
    assert "no wheel for Python 3.12" in p.rule and "Python 3.11" in p.fix and "engine=torch" in p.fix


def test_inference_only_build_is_refused_the_same_way(inference_onnxruntime):
    (p,) = ort_install_problems(python=(3, 11))
    assert "onnxruntime 1.23.2 is an inference-only build" in p.rule and "OrtModuleGraphBuilder" in p.rule
    assert "pip uninstall onnxruntime" in p.fix and "pip install -e '.[ort]'" in p.fix
    (p,) = ort_install_problems(python=(3, 13))
    assert "no wheel for Python 3.13" in p.rule and "engine=torch" in p.fix


STUBS = {  # a package named onnxruntime placed before the real one on the path
    "missing": {"__init__.py": "raise ModuleNotFoundError(\"No module named 'onnxruntime'\", name='onnxruntime')\n"},
    "inference-only": {"__init__.py": "__version__ = '1.23.2'\n", "capi/__init__.py": "",
                       "capi/_pybind_state.py": "class InferenceSession:\n    pass\n"},
}


@pytest.mark.parametrize("simulated", sorted(STUBS))
def test_engine_ort_without_training_build_exits_2_before_anything_starts(simulated, tmp_path, workdir):
    stub = tmp_path / "stub"
    for rel, text in STUBS[simulated].items():
        (stub / "onnxruntime" / rel).parent.mkdir(parents=True, exist_ok=True)
        (stub / "onnxruntime" / rel).write_text(text)
    result = run_cli(["engine=ort", "tracking=none"], workdir,
                     env={"PYTHONPATH": os.pathsep.join([str(stub), str(ROOT)])}, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "x engine=ort" in result.stderr and "pip install -e '.[ort]'" in result.stderr
    assert ("not installed" if simulated == "missing" else "inference-only build") in result.stderr
    assert not (workdir / "runs" / "cache").exists() and "plan" not in result.stdout


@requires_ort_training
def test_engine_ort_on_a_cuda_machine_needs_orts_cuda_build(monkeypatch):
    """PyPI's onnxruntime-training is CPU-only: with a CUDA GPU the train stage would hand ORT CUDA tensors."""
    import onnxruntime

    from orchestrator.config import validate as v
    from runtime import machine

    monkeypatch.setattr(machine, "has_cuda", lambda: True)
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CPUExecutionProvider"])
    with pytest.raises(ConfigError) as e:
        v.validate(make_cfg("engine=ort", "precision=fp32"))
    p = next(p for p in e.value.problems if p.key == "engine")
    assert "no CUDA execution provider" in p.rule and "CUDA build" in p.fix and "engine=torch" in p.fix
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    v.validate(make_cfg("engine=ort", "precision=fp32"))


def test_this_environment_has_the_training_build_where_a_wheel_exists():
    """CI (Python 3.11) installs `.[dev]`, which brings the ort extra: its engine=ort tests must really run."""
    if sys.version_info[:2] <= (3, 11):
        assert ort_install_problems() == []
    else:
        (p,) = ort_install_problems()
        assert "no wheel for Python" in p.rule
