"""What a run writes to files is plain text, even when it was started from a terminal: the terminal gets the live
progress bar and colours, the log files and summaries get lines without control codes."""
from __future__ import annotations

import contextlib
import json
import os
import pty
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import mlflow
import pytest

from orchestrator.cluster.local import free_port
from orchestrator.cluster.log_text import LogText
from orchestrator.sweeps import pictures
from tests.conftest import cli_env

CONTROL = (b"\x1b", b"\r")


def test_a_progress_bar_leaves_only_the_lines_printed_above_it_whatever_the_chunks():
    import io

    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn

    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=80, markup=False)
    with Progress(TextColumn("train"), BarColumn(), console=console, transient=True, auto_refresh=False) as bar:
        task = bar.add_task("steps", total=3)
        for i in range(3):
            console.print(f"step {i} [/tmp/x] é", style="bold red")
            bar.advance(task)
            bar.refresh()
    console.print("the end, with no newline", end="")
    raw = screen.getvalue().encode()
    assert raw.count(b"\x1b[") > 10 and b"\r" in raw and "━".encode() in raw
    for size in (1, 2, 5, 64, len(raw)):  # an escape sequence or a UTF-8 character cut between two chunks
        plain = LogText()
        got = b"".join(plain.feed(raw[i:i + size]) for i in range(0, len(raw), size)) + plain.close()
        assert got.decode() == "step 0 [/tmp/x] é\nstep 1 [/tmp/x] é\nstep 2 [/tmp/x] é\nthe end, with no newline"


