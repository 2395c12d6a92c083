"""tokenize: the corpus -> memory-mapped token shards (plugins/data/shards.py) and the tokenizer that made them.

Its key holds the data config, the tokenizer, the model's vocabulary (random tokens are drawn over it) and the
content of the corpus files read, so a sweep over training settings tokenizes once and an edited file tokenizes
again. It runs as data.tasks processes (local, or SLURM tasks over several nodes), which share nothing but files:
task 0 makes the tokenizer (with data.tokenizer=bpe it learns it here, from a bounded sample of the training
split) and the others wait for it; each task streams its contiguous share of the corpus into a part of its own;
task 0 waits for every part and writes the index that names them. The result does not depend on the task count.
"""
from __future__ import annotations

import math
import multiprocessing
import os
import resource
import time
from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from plugins.data import data_fingerprint, shards
from plugins.data.bad_records import BadRecords, stage_line
from plugins.data.corpus import (TOKENIZER_DIR, TOKENS_DIR, build_tokenizer, corpus_folder, corpus_layouts,
                                 finish_all, source_index, source_tokens, wait_for, write_part)
from plugins.data.packing import longest_record
from plugins.data.reading import partition
from plugins.data.formats.spec import format_of
from plugins.data.records import makes_documents
from plugins.data.registry import get_source
from plugins.data.tokenize_cost import estimate_seconds, tokenize_tasks
from plugins.data.tokenizer import load_saved
from runtime.threads import usable_cores
from storage.fsio import atomic_write_json, read_json, remove_tree
from stages.base import Resources, Stage, StageContext

LOG_EVERY_S = 30.0


