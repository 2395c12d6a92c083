"""Which ONNX Runtime this environment has, asked before anything launches.

engine=ort needs ONNX Runtime's *training* build (package onnxruntime-training): its graph builder and
TrainingAgent (`onnxruntime.capi._pybind_state.OrtModuleGraphBuilder`, `TrainingAgent`). The inference builds
(onnxruntime, onnxruntime-gpu) install the same `onnxruntime` module without them, and fail only deep inside
the transform stage. onnxruntime-training's last release (1.19.2) has wheels for Python <= 3.11 only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

TRAINING_API = ("OrtModuleGraphBuilder", "OrtModuleGraphBuilderConfiguration", "TrainingAgent")
LAST_PYTHON_WITH_WHEEL = (3, 11)


@dataclass(frozen=True)
class OrtInstall:
    installed: bool
    version: Optional[str] = None
    missing_api: tuple[str, ...] = ()     # what the training build has and this one lacks
    import_error: Optional[str] = None   # the module is there but does not import

    @property
    def can_train(self) -> bool:
        return self.installed and not self.missing_api and self.import_error is None


def ort_install() -> OrtInstall:
    try:
        import onnxruntime
    except ImportError as e:
        if isinstance(e, ModuleNotFoundError) and e.name == "onnxruntime":
            return OrtInstall(installed=False)
        return OrtInstall(installed=True, import_error=f"{type(e).__name__}: {e}")  # e.g. a missing shared library
    version = getattr(onnxruntime, "__version__", "?")
    try:
        from onnxruntime.capi import _pybind_state as C
    except ImportError as e:
        return OrtInstall(True, version, TRAINING_API, f"{type(e).__name__}: {e}")
    return OrtInstall(True, version, tuple(name for name in TRAINING_API if not hasattr(C, name)))
