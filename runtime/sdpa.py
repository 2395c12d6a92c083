"""Which attention kernel a model's attention gets on this device and precision.

Causal rows go through scaled dot-product attention: torch picks a backend per call (flash attention,
memory-efficient, cuDNN, or the math reference) from the device, dtype and shapes; a GPU run that silently lands on
the math kernel is several times slower. `attention_kernel` asks torch, once, by running the model's attention shape
under each backend alone in torch's own order of preference, and reports the first that runs: the train summary
names it.

Rows with their documents (whole documents, data.packing_strategy=bfd; padded rows a rank packs) need a
block-diagonal causal mask. SDPA takes it as a dense (T, T) mask, which only its memory-efficient kernel accepts, and
computes every masked tile. FlexAttention (triton.attention=flex; auto picks it on CUDA GPUs) takes a block mask
built from the document numbers and skips the tiles no query may see, compiled into one Triton kernel, as
TorchTitan's document masking does. On a CPU it has no backward, so there SDPA with the dense mask is the path, and
the reference a GPU test compares FlexAttention against (gpu_tests/test_cuda.py).
"""
from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F


def resolve_attention(cuda: bool, documents: bool) -> tuple[str, str]:
    """triton.attention=auto for ranks on CUDA GPUs or not, rows with their documents or not: (the kernel, why;
    empty where there was no choice to make)."""
    if documents and cuda:
        return "flex", "rows of documents on CUDA GPUs: FlexAttention skips the tiles the document mask hides"
    if documents:
        return "sdpa", "rows of documents on CPUs, where FlexAttention has no backward: SDPA with the dense mask"
    return "sdpa", ""


def document_block_mask(documents: torch.Tensor):
    """FlexAttention's block mask for rows whose positions are numbered by document (B, T): a query sees the keys
    of its own document up to itself. On CUDA it is built by a compiled kernel, tile by tile (no (T, T) mask is
    ever held); on a CPU (a check of the path, forward only) in full."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, T = documents.shape

    def same_document_causal(b, h, q, kv):
        return (documents[b, q] == documents[b, kv]) & (q >= kv)

    with warnings.catch_warnings():
        # torch 2.11 deprecates _compile for torch.compile(create_block_mask); the flag is what the GPU suite ran
        # (and it runs on the torch versions pyproject allows)
        warnings.simplefilter("ignore", DeprecationWarning)
        return create_block_mask(same_document_causal, B, None, T, T, device=documents.device,
                                 _compile=documents.is_cuda)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # one compilation per process and shape (a training run has one): the kernel is generated for the mask's tiles
    return torch.compile(flex_attention, dynamic=False)


def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask) -> torch.Tensor:
    """Attention of (B, heads, T, head_dim) under a block mask: compiled on CUDA; on a CPU unfused (forward only)."""
    if q.is_cuda:
        return _compiled_flex()(q, k, v, block_mask=block_mask)
    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "called without torch.compile": this path checks numbers, not speed
        return flex_attention(q, k, v, block_mask=block_mask)


def attention_kernel(model_cfg, precision, device: torch.device, attention: str = "sdpa",
                     documents: bool = False) -> str:
    """'flash', 'efficient', 'cudnn' or 'math' (torch's SDPA backends; on a CPU with " (cpu)": torch's CPU
    kernels of those names, not the CUDA ones a tag of 'flash' would suggest), 'math (written out)' for
    triton.attention=math, 'flex' for rows of documents under triton.attention=flex; 'unknown' when no backend runs
    the shape."""
    if attention == "math":
        return "math (written out)"
    if attention == "flex" and documents:
        return "flex"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    heads = getattr(model_cfg, "n_heads", 1)
    head_dim = model_cfg.d_model // heads
    dtype = precision.dtype if precision.mixed else torch.float32
    q = torch.zeros(1, heads, 8, head_dim, device=device, dtype=dtype)
    # a document mask is a dense mask to SDPA: flash attention takes none
    shape = {"attn_mask": torch.ones(8, 8, dtype=torch.bool, device=device).tril()} if documents else {"is_causal": True}
    order = [("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
             ("cudnn", SDPBackend.CUDNN_ATTENTION), ("math", SDPBackend.MATH)]
    for name, backend in order:
        try:
            with sdpa_kernel([backend]), torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch explains each backend it cannot use
                F.scaled_dot_product_attention(q, q, q, **shape)
        except RuntimeError:
            continue
        return name if device.type == "cuda" else f"{name} ({device.type})"
    return "unknown"
