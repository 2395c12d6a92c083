"""Model shapes the benchmarks name beside the project's configs: overrides of a config."""
from __future__ import annotations

# Qwen2.5-0.5B's sizes in the Llama family (0.49B parameters, tied embeddings)
SHAPES = {"llama_0.5b": ["model=llama_1b", "model.vocab_size=151936", "model.d_model=896", "model.n_layers=24",
                         "model.n_heads=14", "model.n_kv_heads=2", "model.d_ff=4864"]}


def model_overrides(model: str) -> list[str]:
    """A shape's overrides, or `model=<name>` for one of the project's configs."""
    return SHAPES.get(model, [f"model={model}"])
