"""The GPU suite, `pytest gpu_tests -n 0` on a machine with a CUDA GPU: what CI, which has none, cannot check.

Without a CUDA GPU it stops at once with exit status 2 and says so (tests/test_precision.py checks that message);
`pytest` (the CPU suite, CI's) does not collect this folder."""
from __future__ import annotations

import pytest
import torch

NO_CUDA = ("gpu_tests checks the train stage on a CUDA GPU (bf16 and fp16, the hot loop without host syncs, "
           "compiled kernels, a GPU per local rank), but torch.cuda.is_available() is False on this machine. "
           "Run `pytest gpu_tests -n 0` where a GPU is; `pytest` runs the CPU suite.")


def pytest_sessionstart(session) -> None:
    if not torch.cuda.is_available():
        pytest.exit(NO_CUDA, returncode=2)
