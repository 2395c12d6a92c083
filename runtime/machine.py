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


def ranks_on_cuda(cfg) -> tuple[bool, bool]:
    """(the train stage's ranks get CUDA GPUs, those GPUs have bf16). On SLURM the login node's devices say nothing
    of the compute nodes': GPUs requested (cluster.gpus_per_task) count as CUDA GPUs with bf16."""
    if cfg.cluster.name == "slurm":
        gpus = bool(cfg.cluster.get("gpus_per_task"))
        return gpus, gpus
    cuda = has_cuda()
    return cuda, cuda and cuda_bf16()


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


def peak_rss_bytes() -> int:
    """This process's peak resident memory: VmHWM, its image's high-water mark (ru_maxrss would carry the parent's
    over fork and exec)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) * 1024
