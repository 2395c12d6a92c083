"""The model sections: a model family's architecture (`model`) and its low-rank adapters (`peft`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from orchestrator.config.schema.keys import key, MAX_LAYERS, MAX_WIDTH, MAX_VOCAB, MAX_TOKENS, LORA

LLAMA3_ROPE = ("model.rope_scaling", ("llama3",))  # the keys of Llama 3.1's rotary scaling


@dataclass
class ModelConfig:
    name: str = key("gpt", "model family: an entry of the model registry (plugins/models)")
    vocab_size: int = key(320, "the vocabulary: must cover the data's (byte corpora need 258)", min=1, max=MAX_VOCAB)
    pad_vocab_to: int = key(1, "embedding and head rows rounded up to a multiple of this (Megatron's padding, e.g. "
                               "128: GPT-2's 50257 -> 50304, which hp up to 128 splits); the padding's logits never "
                               "count, so the loss is the unpadded model's", min=1)
    n_layers: int = key(8, "transformer layers", min=1, max=MAX_LAYERS)
    n_heads: int = key(4, "attention heads per layer", min=1, max=MAX_WIDTH)
    d_model: int = key(64, "hidden size", min=1, max=MAX_WIDTH)
    d_ff: int = key(256, "MLP inner size", min=1, max=MAX_WIDTH)
    max_seq_len: int = key(128, "longest sequence (rows of the position embedding)", min=1, max=MAX_TOKENS)
    dropout: float = key(0.0, "dropout probability on attention output and MLP output", min=0.0, max=0.95)
    activation: str = key("gelu", "MLP activation (gelu_tanh: GPT-2's approximation)",
                          choices=("gelu", "gelu_tanh", "relu", "silu", "elu"))
    tie_embeddings: bool = key(True, "share the token embedding with the output projection (GPT-2 style)")
    bias: bool = key(True, "biases in Linear and LayerNorm layers")
    init_std: float = key(0.02, "std of the normal weight initialisation", min=0.0)


@dataclass
class LlamaConfig(ModelConfig):
    name: str = key("llama", "model family: an entry of the model registry (plugins/models)")
    n_kv_heads: Optional[int] = key(None, "key/value heads of grouped-query attention (null: as many as "
                                          "model.n_heads); each serves n_heads/n_kv_heads query heads", min=1)
    rope_theta: float = key(10000.0, "base of the rotary position embedding's frequencies (Llama 3: 500000)",
                            min=1.0)
    rope_scaling: str = key("none", "the rotary frequencies' scaling for long contexts: none, or llama3 (Llama 3.1's "
                                    "and 3.2's: the low frequencies divided by model.rope_factor, the high ones "
                                    "kept, those between blended; Hugging Face's rope_type llama3)",
                            choices=("none", "llama3"))
    rope_factor: float = key(8.0, "llama3 scaling: what the low frequencies are divided by (Llama 3.1: 8, 3.2: 32)",
                             min=1.0, read_when=LLAMA3_ROPE)
    rope_low_freq_factor: float = key(1.0, "llama3 scaling: wavelengths over rope_original_max_seq_len / this are "
                                           "scaled in full", min=1e-6, read_when=LLAMA3_ROPE)
    rope_high_freq_factor: float = key(4.0, "llama3 scaling: wavelengths under rope_original_max_seq_len / this are "
                                            "kept (must exceed rope_low_freq_factor)", min=1e-6, read_when=LLAMA3_ROPE)
    rope_original_max_seq_len: int = key(8192, "llama3 scaling: the context the model was pretrained at (Hugging "
                                               "Face's original_max_position_embeddings)", min=1, max=MAX_TOKENS,
                                         read_when=LLAMA3_ROPE)
    norm_eps: float = key(1e-5, "RMSNorm's epsilon", min=0.0)
    activation: str = key("silu", "MLP activation (Llama's MLP is SwiGLU: silu(gate) * up)", choices=("silu",))
    tie_embeddings: bool = key(False, "share the token embedding with the output projection")
    bias: bool = key(False, "biases in Linear layers (Llama has none)")


@dataclass
class PeftConfig:
    name: str = key("none", "none: every weight trains; lora: low-rank adapters on the target Linears train, the "
                            "base weights (train.init_from's) stay frozen: no gradient, no optimizer state, not in "
                            "the checkpoints", choices=("none", "lora"))
    rank: int = key(8, "the adapters' rank r (LoRA's A is r x in, B is out x r)", min=1, max=MAX_WIDTH,
                    read_when=LORA)
    alpha: float = key(16.0, "the adapters' scale is alpha / rank (peft's lora_alpha)", min=0, read_when=LORA)
    dropout: float = key(0.0, "dropout on the adapters' input (peft's lora_dropout)", min=0, max=0.99,
                         read_when=LORA)
    targets: List[str] = key(["attention", "mlp"], "the Linears that get adapters, by the model family's own names "
                                                   "(wq, wk, wv, wo, fc1, fc2, and fc3 in Llama's MLP), or "
                                                   "`attention` (wq, wk, wv, wo) and `mlp` (its Linears)",
                             read_when=LORA)
    trainable: List[str] = key([], "weights that train beside the adapters: `bias` (every bias), or parameter names "
                                   "ending so (lm_head.weight, ln_f.weight)", read_when=LORA)
