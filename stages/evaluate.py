"""evaluate: the aggregate's hf/ folder scored on tasks by lm-evaluation-harness (on when evaluate.tasks is set).

Its key is the aggregate's (the weights) and the tokenize stage's (the validation split that val_perplexity scores
and the generations' prompts come from), with evaluate.* and the task files' bytes and lm-eval's version
(plugins/evaluate/harness.fingerprint), so a sweep whose points reach the same weights scores them once, and a
score is never of other weights: the output names the aggregate manifest's sha256 it scored (`scored`), as MLflow's
tag `evaluate.scored` does. Writes lm-eval's results (`results.json`: per task its metrics and their stderr, the
task configs, versions), `metrics.json` (`<task>/<metric>`: value), both also in MLflow, and `generations.json`
(prompt, answer, reference: MLflow's table of the same name). With evaluate.onnx the loglikelihood tasks are
scored again through the aggregate's ONNX model in ONNX Runtime (plugins/evaluate/models.py); the stage fails where
an example's loglikelihood differs from hf/'s by more than ONNX_RTOL, and records both scores.
"""
from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path
from typing import Optional

from plugins.evaluate import generations, harness, models, validation
from plugins.objectives.spec import rows_per_example
from runtime.machine import peak_rss_bytes
from stages.base import Stage, StageContext
from storage.fsio import atomic_write_json, read_json

ONNX_RTOL = 1e-4
KEPT = ("results", "configs", "versions", "n-shot", "higher_is_better", "n-samples")  # of lm-eval's results


def evaluate(ctx: StageContext) -> None:
    ev, aggregate = ctx.cfg.evaluate, ctx.inputs["aggregate"]
    hf = aggregate / "hf"
    if not (hf / "config.json").is_file():
        said = read_json(aggregate / "manifest.json")["hf"]
        raise RuntimeError(f"the aggregate wrote no Hugging Face folder ({said}): lm-eval's hf model reads one")
    scored = hashlib.sha256((aggregate / "manifest.json").read_bytes()).hexdigest()
    os.environ["HF_DATASETS_CACHE"] = str(ctx.scratch / "datasets")  # the tasks' prepared data: not in $HOME
    if not ctx.interactive:  # lm-eval's and datasets' progress bars, redrawn line after line into a log file
        os.environ.update(HF_DATASETS_DISABLE_PROGRESS_BARS="1")
        _no_progress_bars()
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    data = {}
    if validation.TASK in ev.tasks:  # the run's held-out documents, as text, scored where they are kept
        data[validation.TASK] = ctx.out / "validation.jsonl"
        validation.write_documents(ctx.inputs["tokenize"], data[validation.TASK], ev.limit,
                                   rows_per_example(ctx.cfg))
    tasks = harness.task_configs(ev, data)
    lm = models.hf_model(hf, ev, device)
    if ev.apply_chat_template and not getattr(lm.tokenizer, "chat_template", None):
        raise RuntimeError(f"evaluate.apply_chat_template=true, but the tokenizer in {hf} has no chat template")
    results = harness.score(lm, ev, tasks)
    values = harness.metrics(results)
    onnx = _onnx_scores(ctx, results, tasks, device) if ev.onnx else None
    table = _generations(ctx, lm)
    kept = {k: results[k] for k in KEPT if k in results}
    kept = _published(kept, ctx.out, ctx.published) if ctx.published else kept
    atomic_write_json(ctx.out / "results.json", {**kept, "scored": scored, "lm_eval": harness.version(),
                                                 **({"onnx": onnx} if onnx else {}),
                                                 "peak_rss_mb": peak_rss_bytes() / 2**20})  # the plan's is checked by it
    atomic_write_json(ctx.out / "metrics.json", {"scored": scored, "metrics": values,
                                                 **({"onnx": onnx["metrics"]} if onnx else {})})
    ctx.tracker.set_tags({"evaluate.scored": scored})
    ctx.tracker.log_metrics({**values, **{f"onnx/{k}": v for k, v in (onnx or {}).get("metrics", {}).items()}})
    ctx.tracker.log_artifact(ctx.out / "results.json")
    if table is not None:
        ctx.tracker.log_table(table, "generations.json")
    ctx.log.info("scored %s (aggregate manifest sha256 %s): %s", ", ".join(ev.tasks), scored[:12],
                 with_stderr(values, 4))


def _no_progress_bars() -> None:
    """Every tqdm bar made disabled (lm-eval's loglikelihood requests, transformers' loading of the weights, datasets'
    maps): tqdm reads TQDM_DISABLE once, when it is imported (the fork server imported it before this stage), and
    lm-eval passes its own `disable=`. tqdm.auto's and transformers' bars are subclasses, so one patch holds them."""
    import tqdm

    init = tqdm.tqdm.__init__
    if getattr(init, "quiet", False):
        return

    def quiet(self, *args, **kwargs):
        init(self, *args, **{**kwargs, "disable": True})

    quiet.quiet = True
    tqdm.tqdm.__init__ = quiet


