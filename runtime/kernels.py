"""Kernel options (the `triton` config section): torch.compile the model's blocks or the whole model.

Inductor generates Triton kernels on GPU and C++/OpenMP code on CPU. Compilation happens after the layout is
applied (tensor, pipeline and data parallelism compose with it: each transformer block is compiled the
TorchTitan way, so the collectives between blocks stay outside the compiled code), and it is lazy: the first
step compiles. A compile failure names the block and carries the compiler's message; with `fallback=eager`
that block runs uncompiled instead and the reason is recorded. Inductor's cache lives under the run cache, so a
rerun does not recompile: the cache hits are reported with the compile time.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from common.problem import Problem
from runtime.sdpa import resolve_attention


class CompileFailed(RuntimeError):
    pass


@dataclass
class KernelReport:
    """What compilation did: blocks compiled, blocks that fell back to eager (and why), cache statistics."""
    compiled: list[str] = field(default_factory=list)
    fallbacks: dict[str, str] = field(default_factory=dict)
    first_call_s: dict[str, float] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        """Compile time (first calls of the compiled blocks: tracing, code generation, C++ compilation, or
        cache loads) and Inductor's cache counters: a rerun shows hits and a far smaller compile time."""
        from torch._dynamo.utils import counters

        inductor = counters["inductor"]
        return {"compile/first_forward_s": sum(self.first_call_s.values()),
                "compile/fx_graph_cache_hits": float(inductor.get("fxgraph_cache_hit", 0)),
                "compile/fx_graph_cache_misses": float(inductor.get("fxgraph_cache_miss", 0)),
                "compile/blocks_compiled": float(len(self.compiled) - len(self.fallbacks)),
                "compile/blocks_eager": float(len(self.fallbacks))}


class GuardedCompile:
    """A module's forward, compiled; the first call's failure is attributed to the module by name and either
    raised (with the compiler's message) or answered by running the module eagerly from then on."""

    def __init__(self, name: str, forward: Callable, options: dict, fallback: str, report: KernelReport,
                 log: logging.Logger):
        self.name, self.forward, self.fallback, self.report, self.log = name, forward, fallback, report, log
        self.compiled = torch.compile(forward, **options)
        self.eager = False
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any):
        if self.eager:
            return self.forward(*args, **kwargs)
        from torch._dynamo.exc import TorchDynamoException

        t0 = time.perf_counter()
        try:
            out = self.compiled(*args, **kwargs)
        except TorchDynamoException as e:  # tracing or code generation failed: not a fault of the inputs
            message = _compiler_message(e)
            if self.fallback != "eager":
                raise CompileFailed(f"triton: compiling {self.name} failed: {message}\n(triton.fallback=eager runs "
                                    "blocks that fail to compile uncompiled, or triton=off)") from e
            self.log.warning("triton: %s runs uncompiled (triton.fallback=eager): %s", self.name, message)
            self.report.fallbacks[self.name] = message
            self.eager = True
            return self.forward(*args, **kwargs)
        if self.calls == 0:
            self.report.first_call_s[self.name] = time.perf_counter() - t0
        self.calls += 1
        return out


def _compiler_message(e: Exception) -> str:
    lines = [line for line in str(e).splitlines() if line.strip()]
    head = [line for line in lines if not line.startswith(("Set TORCH", "You can suppress", "For even more"))]
    return " ".join(head[:6])[:1500]


def configure(tcfg, cuda: bool) -> None:
    """Process-wide settings: Inductor's cache folder, and RNG in compiled code drawn as eager code draws it
    (dropout masks, hence losses, do not change with compilation)."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(tcfg.cache_dir)
    import torch._inductor.config as inductor

    inductor.fallback_random = True
    inductor.fx_graph_cache = True
    if not cuda:
        inductor.cpp.dynamic_threads = True  # follow torch.get_num_threads() (one per rank when ranks share cores)


def apply_kernels(parts: list[nn.Module], spec, tcfg, log: logging.Logger, cuda: bool = False,
                  report: KernelReport | None = None, first_part: int = 0) -> KernelReport:
    """Set the attention kernel, then compile per `tcfg.scope` (when enabled), adding to `report`. Compilation is
    lazy (the first call compiles) and wraps each target's forward: hooks FSDP adds later stay outside it."""
    report = report if report is not None else KernelReport()
    # auto is resolved before planning (orchestrator/config/resolve.py); a config composed without it (a benchmark's,
    # a test's) gets what auto gives rows of documents: flex only ever serves those
    attention = tcfg.attention if tcfg.attention != "auto" else resolve_attention(cuda, documents=True)[0]
    if spec.set_attention is not None:
        for part in parts:
            spec.set_attention(part, attention)
    if tcfg.enabled or (attention == "flex" and cuda):  # FlexAttention is compiled too: the run's Inductor cache
        configure(tcfg, cuda)
    if not tcfg.enabled:
        return report
    options = {"mode": tcfg.mode, "fullgraph": tcfg.fullgraph, "dynamic": tcfg.dynamic}
    if tcfg.scope == "blocks":
        targets = [(f"block {_block_name(part, b)}", b) for part in parts for b in spec.blocks(part)]
    else:
        targets = [(f"model part {first_part + i}", part) for i, part in enumerate(parts)]
    for name, module in targets:
        # an instance attribute: the module keeps its identity, parameter names and hooks (FSDP, DCP, pipeline)
        module.forward = GuardedCompile(name, module.forward, options, tcfg.fallback, report, log)
        report.compiled.append(name)
    log.info("triton: compiling %d %s (mode=%s, fullgraph=%s, dynamic=%s, attention=%s) on first use",
             len(targets), "blocks" if tcfg.scope == "blocks" else "model parts", tcfg.mode, tcfg.fullgraph,
             tcfg.dynamic, tcfg.attention)
    return report


def _block_name(part: nn.Module, block: nn.Module) -> str:
    return next((n for n, m in part.named_modules() if m is block), "?")


def check(cfg) -> list:
    """On a CPU, torch.compile generates C++: triton=on needs a compiler there. FlexAttention trains on GPUs only."""
    import shutil

    from runtime import machine

    problems = []
    if cfg.triton.enabled and not machine.has_cuda() and not (shutil.which("g++") or shutil.which("c++")):
        problems.append(Problem("triton.enabled", True, "on CPU, torch.compile generates C++ and needs a C++ "
                                "compiler; none found on PATH (g++ or c++)", "install g++, or triton=off"))
    if cfg.triton.attention == "flex" and not machine.ranks_on_cuda(cfg)[0]:
        problems.append(Problem("triton.attention", "flex", "FlexAttention has no backward on a CPU (torch: "
                                "'FlexAttention does not support backward on CPU'), and the train stage's ranks get "
                                "no CUDA GPU here", "triton.attention=auto (SDPA with the document mask on CPUs), or "
                                "ranks on GPUs (cluster=slurm cluster.gpus_per_task=1)"))
    return problems
