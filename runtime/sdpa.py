"""Which scaled-dot-product-attention kernel a model's attention gets on this device and precision.

torch picks a backend per call (flash attention, memory-efficient, cuDNN, or the math reference) from the
device, dtype and shapes; a GPU run that silently lands on the math kernel is several times slower. This asks
torch, once, by running the model's attention shape under each backend alone in torch's own order of preference,
and reports the first that runs: the train summary names it.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F


def attention_kernel(model_cfg, precision, device: torch.device, attention: str = "sdpa") -> str:
    """'flash', 'efficient', 'cudnn' or 'math' (torch's SDPA backends), or 'math (written out)' for
    triton.attention=math; 'unknown' when no backend runs the shape."""
    if attention == "math":
        return "math (written out)"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    heads = getattr(model_cfg, "n_heads", 1)
    head_dim = model_cfg.d_model // heads
    dtype = precision.dtype if precision.mixed else torch.float32
    q = torch.zeros(1, heads, 8, head_dim, device=device, dtype=dtype)
    order = [("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
             ("cudnn", SDPBackend.CUDNN_ATTENTION), ("math", SDPBackend.MATH)]
    for name, backend in order:
        try:
            with sdpa_kernel([backend]), torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch explains each backend it cannot use
                F.scaled_dot_product_attention(q, q, q, is_causal=True)
        except RuntimeError:
            continue
        return name
    return "unknown"
