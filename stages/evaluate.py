"""evaluate: the aggregate's hf/ folder scored on tasks by lm-evaluation-harness (on when evaluate.tasks is set).

Its key is the aggregate's (the weights) with evaluate.* and the task files' bytes and lm-eval's version
(plugins/evaluate/harness.fingerprint), so a sweep whose points reach the same weights scores them once, and a
score is never of other weights: the output names the aggregate manifest's sha256 it scored (`scored`), as MLflow's
tag `evaluate.scored` does. Writes lm-eval's results (`results.json`: per task its metrics and their stderr, the
task configs, versions) and `metrics.json` (`<task>/<metric>`: value), both also in MLflow.
"""
from __future__ import annotations

import hashlib
import os

from plugins.evaluate import harness
from stages.base import Stage, StageContext
from storage.fsio import atomic_write_json, read_json


def evaluate(ctx: StageContext) -> None:
    ev, aggregate = ctx.cfg.evaluate, ctx.inputs["aggregate"]
    hf = aggregate / "hf"
    if not (hf / "config.json").is_file():
        said = read_json(aggregate / "manifest.json")["hf"]
        raise RuntimeError(f"the aggregate wrote no Hugging Face folder ({said}): lm-eval's hf model reads one")
    scored = hashlib.sha256((aggregate / "manifest.json").read_bytes()).hexdigest()
    os.environ["HF_DATASETS_CACHE"] = str(ctx.scratch / "datasets")  # the tasks' prepared data: not in $HOME
    import torch

    results = harness.score(hf, ev, "cuda" if torch.cuda.is_available() else "cpu")
    values = harness.metrics(results)
    kept = {k: results[k] for k in ("results", "configs", "versions", "n-shot", "higher_is_better", "n-samples")
            if k in results}
    atomic_write_json(ctx.out / "results.json", {**kept, "scored": scored, "lm_eval": harness.version()})
    atomic_write_json(ctx.out / "metrics.json", {"scored": scored, "metrics": values})
    ctx.tracker.set_tags({"evaluate.scored": scored})
    ctx.tracker.log_metrics(values)
    ctx.tracker.log_artifact(ctx.out / "results.json")
    ctx.log.info("scored %s (aggregate manifest sha256 %s): %s", ", ".join(ev.tasks), scored[:12],
                 ", ".join(f"{k} {v:.4f}" for k, v in values.items() if not k.endswith("_stderr")))


def _summary(out) -> str:
    values = read_json(out / "metrics.json")["metrics"]
    return ", ".join(f"{k} {v:.3f}" for k, v in values.items() if not k.endswith("_stderr"))


STAGE = Stage(
    name="evaluate",
    run=evaluate,
    after=("aggregate",),
    reads=("evaluate",),
    fingerprint=lambda cfg: harness.fingerprint(cfg.evaluate),
    summary=_summary,
    enabled=lambda cfg: bool(cfg.evaluate.tasks),
)
