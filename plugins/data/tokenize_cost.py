"""What tokenizing a corpus costs, said before it starts: the tokenize stage's tasks, their memory against what they
may use, their time, and the plan's lines on what the stage reads and leaves out (plugins/data/corpus.py does the
work). The corpus is read once before launch, by the data's check (plugins/data/rules.py), which hands on what it
read (DataRead); the plan weighs and says that."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from plugins.data.bad_records import BadRecords, plan_line
from plugins.data.reading import Layout
from plugins.data.registry import get_source


@dataclass(frozen=True)
class DataRead:
    """What the data's check read of the corpus before launch, for the plan: each corpus's layout (one, or one per
    data.mix source; None for a source that yields documents or tokens itself) and, where data.bad_records=skip
    leaves them out, the bad records among the first records it read."""
    layouts: list[Optional[Layout]]
    bad: Optional[BadRecords] = None


def default_tasks(cfg, layouts: list[Optional[Layout]], cores: int) -> int:
    """data.tasks, else `cores`; never more than the pieces there are (a task per CHUNK_BYTES at most)."""
    if any(lay is None for lay in layouts):
        return 1
    return max(1, min(cfg.data.tasks or cores, max(len(lay.pieces) for lay in layouts)))


def tokenize_tasks(cfg, layouts: list[Optional[Layout]], cores: int) -> int:
    """The tokenize stage's task count: data.tasks; by default every usable core (`cores`) here, one in the debug
    cluster's one process, one task per node of cluster.nodes on SLURM; never more than the corpus's pieces."""
    if cfg.cluster.name == "debug":
        return 1
    return default_tasks(cfg, layouts, cfg.cluster.nodes if cfg.cluster.name == "slurm" and not cfg.data.tasks
                         else cores)


def memory_problem(cfg, tasks: int, avail: int, where: str) -> Optional[tuple]:
    """(key, value, rule, fix) when the tokenize tasks cannot fit the memory they may use: on one machine all of
    them (and the BPE's learning process), on SLURM each task (the first also learns)."""
    if not avail:
        return None
    learn = LEARN_PEAK_BYTES if cfg.data.tokenizer == "bpe" else 0
    local = cfg.cluster.name != "slurm"
    need = (tasks if local else 1) * TASK_PEAK_BYTES + learn
    if need <= avail:
        return None
    gb = 2**30
    fits = max(0, (avail - learn) // TASK_PEAK_BYTES)
    what = f"{tasks} task(s) of {TASK_PEAK_BYTES / gb:.2f} GB" if local else f"a task of {TASK_PEAK_BYTES / gb:.2f} GB"
    return ("data.tasks", tasks, f"the tokenize stage needs about {need / gb:,.2f} GB ({what}"
            + (f" and the BPE's learning, {learn / gb:.2f} GB" if learn else "") + f"), more than the "
            f"{avail / gb:,.1f} GB it may use ({where})",
            f"data.tasks={fits} or fewer" if local and fits >= 1 else "more memory per task (cluster.mem_per_task_gb)")


# Measured by benchmarks/data_scale.py on the 2-core VM (docs/models-and-data.md): a task's peak RSS (its process,
# forked with torch imported, the tokenizer and one batch: 0.26-0.46 GB flat in corpus size up to 4 GB), the BPE's
# learning process (0.56 GB from 0.25 GB, 0.60 GB from 1 GB), the bytes read per second by one single-threaded task
# and by the learning per core.
TASK_PEAK_BYTES = 480 << 20
LEARN_PEAK_BYTES = 700 << 20
TASK_BYTES_PER_S = {"bytes": 75e6, "bpe": 3.5e6, "hf": 3.5e6}
LEARN_BYTES_PER_S_PER_CORE = 4.5e6
LEFT_OUT_WARNING = 0.5          # data.max_bytes leaving out more than this share of the corpus is a warning


def estimate_seconds(cfg, layouts: list[Optional[Layout]], tasks: int, cores: int) -> float:
    """About how long tokenize takes: the BPE's learning (every core), then the slowest task's share."""
    kind = "hf" if cfg.data.tokenizer.startswith("hf:") else cfg.data.tokenizer
    read = sum(lay.read_bytes for lay in layouts if lay)
    learn = min(read, cfg.data.bpe_sample_bytes) / (LEARN_BYTES_PER_S_PER_CORE * cores) if kind == "bpe" else 0.0
    return learn + read / (TASK_BYTES_PER_S[kind] * tasks)


def plan_lines(cfg, read: DataRead, tasks: int, cores: int) -> list[str]:
    """The plan's lines on tokenize: what it reads, what data.max_bytes leaves out, tasks, memory and time, and the
    bad records left out; from what the data's check read (`read`), not read again."""
    if get_source(cfg.data.name).describe is not None:
        return get_source(cfg.data.name).describe(cfg)
    layouts = read.layouts
    if any(lay is None for lay in layouts):
        return []
    gb = 2**30
    nbytes = sum(lay.read_bytes for lay in layouts)
    total = sum(lay.total_bytes for lay in layouts)
    files = sum(lay.files for lay in layouts)
    learn = f"; the BPE learns from {_size(min(nbytes, cfg.data.bpe_sample_bytes))} first in a process of " \
            f"{LEARN_PEAK_BYTES / gb:,.2f} GB" if cfg.data.tokenizer == "bpe" else ""
    lines = [f"data: tokenize reads {files:,} of {sum(lay.total_files for lay in layouts):,} file(s), "
             f"{_size(nbytes)} of {_size(total)}" + (f" from {len(layouts)} sources" if len(layouts) > 1 else "")
             + f"; {tasks} task(s) of about {TASK_PEAK_BYTES / gb:,.2f} GB each{learn}; about "
             f"{_seconds(estimate_seconds(cfg, layouts, tasks, cores))} here"]
    twice = sum(lay.named_twice for lay in layouts)
    if twice:
        lines.append(f"data: data.paths names {twice:,} file(s) more than once (overlapping globs, a folder and a file "
                     "in it, links): each is read once")
    for i, lay in enumerate(layouts):
        if lay.left_out:
            share = lay.left_out / max(lay.total_bytes, 1)
            where = f"of source {i} " if len(layouts) > 1 else ""
            lines.append(f"{'warning: ' if share > LEFT_OUT_WARNING else ''}data.max_bytes={cfg.data.max_bytes} leaves "
                         f"out {_size(lay.left_out)} {where}of the corpus's {_size(lay.total_bytes)} ({share:.0%}); "
                         "data.max_bytes=0 reads all of it")
    if read.bad is not None:  # never silent: what the check before launch found is named, and the stage counts the rest
        lines += plan_line(read.bad)
    return lines


def _size(n: int) -> str:
    return f"{n / 1e9:,.2f} GB" if n >= 1e9 else f"{n / 1e6:,.1f} MB" if n >= 1e6 else f"{n:,} bytes"


def _seconds(s: float) -> str:
    return f"{s:,.1f} s" if s < 120 else f"{s / 60:,.0f} min" if s < 7200 else f"{s / 3600:,.1f} h"
