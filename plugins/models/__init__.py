"""Models: the registry (registry.py) and the built-in entries, registered when this package is imported."""
from plugins.models.registry import (EngineUnit, ModelSpec, Partition, build_on_meta, get_model, model_names,
                                     register_model)
from plugins.models import gpt as _gpt  # noqa: F401  (registers "gpt")
from plugins.models import llama as _llama  # noqa: F401  (registers "llama")

__all__ = ["EngineUnit", "ModelSpec", "Partition", "build_on_meta", "get_model", "model_names", "register_model"]
