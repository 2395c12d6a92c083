"""The ONNX Runtime engine: graphs built by the transform stage (prepare.py, graphs.py), run during training by
TrainingAgent inside a torch.autograd.Function (runtime.py), between Megatron's f/g collectives
(megatron.py), installed on a model's blocks by engine.py. Registered here; its modules are imported when a run
uses it (onnxruntime-training takes seconds to import, and may not be installed: rules.py says so before launch)."""
from plugins.engines.ort import rules
from plugins.engines.registry import EngineSpec, register_engine


def _prepare(*args) -> None:
    from plugins.engines.ort.prepare import prepare

    prepare(*args)


def _build(*args) -> tuple:
    from plugins.engines.ort.engine import build

    return build(*args)


def _apply(*args) -> None:
    from plugins.engines.ort.engine import apply

    apply(*args)


def _report(*args) -> None:
    from plugins.engines.ort.engine import report

    report(*args)


# one input shape (its graphs are built for it), parameters held from forward to backward (its units read them at
# both), fp32 graphs only, and ORT's kernels round otherwise than torch's (the aggregate's check: 1e-4)
register_engine("ort", EngineSpec(check=rules.check, prepare=_prepare, build=_build, apply=_apply, report=_report,
                                  one_shape=True, reshard_after_forward=False, mixed_precision=False,
                                  eval_rtol=1e-4))
