"""Training metrics: memory per phase, the window of steps not yet read back from the device, a resumable per-step
history, and the pictures (loss curve, pipeline timeline)."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Iterable, Optional

import psutil
import torch
import torch.distributed as dist

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


class MetricsWindow:
    """Step records whose device values (loss, gradient norm) have not been read back yet. `flush` reads them all
    with one transfer and reduces the window over ranks with two collectives: the loss is a sum of rank
    contributions, the idle share a mean, time and memory the worst rank's.

    Step times add up to the window's wall time, from its first step's start to the device finishing its last.
    A step's own clock is host time: on a GPU the host runs ahead of the device (only a full launch queue stops
    it), and the work still queued when the window is read back would otherwise be in no step (an overstated
    tokens/s and MFU). So `flush` waits for the device and spreads the rest over the window's steps in proportion
    to their host times; on a CPU the rest is what the loop does between steps (the next batch, progress)."""

    def __init__(self, layout):
        self.layout = layout
        self.rows: list[dict] = []
        self.started = 0.0  # perf_counter at the start of the window's first step

    def add(self, row: dict) -> None:
        if not self.rows:
            self.started = time.perf_counter() - row["step_time_s"]
        self.rows.append(row)

    def last_step_time(self) -> float:
        return self.rows[-1]["step_time_s"]

    def flush(self) -> list[dict]:
        rows, self.rows = self.rows, []
        if not rows:
            return []
        self._to_wall_time(rows)  # before the ranks compare times: each rank's own
        layout = self.layout
        losses = torch.stack([r["loss"].float() for r in rows])
        norms = torch.stack([r["grad_norm"].float() for r in rows])
        worst_keys = ["step_time_s", *[k for k in rows[0] if k.startswith("memory/")]]
        if layout.world:
            idle = torch.tensor([r.get("pipeline_idle_fraction", 0.0) for r in rows], device=losses.device)
            sums = layout.reduce(torch.stack([losses, idle]))
            losses, idle_mean = sums[0], (sums[1] / layout.coords.world_size).tolist()
            worst = layout.reduce(torch.tensor([[r[k] for k in worst_keys] for r in rows], dtype=torch.float64),
                                  dist.ReduceOp.MAX).tolist()
            for r, w, i in zip(rows, worst, idle_mean):
                r.update(zip(worst_keys, w))
                if "pipeline_idle_fraction" in r:
                    r["pipeline_idle_fraction"] = i
        if "objective" in rows[0]:  # each rank's shares: summed over ranks, then named by the objective's means
            means = rows[0]["objective"][0]
            shares = torch.stack([r.pop("objective")[1].float() for r in rows])
            for r, summed in zip(rows, layout.reduce(shares).tolist()):
                r.update(means(summed))
        values = torch.stack([losses.cpu(), norms.cpu()]).tolist()
        for r, loss, norm in zip(rows, *values):
            r["loss"], r["grad_norm"] = loss, norm
            r["tokens_per_s"] = r["tokens"] / r["step_time_s"]
        return rows

    def _to_wall_time(self, rows: list[dict]) -> None:
        if self.layout.device.type == "cuda":
            torch.cuda.synchronize(self.layout.device)
        host = sum(r["step_time_s"] for r in rows)
        wall = time.perf_counter() - self.started
        if host > 0 and wall > host:
            for r in rows:
                r["step_time_s"] *= wall / host


def numeric(row: dict) -> dict:
    """A step's record as MLflow metrics."""
    return {k: float(v) for k, v in row.items() if k not in ("step", "time") and isinstance(v, (int, float))}


def step_line(row: dict, steps: int) -> str:
    """A step's record as the line train.log_every prints."""
    text = (f"step {row['step']:>{len(str(steps))}}/{steps} | loss {row['loss']:.4f} | lr {row['lr']:.2e} | "
            f"grad norm {row['grad_norm']:.3f} | {row['tokens_per_s']:,.0f} tok/s | {row['step_time_s'] * 1e3:.1f} ms")
    if "rewards/accuracies" in row:  # preference pairs: how often the chosen wins, and by how much
        text += f" | reward acc {row['rewards/accuracies']:.2f} margin {row['rewards/margins']:.4f}"
    if "eval_loss" in row:
        text += f" | {eval_name(row)} {row['eval_loss']:.4f}"
    return text


def eval_name(row: dict) -> str:
    """What a row's eval_loss is: the held-out loss of a preference objective (rows with rewards: a pair objective's,
    which logs accuracies, or an unpaired one's: KTO's), which the aggregate's next-token eval loss must not be
    mistaken for; else the next-token loss itself."""
    if not _pairs(row):
        return "eval loss"
    return "eval pair loss" if any(k.endswith("rewards/accuracies") for k in row) else "eval objective loss"


def _pairs(row: dict) -> bool:
    return any(k.startswith(("rewards/", "eval_rewards/")) for k in row)


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
    from common.figures import plt

    rows = list(rows)
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    pairs = any(map(_pairs, rows))  # a preference objective's losses are per pair, not per token
    if not train:
        return None
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(*zip(*train), label="train loss", linewidth=1)
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval pair loss" if pairs else "eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss per pair" if pairs else "cross-entropy (nats/token)")
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
    from common.figures import plt

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