def _published(value, out: Path, entry: Path):
    """lm-eval's recorded configs with this stage's files named where the cache keeps them once published (the
    validation task's data_files: `out` is a scratch folder gone after publishing), so they can be scored again."""
    if isinstance(value, dict):
        return {k: _published(v, out, entry) for k, v in value.items()}
    if isinstance(value, list):
        return [_published(v, out, entry) for v in value]
    if isinstance(value, str) and Path(value).is_relative_to(out):
        return os.fspath(entry / Path(value).relative_to(out))
    return value


def _onnx_scores(ctx: StageContext, results: dict, tasks: list, device: str) -> dict:
    """The loglikelihood tasks scored again through the aggregate's ONNX model: its metrics, and the largest
    difference of an example's loglikelihood from hf/'s (over ONNX_RTOL fails the stage)."""
    aggregate = ctx.inputs["aggregate"]
    names = harness.loglikelihood_tasks(results)
    if not names:
        raise RuntimeError(f"evaluate.onnx=true, but none of {', '.join(ctx.cfg.evaluate.tasks)} is scored by "
                           "loglikelihoods (generation tasks are scored from hf/ only)")
    chosen = [t for t in tasks if (t["task"] if isinstance(t, dict) else t) in names]
    lm = models.onnx_model(aggregate / "hf", aggregate / "model.onnx", ctx.cfg.evaluate, device)
    theirs = harness.score(lm, ctx.cfg.evaluate, chosen)
    gaps = {t: harness.loglikelihood_gap(theirs, results, t) for t in names}
    worst = max(gaps, key=gaps.get)
    if not gaps[worst] <= ONNX_RTOL:  # nan fails too
        raise RuntimeError(f"the ONNX model's loglikelihoods on {worst} differ from hf/'s by up to {gaps[worst]:.3g} "
                           f"(relative), more than {ONNX_RTOL:g}: {aggregate / 'model.onnx'} does not compute what "
                           "hf/ does")
    ctx.log.info("the ONNX model's loglikelihoods equal hf/'s to %.1e on %s", gaps[worst], ", ".join(names))
    return {"metrics": {k: v for k, v in harness.metrics(theirs).items() if k.split("/")[0] in names},
            "max_loglikelihood_gap": gaps}


SHOWN = 3  # answers the log shows beside their references (generations.json holds them all)


def _generations(ctx: StageContext, lm) -> Optional[dict]:
    """The model's answers to evaluate.prompts, else to the first validation prompts (plugins/evaluate/validation);
    None where there are none (evaluate.generations=0)."""
    ev = ctx.cfg.evaluate
    if ev.prompts:
        prompts = generations.user_prompts(lm.tokenizer, list(ev.prompts))
    else:
        prompts = validation.prompts(ctx.inputs["tokenize"], ev.generations, stride=rows_per_example(ctx.cfg)) \
            if ev.generations else []
    if not prompts:
        return None
    table = generations.answer(lm.model, lm.tokenizer, prompts, ev.max_new_tokens)
    atomic_write_json(ctx.out / "generations.json", table)
    for prompt, said, reference in list(zip(table["prompt"], table["answer"], table["reference"]))[:SHOWN]:
        ctx.log.info("answered %r (the prompt's end): %r; the reference: %r", prompt[-60:], said, reference)
    return table


def _summary(out) -> str:
    saved = read_json(out / "metrics.json")
    values = saved["metrics"]
    onnx = f" (the ONNX model's loglikelihoods within {ONNX_RTOL:g})" if saved.get("onnx") else ""
    return with_stderr(values, 3) + onnx


def with_stderr(values: dict[str, float], digits: int) -> str:
    """`task/acc 0.410 ± 0.049, ...`: each metric beside lm-eval's standard error of it where there is one (a
    difference within it is noise: a sweep picking 0.26 over 0.23 on 100 questions picks at random)."""
    said = []
    for k, v in values.items():
        if k.endswith("_stderr"):
            continue
        err = values.get(f"{k}_stderr")
        known = isinstance(err, (int, float)) and math.isfinite(err)
        said.append(f"{k} {v:.{digits}f}" + (f" ± {err:.{digits}f}" if known else ""))
    return ", ".join(said)


STAGE = Stage(
    name="evaluate",
    run=evaluate,
    after=("aggregate", "tokenize"),
    reads=("evaluate",),
    fingerprint=lambda cfg: harness.fingerprint(cfg.evaluate),
    summary=_summary,
    enabled=lambda cfg: bool(cfg.evaluate.tasks),
)
