"""What the user sees: the plan before anything runs and the stage table at the end."""
from __future__ import annotations

import io
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.table import Table
from rich.text import Text

from orchestrator import interrupt
from orchestrator.dag import PlannedStage

# markup off: everything printed may hold text from users, paths or other processes ("[/tmp/x]", gloo's
# "[/__w/pytorch/...]"), which rich would read as tags; styles are given as Text objects instead
# a pipe or a CI log is not 80 columns wide: wide enough that tables keep paths and notes on one line
console = Console(highlight=False, markup=False, width=None if sys.stdout.isatty() or os.environ.get("COLUMNS")
                  else 160)


def styled(text: str, style: str) -> Text:
    return Text(text, style=style)
EXIT_CODES: list[int] = []  # of each invocation (or sweep) in this process; the command exits with the worst

STYLE = {"cached": "green", "ran": "bold green", "failed": "bold red", "not run": "yellow", "will run": "cyan",
         "interrupted": "yellow"}


@dataclass
class StageResult:
    name: str
    key: str
    status: str                    # cached | ran | failed | not run | interrupted
    seconds: float = 0.0
    summary: str = ""
    error: Optional[str] = None
    waited_s: float = 0.0          # before its processes started (the run's start-up), not in `seconds`


@dataclass
class Report:
    """The outcome of one invocation (one sweep point): every stage's result."""
    run_dir: Path
    results: dict[str, StageResult] = field(default_factory=dict)
    parent_run_id: Optional[str] = None
    submitted: bool = False        # SLURM jobs left running (cluster.wait=false): outcomes unknown yet

    @property
    def exit_code(self) -> int:
        statuses = {r.status for r in self.results.values()}
        return interrupt.exit_code() if "interrupted" in statuses else 1 if statuses & {"failed", "not run"} else 0

    @property
    def job_dirs(self) -> list[Path]:
        """The run folders whose SLURM jobs this report waits on (python -m orchestrator.follow reads them)."""
        return [self.run_dir] if (self.run_dir / "slurm_jobs.json").is_file() else []

    def with_followed(self, followed: list["Report"]) -> "Report":
        """This report once its jobs are followed to their end (followed: one report per job_dirs' folder)."""
        return followed[0]

    def scores(self, cfg) -> dict:
        """The evaluate stage's `<task>/<metric>` values ({} when it did not run or finish)."""
        return self._output(cfg, "evaluate", "metrics.json").get("metrics", {})

    def train_summary(self, cfg) -> dict:
        """The train stage's summary.json ({} when it did not finish: failed, not run, or still on SLURM)."""
        return self._output(cfg, "train", "summary.json")

    def _output(self, cfg, stage: str, name: str) -> dict:
        """A finished stage's JSON output file ({} when the stage failed, did not run or is still on SLURM)."""
        from orchestrator.cache.store import Cache
        from storage.fsio import read_json

        r = self.results.get(stage)
        if r is None or r.status not in ("ran", "cached"):
            return {}
        try:
            return read_json(Cache(Path(cfg.cache_dir).resolve()).entry(stage, r.key) / name)
        except (OSError, ValueError):
            return {}


def plan_table(plan: list[PlannedStage], where: dict[str, str]) -> Table:
    """where: stage name -> a short description of where it would run (stages to run only)."""
    table = Table(title="plan", title_justify="left")
    for col in ("stage", "key", "cache", "tasks", "runs"):
        table.add_column(col)
    for ps in plan:
        cache = styled("hit", "green") if ps.cached else \
            Text.assemble(("miss", "cyan"), f" ({ps.note})" if ps.note else "")
        table.add_row(ps.name, ps.key[:12], cache, str(ps.resources.tasks),
                      "-" if ps.cached else where.get(ps.name, ""))
    return table


def result_table(results: list[StageResult], total_s: float, title: str = "stages") -> Table:
    table = Table(title=f"{title} ({total_s:.1f} s in all)", title_justify="left")
    for col in ("stage", "status", "time", "result"):
        table.add_column(col, overflow="fold")  # a long path folds onto the next line, never cut
    for r in results:
        table.add_row(r.name, styled(r.status, STYLE.get(r.status, "")),
                      f"{r.seconds:.1f} s" if r.status in ("ran", "failed", "interrupted") else "-", r.summary)
    return table


def plan_text(plan: list[PlannedStage], where: dict[str, str]) -> str:
    return plain_text(plan_table(plan, where))


def plain_text(renderable) -> str:
    """What a file gets of what the console shows: the same width, without colour codes (a capture of a terminal's
    console keeps them)."""
    out = Console(file=io.StringIO(), width=console.width, color_system=None, force_terminal=False, highlight=False,
                  markup=False)
    out.print(renderable)
    return out.file.getvalue()
