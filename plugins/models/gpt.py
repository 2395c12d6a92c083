"""GPT (GPT-2's architecture): learned positions, LayerNorm, a GELU MLP, tied embeddings by default.

The decoder itself (attention, blocks, layouts, engine units) is plugins/models/transformer.py.
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from plugins.models.registry import register_model
from plugins.models.transformer import Attention, Block, Decoder, decoder_spec

ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu, "silu": F.silu,
               "elu": F.elu}  # gelu_tanh: GPT-2's own ("gelu_new" in Hugging Face's configs)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.fc2 = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)
        self.act = ACTIVATIONS[cfg.activation]

    def hidden(self, x):
        return self.act(self.fc1(x))

    def forward(self, x):
        return self.fc2(self.hidden(x))


def build(cfg) -> Decoder:
    def norm():
        return nn.LayerNorm(cfg.d_model, bias=cfg.bias)

    def block():
        attn = Attention(cfg.d_model, cfg.n_heads, cfg.n_heads, cfg.bias)
        return Block(norm(), attn, norm(), MLP(cfg), cfg.dropout)

    return Decoder(cfg, block, norm, learned_positions=True)


register_model("gpt", decoder_spec(build))