def tokenize(ctx: StageContext) -> None:
    cfg, t0 = ctx.cfg, time.perf_counter()
    tokens = ctx.out / TOKENS_DIR
    if get_source(cfg.data.name).tokens is not None:  # tokens already: nothing to encode
        _report(ctx, source_tokens(cfg, tokens), time.perf_counter() - t0, 0)
        return
    if get_source(cfg.data.name).indexed is not None:  # token shards already (Megatron's): an index pointing at them
        if ctx.is_rank0:
            _report(ctx, source_index(cfg, ctx.out), time.perf_counter() - t0, 0)
        return
    corpora = corpus_layouts(cfg)
    os.environ.setdefault("RAYON_NUM_THREADS", str(max(1, usable_cores() // ctx.world_size)))
    tok = _tokenizer(ctx, corpora)
    attempt = _attempt()
    shares = [_share(lay, ctx.rank, ctx.world_size) for _, lay in corpora]
    with _progress(ctx, sum(shares)) as (bar, task):
        done, last_log = [0], [time.perf_counter()]

        def progress(read: int, n_tokens: int) -> None:
            bar.update(task, completed=done[0] + read, tokens=n_tokens / max(time.perf_counter() - t0, 1e-9))
            if time.perf_counter() - last_log[0] > LOG_EVERY_S:
                last_log[0] = time.perf_counter()
                ctx.log.info("tokenize task %d/%d: %s of %s read", ctx.rank, ctx.world_size, _mb(done[0] + read),
                             _mb(sum(shares)))

        for i, (sub, lay) in enumerate(corpora):
            write_part(sub, lay, tok, corpus_folder(tokens, cfg, i), ctx.rank, ctx.world_size, progress, attempt)
            done[0] += shares[i]
    if not ctx.is_rank0:
        return
    parts = [corpus_folder(tokens, cfg, i) / shards.part_name(t) for i in range(len(corpora))
             for t in range(ctx.world_size)]
    wait_for(lambda: all(_part_done(p, attempt) for p in parts))
    read = sum(lay.read_bytes for _, lay in corpora if lay)
    extra = {"bytes_read": read, "files_read": sum(lay.files for _, lay in corpora if lay)} \
        if all(lay for _, lay in corpora) else {}
    index = finish_all(tokens, ctx.world_size, tok, cfg, corpora, **extra)
    _report(ctx, index, time.perf_counter() - t0, read)


def _tokenizer(ctx: StageContext, corpora):
    """Task 0 makes it and publishes it by a rename; the others wait and load it."""
    folder = ctx.out / TOKENIZER_DIR
    if ctx.is_rank0:
        partial = ctx.out / f".{TOKENIZER_DIR}.partial"
        remove_tree(partial)
        if ctx.cfg.data.tokenizer == "bpe":
            _learn_bpe(ctx, corpora, partial)
        else:
            build_tokenizer(ctx.cfg, corpora).save(partial)
        os.rename(partial, folder)
    else:
        wait_for(folder.is_dir)
    return load_saved(folder)


def _learn_bpe(ctx: StageContext, corpora, folder: Path) -> None:
    """With several tasks the BPE learns in a child process on every core (the tokenizers library sizes its thread
    pool once per process, and the tasks encode with one thread each); its time and peak go to the log."""
    t0 = time.perf_counter()
    if ctx.world_size > 1:
        failed = ctx.out / ".bpe_failed"
        child = multiprocessing.get_context("fork").Process(target=_learn, args=(ctx.cfg, corpora, folder,
                                                                                usable_cores(), failed))
        child.start()
        try:
            child.join()
        finally:  # Ctrl-C, SIGTERM: the learning stops with the task, not after it
            if child.is_alive():
                child.kill()
                child.join()
        if child.exitcode:
            raise RuntimeError(failed.read_text() if failed.exists() else f"learning the BPE failed (exit status "
                               f"{child.exitcode})")
    else:
        _learn(ctx.cfg, corpora, folder, usable_cores())
    peak = resource.getrusage(resource.RUSAGE_CHILDREN if ctx.world_size > 1 else resource.RUSAGE_SELF).ru_maxrss
    seconds = time.perf_counter() - t0
    ctx.log.info("learned a BPE of %d tokens in %.1f s from at most %s (data.bpe_sample_bytes), peak RSS %.2f GB",
                 ctx.cfg.data.vocab_size, seconds, _mb(ctx.cfg.data.bpe_sample_bytes), peak * 1024 / 2**30)
    atomic_write_json(ctx.out / "bpe_learned.json", {"seconds": seconds, "peak_rss": peak * 1024})


def _learn(cfg, corpora, folder: Path, cores: int, failed: Optional[Path] = None) -> None:
    """The BPE into folder; in a child process (failed given) its own thread pool of every core while the other
    tasks wait, and a failure's message in `failed` for the task to raise."""
    if failed is None:
        build_tokenizer(cfg, corpora).save(folder)
        return
    os.environ["RAYON_NUM_THREADS"] = str(cores)
    try:
        build_tokenizer(cfg, corpora).save(folder)
    except BaseException as e:
        failed.write_text(f"{type(e).__name__}: {e}")
        os._exit(1)


def _attempt() -> str:
    """What every task of this attempt shares and no earlier attempt had (a SLURM requeue, a local relaunch)."""
    env = os.environ
    return f"{env.get('SLURM_JOB_ID', '')}.{env.get('SLURM_RESTART_COUNT', '0')}.{env.get('MASTER_PORT', '')}"


def _part_done(part: Path, attempt: str) -> bool:
    try:
        return read_json(part / shards.PART).get("attempt") == attempt
    except (OSError, ValueError):
        return False


def _share(lay, task: int, tasks: int) -> int:
    """The bytes this task reads of a corpus (0: a source that yields its documents, read by one task)."""
    return sum(p.size for p in partition(lay.pieces, tasks)[task]) if lay else 0


def _progress(ctx: StageContext, total: int):
    console = Console(force_terminal=ctx.interactive or None, highlight=False)
    bar = Progress(TextColumn("[bold]tokenize"), BarColumn(), DownloadColumn(),
                   TextColumn("{task.fields[tokens]:,.0f} tokens/s"), TimeRemainingColumn(), console=console,
                   disable=not (ctx.interactive and ctx.is_rank0), transient=True)

    class _Bar:
        def __enter__(self):
            bar.__enter__()
            return bar, bar.add_task("tokenize", total=total or None, tokens=0.0)

        def __exit__(self, *exc):
            return bar.__exit__(*exc)

    return _Bar()


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def _report(ctx: StageContext, index: dict, seconds: float, read: int) -> None:
    tokens = index["train"]["tokens"] + index["val"]["tokens"]
    ctx.tracker.log_metrics({"tokenize_s": seconds, "tokens": tokens, "tokens_per_s": tokens / max(seconds, 1e-9),
                             "bytes_per_s": read / max(seconds, 1e-9), "bytes_read": read,
                             "tokenize_tasks": ctx.world_size, "train_tokens": index["train"]["tokens"],
                             "val_tokens": index["val"]["tokens"]})
    ctx.log.info("tokenized %d documents (%s) into %d + %d tokens (%s, vocabulary %d) in %.1f s by %d task(s): "
                 "%.0f tokens/s", index["train"]["documents"] + index["val"]["documents"], _mb(read),
                 index["train"]["tokens"], index["val"]["tokens"], index["tokenizer"], index["vocab_size"], seconds,
                 ctx.world_size, tokens / max(seconds, 1e-9))
    if index.get("pairs_cut"):
        ctx.log.warning("warning: %d %s(s) longer than a row (train.seq_len+1=%d tokens): each row holds its first "
                        "tokens (TRL's max_length truncation, keeping the start)", index["pairs_cut"],
                        format_of(ctx.cfg.data).unit.rstrip("s"), ctx.cfg.train.seq_len + 1)
    if index.get("unlearned"):  # records with nothing to learn: an empty completion, or no turn marked as the
        ctx.log.warning("warning: %d record(s) with nothing to learn left out (an empty completion, or a chat the "
                        "template marks no assistant turn of)", index["unlearned"])  # assistant's by the template
    if index.get("bad_records"):  # data.bad_records=skip: never silent
        ctx.log.warning("%s", stage_line(BadRecords.of(index)))


def _summary(out) -> str:
    index = read_json(out / TOKENS_DIR / shards.INDEX)
    left_out = BadRecords.of(index).count
    return (f"{index['train']['tokens']:,} + {index['val']['tokens']:,} tokens ({index['tokenizer']}, "
            f"vocabulary {index['vocab_size']:,})" + (f", {left_out:,} bad record(s) left out" if left_out else ""))


def _resources(cfg) -> Resources:
    """data.tasks or its default (tokenize_cost.tokenize_tasks); a local time limit three times the estimate."""
    layouts = [lay for _, lay in corpus_layouts(cfg)]
    tasks = tokenize_tasks(cfg, layouts, usable_cores())
    minutes = estimate_seconds(cfg, layouts, tasks, usable_cores()) / 60
    return Resources(tasks=tasks, timeout_min=max(60, math.ceil(3 * minutes)))  # a big corpus is no hang


def _fingerprint(cfg) -> str:
    """The data's; with records longer than a row refused, that bound too: the stage checks every record (a run
    with a shorter train.seq_len checks them again)."""
    longest = longest_record(cfg)
    if makes_documents(cfg.data):  # each record's completions must start within a row (check_pair)
        return f"{data_fingerprint(cfg)}+row={cfg.train.seq_len + 1}"
    return data_fingerprint(cfg) if longest is None else f"{data_fingerprint(cfg)}+longest_record={longest}"


STAGE = Stage(
    name="tokenize",
    run=tokenize,
    reads=("data", "model.vocab_size"),
    resources=_resources,
    ignores=("data.mix.weight",),
    fingerprint=_fingerprint,
    summary=_summary,
    collective=False,
)