@pytest.mark.e2e
def test_a_sweep_started_from_a_terminal_writes_plain_files_a_summary_and_an_mlflow_tree(tmp_path):
    """Two points of 300 steps on a pseudo-terminal: the terminal gets the bar (colour and cursor codes), while no
    file under runs/ holds a control code, and each rank log stays small (637 KB of bar frames before). The sweep's
    summary ranks both points; MLflow, read through a real `mlflow server`'s REST API, holds the sweep, its points and
    their stages named and tagged by what ran, the second point's data stages cached and linked to the first's."""
    primary, secondary = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "-m", "optimizer.lr=1e-3,3e-4", "train.steps=300",
                             "train.batch_size=4", "train.seq_len=32", "train.eval_every=100", "model.n_layers=1",
                             "train.checkpoint_every=150", "tracking=mlflow"],
                            cwd=tmp_path, env=cli_env(TERM="xterm-256color"), stdin=secondary, stdout=secondary,
                            stderr=secondary, start_new_session=True)
    os.close(secondary)
    seen = bytearray()

    def read() -> None:
        while True:
            try:
                chunk = os.read(primary, 65536)
            except OSError:  # the other side closed: EIO
                return
            if not chunk:
                return
            seen.extend(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert proc.wait(timeout=600) == 0, seen[-3000:].decode(errors="replace")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
        reader.join(timeout=10)
        os.close(primary)
    assert b"\x1b[" in seen and "━".encode() in seen  # the terminal did get the live display
    written = [p for p in (tmp_path / "runs").rglob("*") if p.is_file()]
    texts = [p for p in written if _text(p)]
    assert any(p.name == "sweep_summary.txt" for p in texts) and any(p.name == "plan.txt" for p in texts)
    logs = [p for p in texts if p.name == "rank0.out" and p.parent.name == "train"]
    assert len(logs) == 2 and all(p.stat().st_size < 50_000 for p in logs), [p.stat().st_size for p in logs]
    dirty = [f"{p.relative_to(tmp_path)}: {c!r}" for p in texts for c in CONTROL if c in p.read_bytes()]
    assert dirty == []

    assert b"sweep: 2 point(s)" in seen
    summary = json.loads(next(tmp_path.rglob("sweep_summary.json")).read_text())
    rows = sorted(summary["points"], key=lambda r: r["point"])  # the summary lists them best eval loss first
    # the pictures hold the points' data: the objective at each learning rate, each point's 300 losses
    assert summary["pictures"] == [pictures.OBJECTIVE, pictures.LOSSES]
    (panel,) = pictures.objective_figure(rows, summary["objective"]).axes
    assert panel.get_xlabel() == "optimizer.lr" and panel.get_xscale() == "linear"
    assert [tuple(xy) for xy in panel.lines[0].get_xydata()] == [(3e-4, rows[1]["objective"]),
                                                                (1e-3, rows[0]["objective"])]
    (chart,) = pictures.losses_figure(rows).axes
    for line, row in zip(chart.lines, rows):
        metrics = Path(row["run_dir"]) / "stages" / "train" / "output" / "metrics.jsonl"
        steps = [json.loads(x) for x in metrics.read_text().splitlines()]
        assert list(line.get_ydata()) == [r["loss"] for r in steps if "loss" in r] and len(line.get_ydata()) == 300
        assert line.get_label() == row["overrides"]
    assert [r["overrides"] for r in rows] == ["optimizer.lr=0.001", "optimizer.lr=0.0003"]
    assert all(r["status"] == "ok" and r["final_loss"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    assert rows[0]["final_loss"] != rows[1]["final_loss"]
    with mlflow_server(f"sqlite:///{tmp_path}/runs/mlflow.db") as uri:  # read as `mlflow ui` would: its REST API
        _check_the_mlflow_tree(mlflow.MlflowClient(uri), seen, tmp_path)


@contextlib.contextmanager
def mlflow_server(store: str):
    """`mlflow server` on `store` (a port of its own); yields its URI, stopped (its process group) after."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri", store, "--host",
                               "127.0.0.1", "--port", str(port), "--workers", "1"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.STDOUT, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None and time.monotonic() < deadline, "mlflow server did not start"
            try:
                urllib.request.urlopen(uri + "/health", timeout=2).close()
                break
            except OSError:
                time.sleep(0.5)
        yield uri
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def _check_the_mlflow_tree(client, seen: bytearray, tmp_path: Path) -> None:
    exp = client.get_experiment_by_name("orchestrator")
    (sweep,) = client.search_runs([exp.experiment_id], "tags.`orchestrator.kind` = 'sweep'")
    points = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{sweep.info.run_id}'")
    assert len(points) == 2 and sweep.info.status == "FINISHED"
    assert {a.path for a in client.list_artifacts(sweep.info.run_id)} >= {pictures.OBJECTIVE, pictures.LOSSES}
    for point in points:  # named by its overrides, cut at 80 characters, all of them in a tag
        name, every = point.info.run_name, point.data.tags["orchestrator.overrides"]
        assert name.startswith("optimizer.lr=") and name.endswith(" more") and len(name) <= 80
        assert every.startswith(name.rsplit(" +", 1)[0]) and every.endswith("tracking=mlflow")
    assert f"a new cache and a new MLflow store, sqlite:///{tmp_path}/runs/mlflow.db,".encode() in seen
    assert f"mlflow ui --backend-store-uri sqlite:///{tmp_path}/runs/mlflow.db".encode() in seen  # absolute
    second = max(points, key=lambda r: r.info.start_time)
    stages = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{second.info.run_id}'")
    status = {s.data.tags["orchestrator.stage"]: s.data.tags["orchestrator.status"] for s in stages}
    # the second point's plan timed its train stage by the first's steps (planning/stage_time.py), and said so
    (train,) = [s for s in stages if s.data.tags["orchestrator.stage"] == "train"]
    assert train.data.metrics["planned_s"] > 0 and train.data.metrics["duration_s"] > 0
    assert b"  train: " in seen and b"a step: " in seen
    assert b"time against the plan: the 3 stages the plan timed took " in seen
    assert status == {"tokenize": "cached", "export": "cached", "transform": "cached", "train": "ran", "checkpoint": "ran",
                      "aggregate": "ran"}
    assert train.data.tags["attention_kernel"] == "flash (cpu)" and train.data.tags["device"] == "cpu"  # what ran
    assert train.data.tags["engine"] == "torch" and train.data.tags["layout"] == "dp1 hp1 pp1"
    first = min(points, key=lambda r: r.info.start_time)
    for cached in (s for s in stages if s.data.tags["orchestrator.status"] == "cached"):  # linked to the first's
        source = client.get_run(cached.data.tags["orchestrator.source_run_id"])
        assert source.data.tags["mlflow.parentRunId"] == first.info.run_id == cached.data.tags[
            "orchestrator.source_invocation"] and source.data.tags["orchestrator.stage"] == cached.info.run_name
        link = f"(#/experiments/{exp.experiment_id}/runs/{source.info.run_id})"
        assert link in cached.data.tags["mlflow.note.content"]
        made = {k: v for k, v in source.data.metrics.items() if k not in ("duration_s", "planned_s")}
        assert made and cached.data.metrics == made and cached.data.params == source.data.params


def _text(path: Path) -> bool:
    """A file of text (UTF-8): logs, summaries, JSON, YAML; not weights, databases or pictures."""
    try:
        data = path.read_bytes()
        data.decode()
    except (UnicodeDecodeError, OSError):
        return False
    return b"\x00" not in data
