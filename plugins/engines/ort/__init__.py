"""The ONNX Runtime engine: graphs built by the transform stage (prepare.py, graphs.py), run during training by
TrainingAgent inside a torch.autograd.Function (runtime.py), between Megatron's f/g collectives
(megatron.py), installed on a model's blocks by engine.py. Registered here; its modules are imported when a run
uses it (onnxruntime-training takes seconds to import, and may not be installed: rules.py says so before launch)."""
import importlib

from plugins.engines.ort import rules
from plugins.engines.registry import EngineSpec, register_engine


def _on_use(module: str, function: str):
    """plugins.engines.ort.<module>.<function>, imported at its first call."""
    def call(*args):
        return getattr(importlib.import_module(f"plugins.engines.ort.{module}"), function)(*args)

    return call


# one input shape (its graphs are built for it), parameters held from forward to backward (its units read them at
# both), fp32 graphs only, and ORT's kernels round otherwise than torch's (the aggregate's check: 1e-4)
register_engine("ort", EngineSpec(check=rules.check, prepare=_on_use("prepare", "prepare"),
                                  build=_on_use("engine", "build"), apply=_on_use("engine", "apply"),
                                  report=_on_use("engine", "report"), one_shape=True, reshard_after_forward=False,
                                  mixed_precision=False, eval_rtol=1e-4))
