"""What this machine offers, asked once where a rule needs it (tests fake these answers to check a CUDA machine's
rules on a CPU one)."""
from __future__ import annotations

import importlib.util


def has_cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


def cuda_devices() -> int:
    import torch

    return torch.cuda.device_count()


def cuda_bf16() -> bool:
    import torch

    return torch.cuda.is_bf16_supported()


def ort_has_cuda() -> bool:
    import onnxruntime

    return "CUDAExecutionProvider" in onnxruntime.get_available_providers()


def ort_has_triton() -> bool:
    try:
        return ort_has_cuda() and importlib.util.find_spec("triton") is not None
    except ImportError:
        return False
