"""The layout's rules: what dp x hp x pp, the pipeline schedule and the batch split need of the model and the
training settings. Checked before launch (validation collects them)."""
from __future__ import annotations

from common.problem import Problem, divisors
from plugins.models.registry import vocab_rows
from plugins.parallel.schedules import SCHEDULES


def check(cfg) -> list[Problem]:
    return _tensor_parallel(cfg) + _pipeline(cfg) + _batch(cfg)


def _tensor_parallel(cfg) -> list[Problem]:
    """Each hp rank holds an equal share of heads, hidden units and vocabulary rows."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    problems = []
    kv = m.get("n_kv_heads")
    rows = vocab_rows(m)
    sizes = {"model.n_heads": m.n_heads, "model.d_model": m.d_model, "model.d_ff": m.d_ff, "model.vocab_size": rows,
             **({"model.n_kv_heads": kv} if kv else {})}
    shown = {**sizes, "model.vocab_size": m.vocab_size if rows == m.vocab_size else
             f"{m.vocab_size} (padded to {rows} rows by model.pad_vocab_to={m.pad_vocab_to})"}
    bad = [k for k, v in sizes.items() if v % p.hp]
    if bad:
        ok = [d for d in divisors(min(sizes.values())) if all(v % d == 0 for v in sizes.values()) and d <= 16]
        pad = (f", or pad the vocabulary (rows the data never uses, as Megatron does): model.pad_vocab_to={64 * p.hp}"
               if bad == ["model.vocab_size"] else "")
        problems.append(Problem("parallel.hp", p.hp, " and ".join(f"{k}={shown[k]}" for k in bad)
                                + f" not divisible by parallel.hp={p.hp} (each hp rank holds an equal share of heads, "
                                "hidden units and vocabulary rows)",
                                f"choose parallel.hp in {{{', '.join(map(str, ok))}}}" + pad))
    if p.sequence_parallel and p.hp == 1:
        problems.append(Problem("parallel.sequence_parallel", True, "sequence parallelism shards activations across "
                                "hp ranks and needs parallel.hp > 1", "parallel.sequence_parallel=false"))
    if p.sequence_parallel and t.seq_len % p.hp:
        problems.append(Problem("train.seq_len", t.seq_len, f"with parallel.sequence_parallel the sequence is split "
                                f"across parallel.hp={p.hp} ranks", f"train.seq_len={t.seq_len // p.hp * p.hp or p.hp}"))
    if p.loss_parallel and p.hp == 1:
        problems.append(Problem("parallel.loss_parallel", True, "vocab-parallel cross-entropy needs parallel.hp > 1",
                                "parallel.loss_parallel=false"))
    return problems


def _pipeline(cfg) -> list[Problem]:
    """The layers split evenly into pp * pp_chunks stages, and the schedule gets the chunks and microbatches it
    needs."""
    p, m = cfg.parallel, cfg.model
    problems = []
    stages = p.pp * p.pp_chunks
    if m.n_layers % stages:
        problems.append(Problem("parallel.pp_chunks" if p.pp_chunks > 1 else "parallel.pp",
                                p.pp_chunks if p.pp_chunks > 1 else p.pp,
                                f"model.n_layers={m.n_layers} must split evenly into parallel.pp*pp_chunks = "
                                f"{p.pp}*{p.pp_chunks} = {stages} pipeline stages",
                                f"pp*pp_chunks in {{{', '.join(str(d) for d in divisors(m.n_layers))}}}"))
    if p.pp == 1 and p.pp_chunks != 1:
        problems.append(Problem("parallel.pp_chunks", p.pp_chunks, "virtual pipeline stages need a pipeline "
                                "(parallel.pp > 1)", "parallel.pp_chunks=1, or set parallel.pp"))
    if p.pp == 1 and p.pp_schedule != "1f1b":  # a key that does nothing here is refused (docs/reliability.md)
        problems.append(Problem("parallel.pp_schedule", p.pp_schedule, "a pipeline schedule orders the microbatches "
                                "of pipeline stages; with parallel.pp=1 there is no pipeline, and it would do nothing",
                                "set parallel.pp (e.g. parallel=pipeline_pp2), or leave parallel.pp_schedule unset"))
    if p.pp == 1 or p.pp_schedule not in SCHEDULES:
        return problems
    schedule = SCHEDULES[p.pp_schedule]
    if not schedule.chunks_ok(p.pp_chunks):
        fixed = schedule.max_chunks == schedule.min_chunks
        problems.append(Problem("parallel.pp_chunks", p.pp_chunks, f"parallel.pp_schedule={p.pp_schedule} needs "
                                f"pp_chunks {schedule.chunks_rule()} model chunks per rank",
                                f"parallel.pp_chunks={schedule.min_chunks}" if fixed else
                                f"parallel.pp_chunks={schedule.min_chunks}, or a single-chunk schedule (1f1b, gpipe)"))
    need = schedule.min_microbatches(p.pp, p.pp_chunks)
    if p.microbatches < need:
        problems.append(Problem("parallel.microbatches", p.microbatches, f"parallel.pp_schedule={p.pp_schedule} "
                                f"with pp={p.pp}, pp_chunks={p.pp_chunks} needs at least {need} microbatches "
                                "(every stage must have work in flight)", f"parallel.microbatches={need}"))
    rounds = max(1, p.microbatches // p.pp)
    if schedule.in_rounds and p.microbatches % rounds:
        problems.append(Problem("parallel.microbatches", p.microbatches, f"parallel.pp_schedule={p.pp_schedule} "
                                f"runs microbatches in rounds of pp={p.pp}: {p.microbatches} is not a multiple of "
                                f"its {rounds} rounds", f"parallel.microbatches={rounds * p.pp}"))
    return problems


def _batch(cfg) -> list[Problem]:
    p, t = cfg.parallel, cfg.train
    split = p.dp * p.microbatches
    if t.batch_size % split == 0:
        return []
    return [Problem("train.batch_size", t.batch_size, f"the global batch is split into parallel.dp={p.dp} ranks x "
                    f"parallel.microbatches={p.microbatches} microbatches: it must be divisible by {split}",
                    f"train.batch_size={max(1, t.batch_size // split) * split}")]
