"""train.profile=[first, last]: a torch.profiler trace of those steps (CPU ops; CUDA kernels on a GPU), written as a
Chrome/Perfetto trace (chrome://tracing, ui.perfetto.dev), with the ops that took the most time for the log."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from common.problem import Problem


class StepProfiler:
    """Call `step_begins(step)` before and `step_ended(step)` after each (1-based) step; inactive when not asked."""

    def __init__(self, steps: list[int], active: bool, device: torch.device, out: Path, rank: int):
        self.first, self.last = (steps[0], steps[1]) if steps and active else (0, -1)
        self.device, self.out, self.rank = device, Path(out), rank
        self.profiler: Optional[torch.profiler.profile] = None
        self.trace: Optional[Path] = None
        self.top: str = ""

    def step_begins(self, step: int) -> None:
        if step == self.first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()

    def step_ended(self, step: int) -> None:
        if self.profiler is None or step != self.last:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.profiler.__exit__(None, None, None)
        self.out.mkdir(parents=True, exist_ok=True)
        self.trace = self.out / f"profile_rank{self.rank}_steps{self.first}-{self.last}.json"
        self.profiler.export_chrome_trace(str(self.trace))
        sort = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        self.top = self.profiler.key_averages().table(sort_by=sort, row_limit=15)
        self.profiler = None


def check(cfg) -> list:

    t = cfg.train
    steps = list(t.profile)
    if steps and not (len(steps) == 2 and 1 <= steps[0] <= steps[1] <= t.steps):
        return [Problem("train.profile", steps, f"the steps to profile are [first, last] with 1 <= first <= last "
                        f"<= train.steps={t.steps}", f"train.profile=[{min(3, t.steps)},{min(5, t.steps)}]")]
    return []
