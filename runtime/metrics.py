"""Training metrics: memory per phase, a resumable per-step history, and the loss-curve picture."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Optional

import psutil
import torch

PHASES = ("pre_forward", "post_forward", "post_backward", "post_step")


class MemoryProbe:
    """Memory at the phase boundaries of a step: process RSS on CPU; on GPU the CUDA allocator's peak
    since the previous boundary (so each figure is the true peak inside the phase that just ended)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self._process = psutil.Process(os.getpid())
        self.values: dict[str, float] = {}
        self.peak_mb = 0.0         # the largest sample of the run (CUDA: allocator peak; CPU: RSS)
        # what the process held before the model existed: peak_mb - baseline_mb is what training added
        self.baseline_mb = 0.0 if self.cuda else self._process.memory_info().rss / 2**20

    @property
    def kind(self) -> str:
        return "cuda" if self.cuda else "rss"

    def start_step(self) -> None:
        self.values = {}

    def sample(self, phase: str) -> None:
        if self.cuda:
            mb = torch.cuda.max_memory_allocated(self.device) / 2**20
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            mb = self._process.memory_info().rss / 2**20
        self.values[phase] = max(mb, self.values.get(phase, 0.0))
        self.peak_mb = max(self.peak_mb, mb)

    def metrics(self) -> dict[str, float]:
        kind = "cuda_peak" if self.cuda else "rss"
        return {f"memory/{kind}_{phase}_mb": v for phase, v in self.values.items()}


class MetricsLog:
    """Per-step metrics as JSON lines, one row per step; survives a crash up to its last sync()."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._file = None

    def rows(self) -> list[dict]:
        if not self.path.exists():
            return []
        rows = []
        with open(self.path) as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:  # a line cut short by a crash
                    break
        return rows

    def truncate(self, after_step: int) -> list[dict]:
        """Keep the rows of steps <= after_step (what the checkpoint we resume from had seen)."""
        kept = [r for r in self.rows() if r["step"] <= after_step]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
        return kept

    def append(self, row: dict) -> None:
        if self._file is None:
            self._file = open(self.path, "a")
        self._file.write(json.dumps(row) + "\n")

    def sync(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self.sync()
            self._file.close()
            self._file = None


def plot_loss_curve(rows: Iterable[dict], path: Path, title: str = "") -> Optional[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(rows)
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    if not train:
        return None
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(*zip(*train), label="train loss", linewidth=1)
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_pipeline_timeline(timeline: dict, path: Path, title: str = "") -> Optional[Path]:
    """One row per pipeline rank: when it ran each microbatch's forward (F), backward (B) and weight
    gradient (W) of each of its stages; the gaps are the bubble."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = sorted(timeline["ranks"], key=lambda r: r["rank"])
    if not ranks:
        return None
    colors = {"F": "tab:blue", "B": "tab:orange", "W": "tab:green"}
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(ranks) + 1.5), dpi=100)
    for row, r in enumerate(ranks):
        for stage, kind, mb, t0, t1 in r["events"]:
            ax.broken_barh([(t0 * 1e3, (t1 - t0) * 1e3)], (row - 0.4, 0.8), color=colors.get(kind, "gray"),
                           edgecolor="white", linewidth=0.5)
            if (t1 - t0) * 1e3 > 0.03 * r["step_seconds"] * 1e3:
                ax.text((t0 + t1) / 2 * 1e3, row, f"{kind}{mb}" + (f"s{stage}" if len({e[0] for e in r['events']}) > 1 else ""),
                        ha="center", va="center", fontsize=7, color="white")
        idle = 1 - sum(t1 - t0 for *_, t0, t1 in r["events"]) / r["step_seconds"] if r["step_seconds"] else 0
        ax.text(r["step_seconds"] * 1e3, row, f"  idle {idle:.0%}", va="center", fontsize=8)
    ax.set_yticks(range(len(ranks)), [f"pp rank {r['rank']}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step started")
    ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.set_xlim(0, max(r["step_seconds"] for r in ranks) * 1e3 * 1.15)  # room for the idle labels
    ax.legend(handles, ["forward", "backward (input grad)", "backward (weight grad)"], loc="upper center",
              bbox_to_anchor=(0.5, -0.18 - 0.05 / len(ranks)), ncol=3, fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
