"""reference: the reference model's log-probabilities of every preference pair, computed once, for an objective that
takes them (plugins/objectives/reference.py; dpo's) with objective.reference=cached.

A preference objective compares the policy's log-probability of each pair's chosen and rejected completion with a
frozen reference model's (train.init_from's; with peft=lora its base, the adapters off). They do not change while
training, so this stage computes them once for every pair of both splits — one forward per pair, in the run's own
layout (a model that needs tensor or pipeline parallelism to fit gets it here too) — and writes them beside nothing
else: {split}.npy, float64, one value per document of the tokenize stage's split (a pair's chosen 2k, rejected 2k+1).

Its key is the reference model (its files), the tokenized pairs (the tokenize stage's key), what decides the
numbers (model, precision, the row length and the head's chunk) and the code; not the objective, the optimizer, the
schedule, LoRA's rank or the layout (how, not what: every layout gives the same values, tests/test_head_loss.py), so a
sweep over any of them computes it once. The train stage reads it with each batch's rows (plugins/data/batcher.py).
"""
from __future__ import annotations

import resource
import time

import numpy as np

from planning.partition import without_adapters
from plugins.data import build_batcher
from plugins.models import get_model
from plugins.models.registry import vocab_rows
from plugins.objectives.reference import SPLITS, ReferenceRows, cached
from plugins.parallel import world_size
from plugins.parallel.layout import build_layout
from plugins.parallel.mesh import pick_device
from runtime.checkpointer import load_reference
from runtime.evaluate import row_logps
from runtime.step import StepSettings
from stages.base import Resources, Stage, StageContext
from storage import adapters, init_from
from storage.fsio import atomic_write_json, read_json



def reference(ctx: StageContext) -> None:
    cfg, t0 = ctx.cfg, time.perf_counter()
    layout = build_layout(*without_adapters(cfg), get_model(cfg.model.name), pick_device(), objective=ReferenceRows())
    loaded = load_reference(layout, cfg, vocab_rows(cfg.model))
    batcher = build_batcher(cfg, ctx.inputs["tokenize"] / "tokens")
    per_batch, forwards, summary = cfg.train.batch_size // 2, 0, {}
    width = StepSettings.of(cfg).repack_to  # rows cut after their longest real run, as the train step cuts them
    for split in SPLITS:
        pairs = batcher.pair_count(split)
        values = np.full(2 * pairs, np.nan)
        for first in range(0, pairs, per_batch):
            batch = batcher.pairs_in_order(split, first)
            values[batch.drawn] = row_logps(layout, batch, width).numpy()
            forwards += len(batch.drawn)
        if not np.isfinite(values).all():  # (a document left unscored stays nan)
            raise RuntimeError(f"the reference model's log-probability of {int((~np.isfinite(values)).sum())} "
                               f"{split} document(s) is not finite: {loaded} cannot be the reference")
        if ctx.is_rank0:
            np.save(ctx.out / f"{split}.npy", values)  # the folder is published whole when the stage returns
        summary[split] = {"pairs": pairs, "mean_chosen": float(values[0::2].mean()) if pairs else None,
                          "mean_rejected": float(values[1::2].mean()) if pairs else None}
    seconds = time.perf_counter() - t0
    if not ctx.is_rank0:
        return
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # against the plan's "at most" per rank
    atomic_write_json(ctx.out / "reference.json", {**summary, "model": loaded, "rows": forwards, "seconds": seconds,
                                                   "peak_rss": peak})
    ctx.tracker.log_metrics({"reference_s": seconds, "reference_rows": forwards, "reference_peak_rss": peak})
    ctx.log.info("reference log-probabilities of %d + %d pairs under %s: %d rows in %.1f s, peak RSS %.2f GB "
                 "(rank 0)", summary["train"]["pairs"], summary["val"]["pairs"], loaded, forwards, seconds,
                 peak / 2**30)


def _fingerprint(cfg) -> dict:
    """The reference model: the folder or checkpoint its weights come from (LoRA's base where adapters train) and
    its files as they are now; none: train.seed's initialisation (read)."""
    source = adapters.reference_of(cfg)
    return {"reference": source, "files": init_from.fingerprint(source, cfg.cache_dir)}


def _summary(out) -> str:
    r = read_json(out / "reference.json")
    return f"{r['train']['pairs']:,} + {r['val']['pairs']:,} pairs, {r['rows']:,} rows ({r['model']})"


STAGE = Stage(
    name="reference",
    run=reference,
    after=("tokenize",),
    reads=("model", "precision", "train.seed", "train.seq_len"),
    resources=lambda cfg: Resources(tasks=world_size(cfg.parallel)),
    fingerprint=_fingerprint,
    starts=True,
    summary=_summary,
    enabled=cached,
)
