"""Llama (Llama 2/3's architecture): rotary positions, RMSNorm, a SwiGLU MLP, grouped-query attention, no biases;
Llama 3.1's long-context rotary scaling with model.rope_scaling=llama3.

Parameter names follow the GPT family's (wq/wk/wv/wo, fc1 = gate, fc3 = up, fc2 = down, ln1/ln2/ln_f), so the
decoder's layouts, engine units and checkpoints serve both; storage/hf.py maps them to Hugging Face's names.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plugins.models.registry import register_model
from plugins.models.transformer import Attention, Block, Decoder, decoder_spec


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back (as Hugging Face's LlamaRMSNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)   # gate
        self.fc3 = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)   # up
        self.fc2 = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)   # down

    def hidden(self, x):
        return F.silu(self.fc1(x)) * self.fc3(x)

    def forward(self, x):
        return self.fc2(self.hidden(x))


def kv_heads(cfg) -> int:
    return cfg.n_kv_heads or cfg.n_heads


def rope_scaling(cfg):
    """model.rope_scaling=llama3's (factor, low_freq_factor, high_freq_factor, original context) (Llama 3.1's
    long-context frequencies), or None (the plain rotary embedding)."""
    if cfg.get("rope_scaling", "none") == "none":
        return None
    return (float(cfg.rope_factor), float(cfg.rope_low_freq_factor), float(cfg.rope_high_freq_factor),
            int(cfg.rope_original_max_seq_len))


def build(cfg) -> Decoder:
    def norm():
        return RMSNorm(cfg.d_model, cfg.norm_eps)

    def block():
        attn = Attention(cfg.d_model, cfg.n_heads, kv_heads(cfg), cfg.bias, rope_theta=cfg.rope_theta,
                         rope_scaling=rope_scaling(cfg))
        return Block(norm(), attn, norm(), SwiGLU(cfg), cfg.dropout)

    return Decoder(cfg, block, norm, learned_positions=False)


register_model("llama", decoder_spec(build))
