"""Engines: who executes the shard-local compute of each block. `torch` is the model's own forward;
`ort` runs each block's units (the compute between tensor-parallel collectives) in ONNX Runtime. The stages and
the layout ask the run's engine spec (plugins/engines/registry.py), never its name."""
from plugins.engines import ort as _ort  # noqa: F401  (registers itself)
from plugins.engines.registry import EngineSpec, check, engine_names, get_engine, register_engine  # noqa: F401
