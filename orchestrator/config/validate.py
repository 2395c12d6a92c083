"""Every rule a config must meet, checked before anything starts; all problems reported at once."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterable

from omegaconf import DictConfig, ListConfig, OmegaConf

from orchestrator.config.errors import ConfigError, Problem, unknown_key_problem
from runtime.threads import rank_threads, usable_cores

# What each pipeline schedule needs: (chunks rule, minimum microbatches as a function of pp and chunks)
SCHEDULES = {
    "gpipe": ("== 1", lambda pp, c: pp),
    "1f1b": ("== 1", lambda pp, c: pp),
    "interleaved_1f1b": (">= 2", lambda pp, c: pp),
    "looped_bfs": (">= 2", lambda pp, c: pp),
    "interleaved_zb": (">= 2", lambda pp, c: pp),
    "zbv": ("== 2", lambda pp, c: pp),
}


_PLANS: dict[str, dict] = {}


def partition_plan(cfg: DictConfig) -> dict:
    """The layout's partition plan (built on the meta device: no memory), once per model and layout."""
    from planning.partition import build_plan

    key = json.dumps([OmegaConf.to_container(cfg.model, resolve=True),
                      OmegaConf.to_container(cfg.parallel, resolve=True)], sort_keys=True)
    if key not in _PLANS:
        _PLANS[key] = build_plan(cfg.model, cfg.parallel)
    return _PLANS[key]


def _memory(cfg: DictConfig):
    """The estimate per rank, what a rank may use (0: unknown) and where that figure comes from."""
    from planning.estimate import available_bytes, estimate

    return (estimate(cfg, partition_plan(cfg)), *available_bytes(cfg))


def memory_line(cfg: DictConfig) -> str:
    """The plan's lines on memory: the estimate per train rank against what a rank may use, then what the stages
    around training need (one process each) and write."""
    from planning.estimate import host_bytes, stage_costs

    est, avail, where = _memory(cfg)
    of = f" of {avail / 2**30:,.1f} GB ({where})" if avail else f" ({where})"
    costs = stage_costs(cfg, partition_plan(cfg))
    host, host_where = host_bytes(cfg)
    stages = "; ".join(f"{name} {c.peak / 2**30:,.2f} GB ({c.what})" for name, c in costs.items())
    return (f"memory: {est.describe()}{of}\n  one process each: {stages}" +
            (f", of {host / 2**30:,.1f} GB ({host_where})" if host else f" ({host_where})") +
            f"\n  disk: checkpoints {costs['checkpoint'].writes / 2**30:,.2f} GB each, the aggregate's files "
            f"{costs['aggregate'].writes / 2**30:,.2f} GB")


def time_line(cfg: DictConfig) -> str:
    """The plan's line on time: the step's FLOPs against this machine's matmul rate, measured now. A floor, not a
    forecast: the rest of a step (attention, norms, the optimizer, communication, pipeline bubbles) comes on top."""
    import torch

    from planning.estimate import matmul_rate, step_flops

    if cfg.cluster.name == "slurm":
        return "time: not estimated here (the stages run on the cluster's nodes)"
    p = cfg.parallel
    ranks = p.dp * p.hp * p.pp
    flops = step_flops(cfg, partition_plan(cfg)["n_parameters"])
    if torch.cuda.is_available():
        rate = matmul_rate("cuda", cfg.precision.name, 1) * min(ranks, torch.cuda.device_count())
        where = f"{min(ranks, torch.cuda.device_count())} GPU(s), {cfg.precision.name}"
    else:
        threads = min(usable_cores(), rank_threads(cfg.cluster.get("threads_per_rank"), ranks) * ranks)
        rate = matmul_rate("cpu", "fp32", threads)
        where = f"{threads} CPU thread(s)"
    floor = flops / rate
    return (f"time: {flops / 1e12:,.3f} TFLOP per step; matmuls here run at {rate / 1e9:,.0f} GFLOP/s ({where}, "
            f"measured now), so a step takes at least {_duration(floor)} and {cfg.train.steps} steps at least "
            f"{_duration(floor * cfg.train.steps)}")


def _duration(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1000:,.0f} ms"
    if seconds < 120:
        return f"{seconds:,.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:,.0f} min"
    return f"{seconds / 3600:,.1f} h"


def _memory_problems(cfg: DictConfig) -> list[Problem]:
    """A layout whose estimated peak exceeds what a rank may use is refused, with the numbers and the fixes."""
    est, avail, where = _memory(cfg)
    if not avail or est.total <= avail:
        return []
    p = cfg.parallel
    fixes = [f"parallel.hp={p.hp * 2} or parallel.pp={p.pp * 2} (each rank holds less)"]
    if p.dp > 1 and p.dp_mode != "shard":
        fixes.append("parallel.dp_mode=shard (parameters, gradients and optimizer state split over dp)")
    if cfg.memory.level == 0:
        fixes.append("memory=level1 (recompute activations)")
    fixes.append(f"a smaller train.batch_size (now {cfg.train.batch_size}) or more parallel.microbatches")
    return [Problem("parallel", f"dp{p.dp} hp{p.hp} pp{p.pp}", f"the estimated peak per rank, {est.describe()}, "
                    f"exceeds the {avail / 2**30:,.1f} GB a rank may use ({where})", "; ".join(fixes))]


def _stage_memory_problems(cfg: DictConfig) -> list[Problem]:
    """A stage around training whose one process cannot fit the memory it may use is refused before training starts,
    not found out after the GPU hours are spent."""
    from planning.estimate import host_bytes, stage_costs

    avail, where = host_bytes(cfg)
    if not avail:
        return []
    costs = stage_costs(cfg, partition_plan(cfg))
    gb = 2**30
    problems = []
    export = costs["export"]
    if export.peak > avail:
        problems.append(Problem("model", cfg.model.name, f"the export stage needs about {export.peak / gb:,.1f} GB "
                                f"({export.what}), more than the {avail / gb:,.1f} GB it may use ({where})",
                                "a node with more memory (cluster.mem_per_task_gb on SLURM)"))
    agg = costs["aggregate"]
    if agg.peak > avail:
        without = stage_costs(cfg, partition_plan(cfg), onnx=False)["aggregate"]
        if cfg.aggregate.onnx and without.peak <= avail:
            problems.append(Problem("aggregate.onnx", True, f"the aggregate stage's ONNX check needs about "
                                    f"{agg.peak / gb:,.1f} GB ({agg.what}), more than the {avail / gb:,.1f} GB it may "
                                    f"use ({where})", f"aggregate.onnx=false (the safetensors and hf/ files then "
                                    f"need {without.peak / gb:,.1f} GB), or a node with more memory"))
        else:
            problems.append(Problem("model", cfg.model.name, f"the aggregate stage needs about {agg.peak / gb:,.1f} GB "
                                    f"({agg.what}), more than the {avail / gb:,.1f} GB it may use ({where})",
                                    "a node with more memory (cluster.mem_per_task_gb on SLURM)"))
    return problems


def warnings(cfg: DictConfig) -> list[str]:
    """Legal but unwise settings: the run goes ahead, and the plan says this in one line each."""
    notes = []
    world = cfg.parallel.dp * cfg.parallel.hp * cfg.parallel.pp
    cores = usable_cores()
    if cfg.cluster.name == "local" and world > cores and not _has_cuda():
        notes.append(f"warning: {world} ranks (dp*hp*pp) on {cores} CPU cores: the ranks share cores, so this "
                     "layout runs slowly here (fine for checking correctness; give it more cores or a cluster)")
    if cfg.triton.enabled and cfg.triton.mode == "reduce-overhead" and not _has_cuda():
        notes.append("warning: triton.mode=reduce-overhead uses CUDA graphs; on a CPU it compiles as mode=default")
    return notes


def validate(cfg: DictConfig, overrides: Iterable[str] = ()) -> None:
    """Raise ConfigError with every problem. The cross-field rules (layout, training, machine) read the fields as
    numbers they divide by: they run once every field is valid on its own, so `parallel.hp=0` is reported as the
    field's rule (>= 1), not as a crash of the rule that divides by it."""
    problems = schema_problems(cfg, list(overrides))
    if not problems:
        problems = layout_problems(cfg) + training_problems(cfg) + machine_problems(cfg)
    if problems:
        raise ConfigError(problems)


# -- the schema: known keys, choices, bounds ---------------------------------------------------------------

def schema_problems(cfg: DictConfig, overrides: list[str]) -> list[Problem]:
    from orchestrator.config.options import options_of
    from orchestrator.config.schema import GROUP_SCHEMAS

    problems: list[Problem] = []
    for o in overrides:  # `model=model_schema` composes (Hydra sees the schema in the group), but is no option
        group, _, option = o.lstrip("+").partition("=")
        if group in GROUP_SCHEMAS and option in GROUP_SCHEMAS[group]:
            problems.append(Problem(group, option, f"{option} is the schema of the {group} options, not an option",
                                    f"choose one of: {', '.join(options_of(group))}"))

    def walk(node: DictConfig, path: str) -> None:
        schema = OmegaConf.get_type(node)
        fields = {f.name: f for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else {}
        for name in node.keys():
            full = f"{path}.{name}" if path else str(name)
            if fields and name not in fields:
                added = next((o for o in overrides if o.lstrip("+").split("=", 1)[0] == full), "")
                problems.append(unknown_key_problem(full, schema, node[name], added))
                continue
            child = node._get_node(name)
            if isinstance(child, DictConfig):
                walk(child, full)
                continue
            f = fields.get(name)
            if f is not None:
                problems.extend(_field_problems(full, node[name], f))

    walk(cfg, "")
    return problems


def _field_problems(full: str, value, f: dataclasses.Field) -> list[Problem]:
    meta = f.metadata
    is_list = isinstance(value, (list, ListConfig))
    items = list(value) if is_list else [value]
    if any(isinstance(v, float) and not math.isfinite(v) for v in items):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        return [Problem(full, value, f"{full} must be a finite number ({meta['help']})", f"{full}={default}")]
    choices = meta.get("choices")
    if choices and any(v not in choices for v in items):
        return [Problem(full, value, f"{full} must be {'a list of' if is_list else 'one of'} "
                        f"{', '.join(map(str, choices))} ({meta['help']})",
                        f"{full}=[{choices[0]}]" if is_list else f"{full}={choices[0]}")]
    lo, hi = meta.get("min"), meta.get("max")
    for item in items:
        if not isinstance(item, (int, float)) or isinstance(item, bool):
            continue
        if (lo is not None and item < lo) or (hi is not None and item > hi):
            span = f"between {lo} and {hi}" if lo is not None and hi is not None else \
                f">= {lo}" if lo is not None else f"<= {hi}"
            if is_list:
                kept = [v for v in items if (lo is None or v >= lo) and (hi is None or v <= hi)]
                return [Problem(full, value, f"every item of {full} must be {span} ({meta['help']})",
                                f"{full}={kept or [lo if lo is not None else hi]}")]
            default = f.default if f.default is not dataclasses.MISSING else None
            in_range = isinstance(default, (int, float)) and (lo is None or default >= lo) and \
                (hi is None or default <= hi) and default != 0
            return [Problem(full, value, f"{full} must be {span} ({meta['help']})",
                            f"{full}={default if in_range else lo if lo is not None and item < lo else hi}")]
    return []


# -- the parallel layout ---------------------------------------------------------------------------------------

def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_problems(cfg: DictConfig) -> list[Problem]:
    p, m, t = cfg.parallel, cfg.model, cfg.train
    problems = []
    world = p.dp * p.hp * p.pp
    if cfg.cluster.nprocs is not None and cfg.cluster.nprocs != world:
        problems.append(Problem("cluster.nprocs", cfg.cluster.nprocs,
                                f"the train stage runs one process per rank: parallel.dp*hp*pp = {p.dp}*{p.hp}*{p.pp} "
                                f"= {world} processes", f"cluster.nprocs={world}, or leave it unset (null)"))
    if m.d_model % m.n_heads:
        problems.append(Problem("model.n_heads", m.n_heads, f"model.d_model={m.d_model} must be divisible by "
                                "model.n_heads (each head gets d_model/n_heads dimensions)",
                                f"model.n_heads in {{{', '.join(map(str, _divisors(m.d_model)[:8]))}}}"))
    kv = m.get("n_kv_heads")
    if kv and m.n_heads % kv:
        problems.append(Problem("model.n_kv_heads", kv, f"grouped-query attention shares each key/value head among "
                                f"model.n_heads/n_kv_heads query heads: model.n_heads={m.n_heads} must be divisible "
                                "by it", f"model.n_kv_heads in {{{', '.join(map(str, _divisors(m.n_heads)))}}}"))
    from plugins.models.registry import vocab_rows

    rows = vocab_rows(m)
    sizes = {"model.n_heads": m.n_heads, "model.d_model": m.d_model, "model.d_ff": m.d_ff, "model.vocab_size": rows,
             **({"model.n_kv_heads": kv} if kv else {})}
    shown = {**sizes, "model.vocab_size": m.vocab_size if rows == m.vocab_size else
             f"{m.vocab_size} (padded to {rows} rows by model.pad_vocab_to={m.pad_vocab_to})"}
    bad = [k for k, v in sizes.items() if v % p.hp]
    if bad:
        ok = [d for d in _divisors(min(sizes.values())) if all(v % d == 0 for v in sizes.values()) and d <= 16]
        pad = (f", or pad the vocabulary (rows the data never uses, as Megatron does): model.pad_vocab_to={64 * p.hp}"
               if bad == ["model.vocab_size"] else "")
        problems.append(Problem("parallel.hp", p.hp, " and ".join(f"{k}={shown[k]}" for k in bad)
                                + f" not divisible by parallel.hp={p.hp} (each hp rank holds an equal share of heads, "
                                "hidden units and vocabulary rows)",
                                f"choose parallel.hp in {{{', '.join(map(str, ok))}}}" + pad))
    stages = p.pp * p.pp_chunks
    if m.n_layers % stages:
        problems.append(Problem("parallel.pp_chunks" if p.pp_chunks > 1 else "parallel.pp",
                                p.pp_chunks if p.pp_chunks > 1 else p.pp,
                                f"model.n_layers={m.n_layers} must split evenly into parallel.pp*pp_chunks = "
                                f"{p.pp}*{p.pp_chunks} = {stages} pipeline stages",
                                f"pp*pp_chunks in {{{', '.join(str(d) for d in _divisors(m.n_layers))}}}"))
    if p.pp == 1 and p.pp_chunks != 1:
        problems.append(Problem("parallel.pp_chunks", p.pp_chunks, "virtual pipeline stages need a pipeline "
                                "(parallel.pp > 1)", "parallel.pp_chunks=1, or set parallel.pp"))
    if p.pp > 1 and p.pp_schedule in SCHEDULES:
        chunks_rule, min_mb = SCHEDULES[p.pp_schedule]
        op, n = chunks_rule.split()
        if not (p.pp_chunks == int(n) if op == "==" else p.pp_chunks >= int(n)):
            problems.append(Problem("parallel.pp_chunks", p.pp_chunks, f"parallel.pp_schedule={p.pp_schedule} needs "
                                    f"pp_chunks {chunks_rule} model chunks per rank",
                                    f"parallel.pp_chunks={n}" if op == "==" else
                                    f"parallel.pp_chunks={n}, or a single-chunk schedule (1f1b, gpipe)"))
        need = min_mb(p.pp, p.pp_chunks)
        if p.microbatches < need:
            problems.append(Problem("parallel.microbatches", p.microbatches, f"parallel.pp_schedule={p.pp_schedule} "
                                    f"with pp={p.pp}, pp_chunks={p.pp_chunks} needs at least {need} microbatches "
                                    "(every stage must have work in flight)", f"parallel.microbatches={need}"))
        rounds = max(1, p.microbatches // p.pp)
        if p.pp_schedule in ("interleaved_1f1b", "interleaved_zb") and p.microbatches % rounds:
            problems.append(Problem("parallel.microbatches", p.microbatches, f"parallel.pp_schedule={p.pp_schedule} "
                                    f"runs microbatches in rounds of pp={p.pp}: {p.microbatches} is not a multiple of "
                                    f"its {rounds} rounds", f"parallel.microbatches={rounds * p.pp}"))
    if t.batch_size % (p.dp * p.microbatches):
        problems.append(Problem("train.batch_size", t.batch_size, f"the global batch is split into parallel.dp="
                                f"{p.dp} ranks x parallel.microbatches={p.microbatches} microbatches: it must be "
                                f"divisible by {p.dp * p.microbatches}",
                                f"train.batch_size={max(1, t.batch_size // (p.dp * p.microbatches)) * p.dp * p.microbatches}"))
    if p.sequence_parallel and p.hp == 1:
        problems.append(Problem("parallel.sequence_parallel", True, "sequence parallelism shards activations across "
                                "hp ranks and needs parallel.hp > 1", "parallel.sequence_parallel=false"))
    if p.sequence_parallel and t.seq_len % p.hp:
        problems.append(Problem("train.seq_len", t.seq_len, f"with parallel.sequence_parallel the sequence is split "
                                f"across parallel.hp={p.hp} ranks", f"train.seq_len={t.seq_len // p.hp * p.hp or p.hp}"))
    if p.loss_parallel and p.hp == 1:
        problems.append(Problem("parallel.loss_parallel", True, "vocab-parallel cross-entropy needs parallel.hp > 1",
                                "parallel.loss_parallel=false"))
    if cfg.cluster.name == "debug" and world > 1:
        problems.append(Problem("cluster", "debug", f"the debug cluster runs stages inside this process (one rank); "
                                f"the layout needs {world}", "cluster=local"))
    if cfg.cluster.name == "slurm":
        problems += _slurm_layout_problems(cfg.cluster, world)
    return problems


def _slurm_layout_problems(c: DictConfig, world: int) -> list[Problem]:
    from orchestrator.config.schema import STAGE_TIMES_MIN

    problems = []
    if world % c.nodes:
        fits = [n for n in range(1, world + 1) if world % n == 0]
        problems.append(Problem("cluster.nodes", c.nodes, f"the train job's {world} tasks (dp*hp*pp) are spread evenly "
                                f"over the nodes: {world} must be divisible by cluster.nodes",
                                f"cluster.nodes= one of {fits}"))
    unknown = sorted(set(c.time_min) - set(STAGE_TIMES_MIN))
    if unknown:
        problems.append(Problem(f"cluster.time_min.{unknown[0]}", c.time_min[unknown[0]], "time limits are given per "
                                f"stage: {', '.join(STAGE_TIMES_MIN)}", "cluster.time_min.train=120"))
    for stage, minutes in c.time_min.items():
        if not isinstance(minutes, int) or minutes < 1:
            problems.append(Problem(f"cluster.time_min.{stage}", minutes, "a job's time limit is a whole number of "
                                    "minutes >= 1", f"cluster.time_min.{stage}={STAGE_TIMES_MIN.get(stage, 60)}"))
    return problems


# -- model, data and training ------------------------------------------------------------------------------------

def training_problems(cfg: DictConfig) -> list[Problem]:
    from plugins.data import get_source
    from plugins.models import model_names

    m, t, d = cfg.model, cfg.train, cfg.data
    problems = []
    if m.name not in model_names():
        problems.append(Problem("model.name", m.name, "the model must be registered in plugins/models",
                                f"one of: {', '.join(model_names())}"))
    if cfg.export.sample_seq > m.max_seq_len:
        problems.append(Problem("export.sample_seq", cfg.export.sample_seq, f"the export traces sequences of this "
                                f"length; the model holds positions up to model.max_seq_len={m.max_seq_len}",
                                f"export.sample_seq={min(16, m.max_seq_len)}"))
    if t.seq_len > m.max_seq_len:
        problems.append(Problem("train.seq_len", t.seq_len, f"sequences cannot be longer than model.max_seq_len="
                                f"{m.max_seq_len}", f"train.seq_len={m.max_seq_len}"))
    try:
        source = get_source(d.name)
    except KeyError:
        source = None
    problems += _tokenizer_problems(cfg, source)
    prof = list(t.profile)
    if prof and not (len(prof) == 2 and 1 <= prof[0] <= prof[1] <= t.steps):
        problems.append(Problem("train.profile", prof, f"the steps to profile are [first, last] with 1 <= first <= last "
                                f"<= train.steps={t.steps}", f"train.profile=[{min(3, t.steps)},{min(5, t.steps)}]"))
    betas = cfg.optimizer.get("betas")
    if betas is not None and (len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas)):
        problems.append(Problem("optimizer.betas", list(betas), "Adam's betas are two decay rates, each in [0, 1)",
                                "optimizer.betas=[0.9,0.95]"))
    problems += _init_from_problems(cfg)
    if source is not None and source.check is not None:
        problems += [Problem(*p) for p in source.check(cfg)]
    if d.paths and d.name != "text":
        problems.append(Problem("data.paths", list(d.paths), f"data.paths is read by data=text only; data={d.name} "
                                "ignores it", "data=text to train on these files, or leave data.paths empty"))
    return problems


def _tokenizer_problems(cfg: DictConfig, source) -> list[Problem]:
    """data.tokenizer is one we know, and the model's embedding has a row for every id it produces."""
    from plugins.data import tokenizer as tokenizers

    d, m = cfg.data, cfg.model
    if source is None or source.documents is None:
        return []  # token sources adapt to the model's vocabulary
    spec = d.tokenizer
    folder = tokenizers.hf_folder(spec)
    if spec not in ("bytes", "bpe") and folder is None:
        return [Problem("data.tokenizer", spec, "a tokenizer is bytes, bpe or hf:<folder>", "data.tokenizer=bytes")]
    if folder is not None and not (folder / "tokenizer.json").is_file() and not folder.is_file():
        return [Problem("data.tokenizer", spec, f"{folder} holds no tokenizer.json",
                        "hf:<a folder saved with tokenizer.save_pretrained>")]
    try:
        need = tokenizers.vocab_needed(d)
    except (OSError, ValueError) as e:
        return [Problem("data.tokenizer", spec, f"the tokenizer cannot be loaded: {e}", "another tokenizer folder")]
    if need is not None and need > m.vocab_size:
        return [Problem("model.vocab_size", m.vocab_size, f"data.tokenizer={spec} produces token ids up to {need - 1}",
                        f"model.vocab_size={-(-need // 64) * 64} or more (a multiple of 64 is fastest)"
                        + (f", or data.vocab_size={m.vocab_size}" if spec == "bpe" and m.vocab_size >= 259 else ""))]
    return []


def _init_from_problems(cfg: DictConfig) -> list[Problem]:
    """train.init_from names a complete checkpoint of a model with this model's parameters (any layout)."""
    from pathlib import Path

    from storage import hf
    from storage.fsio import read_json

    path = cfg.train.init_from
    if not path:
        return []
    from storage.checkpoint import MANIFEST  # torch's DCP: 0.7 s of imports, only when a checkpoint is named
    if path.startswith(hf.PREFIX):
        return _hf_init_problems(cfg)
    manifest_path = Path(path) / MANIFEST
    if not manifest_path.is_file():
        return [Problem("train.init_from", path, f"must be a complete checkpoint folder (with {MANIFEST}), e.g. "
                        "runs/cache/checkpoint/<key> or the checkpoint/ folder of a train stage's output",
                        "point it at a checkpoint folder, or remove it (train.init_from=null)")]
    manifest = read_json(manifest_path)
    theirs = {n: q["shape"] for n, q in manifest.get("partition_plan", {}).get("parameters", {}).items()}
    ours = {n: q["shape"] for n, q in partition_plan(cfg)["parameters"].items()}
    differ = sorted(n for n in ours.keys() | theirs.keys() if ours.get(n) != theirs.get(n))
    problems = []
    if differ:
        problems.append(Problem("train.init_from", path, f"the checkpoint holds another model: {len(differ)} "
                                f"parameter(s) differ in name or shape, e.g. {differ[0]}: checkpoint "
                                f"{theirs.get(differ[0])}, model {ours.get(differ[0])}",
                                "choose the model= options the checkpoint was trained with"))
    if manifest.get("step", 0) >= cfg.train.steps:
        problems.append(Problem("train.steps", cfg.train.steps, f"train.init_from is at step {manifest.get('step')}: "
                                "training continues up to train.steps", f"train.steps={manifest.get('step', 0) + 100}"))
    return problems


def _hf_init_problems(cfg: DictConfig) -> list[Problem]:
    """train.init_from=hf:<folder>: a supported architecture whose sizes are model.*'s."""
    from storage import hf

    path, folder = cfg.train.init_from, hf.folder_of(cfg.train.init_from)
    if not folder.is_dir():
        return [Problem("train.init_from", path, f"{folder} is not a folder", "hf:<a save_pretrained folder>")]
    try:
        differ = hf.differences(cfg.model, folder)
    except hf.HFError as e:
        return [Problem("train.init_from", path, str(e), "a GPT-2 or Llama folder, or another starting point")]
    except (KeyError, ValueError) as e:
        return [Problem("train.init_from", path, f"{folder}/config.json cannot be read: {e}", "a save_pretrained folder")]
    if not differ:
        return []
    family = differ.pop("name", (None, cfg.model.name))[1]
    fix = " ".join([f"model={'llama_tiny' if family == 'llama' else 'gpt_tiny'}"] if family != cfg.model.name else []
                   + [f"model.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, (_, v) in differ.items()])
    listed = "; ".join(f"model.{k}: ours {a}, theirs {b}" for k, (a, b) in differ.items())
    return [Problem("train.init_from", path, f"the folder holds another model ({family}): {listed}", fix)]


# -- what this machine can run -------------------------------------------------------------------------------------

def machine_problems(cfg: DictConfig) -> list[Problem]:
    problems = _folder_problems(cfg) + _tracking_problems(cfg) + _memory_problems(cfg) + _stage_memory_problems(cfg)
    ort, triton = cfg.engine.name == "ort", cfg.triton.enabled
    if ort and triton and not (_has_cuda() and _ort_has_triton()):
        missing = "no CUDA device" if not _has_cuda() else "an onnxruntime-training build without CUDA and Triton"
        problems.append(Problem("triton.enabled", True, "engine=ort with triton=on runs ONNX Runtime's Triton "
                                f"kernels, which need a CUDA GPU and ORT's Triton build; this machine has {missing}",
                                "triton=off (engine=ort runs ORT's CPU kernels), or engine=torch triton=on "
                                "(torch.compile generates C++ on CPU)"))
    if ort and cfg.precision.name in ("bf16", "fp16"):
        problems.append(Problem("precision.name", cfg.precision.name, "engine=ort trains each unit as an fp32 ONNX "
                                "graph (exported and differentiated in fp32): it has no mixed precision",
                                "precision=fp32 (or auto), or engine=torch for bf16/fp16"))
    problems += _gpu_count_problems(cfg)
    if cfg.precision.name == "bf16" and cfg.cluster.name != "slurm" and _has_cuda() and not _cuda_bf16():
        problems.append(Problem("precision.name", "bf16", "this machine's CUDA GPU has no bf16 support (it needs "
                                "compute capability 8.0, Ampere, or newer)", "precision=fp16 (loss scaling) or "
                                "precision=fp32"))
    if ort and cfg.parallel.sequence_parallel:
        problems.append(Problem("parallel.sequence_parallel", True, "engine=ort runs each unit (LayerNorm through the "
                                "row-parallel matmul) as one graph, but sequence parallelism needs a collective "
                                "between the LayerNorm and the matmuls", "parallel.sequence_parallel=false, or "
                                "engine=torch"))
    if ort:
        installed = ort_install_problems()
        problems += installed
        if not installed and cfg.cluster.name != "slurm" and _has_cuda() and not _ort_has_cuda():
            import onnxruntime

            problems.append(Problem("engine", "ort", "the train stage runs on this machine's CUDA GPU, but the "
                                    f"installed onnxruntime-training {onnxruntime.__version__} has no CUDA execution "
                                    "provider (PyPI's wheel is CPU-only), so ORT could not run the units on the GPU",
                                    "install onnxruntime-training's CUDA build (ONNX Runtime's package index, for your "
                                    "CUDA version), or engine=torch, or CUDA_VISIBLE_DEVICES= to train on the CPU"))
    if cfg.cluster.name == "slurm" and not cfg.dry_run and not (shutil.which("sbatch") and shutil.which("sacct")):
        problems.append(Problem("cluster", "slurm", "cluster=slurm submits with sbatch and follows jobs with sacct "
                                "(SLURM accounting); they are not on this machine's PATH",
                                "run on a SLURM login node, or start the bundled single-node cluster "
                                "(sudo scripts/slurm_cluster.sh start), or cluster=local; dry_run=true prints the "
                                "sbatch scripts without SLURM"))
    if triton and not _has_cuda() and not (shutil.which("g++") or shutil.which("c++")):
        problems.append(Problem("triton.enabled", True, "on CPU, torch.compile generates C++ and needs a C++ compiler; "
                                "none found on PATH (g++ or c++)", "install g++, or triton=off"))
    return problems


def _unwritable(path: str) -> str:
    """Why a folder cannot be created or written at path ('' when it can)."""
    p = Path(path).expanduser().absolute()
    while not p.exists():
        p = p.parent
    if not p.is_dir():
        return f"{p} is a file, not a folder"
    try:  # the one sure test (permissions, read-only mounts, /proc): make a folder there, and remove it
        os.rmdir(tempfile.mkdtemp(dir=p, prefix=".orchestrator-probe-"))
    except OSError as e:
        return f"no folder can be made in {p} ({e.strerror})"
    return ""


def _folder_problems(cfg: DictConfig) -> list[Problem]:
    problems = []
    for key in ("runs_dir", "cache_dir"):
        why = _unwritable(cfg[key])
        if why:
            problems.append(Problem(key, cfg[key], f"outputs are written under {key}, but {why}",
                                    f"{key}= a folder you can write (the default is under ./runs)"))
    return problems or _disk_problems(cfg)


def _disk_problems(cfg: DictConfig) -> list[Problem]:
    """Room for the checkpoints (fp32 weights and optimizer state): train.keep_checkpoints of them while training
    plus the published one (the checkpoint stage links it, no copy on the same disk), and the aggregate's files
    (the checkpoint again as safetensors, hf/ and the ONNX model's weights)."""
    from planning.estimate import stage_costs

    where = Path(cfg.cache_dir).expanduser().absolute()
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    costs = stage_costs(cfg, partition_plan(cfg))
    per_checkpoint = int(costs["checkpoint"].writes * 1.1) + 4 * 2**20  # + DCP's metadata
    needed = per_checkpoint * (cfg.train.keep_checkpoints + 1) + costs["aggregate"].writes
    if free >= needed:
        return []
    return [Problem("cache_dir", cfg.cache_dir, f"the checkpoints of this model need about {needed / 2**20:,.0f} MB "
                    f"({per_checkpoint / 2**20:,.0f} MB each: fp32 weights and optimizer state; train.keep_checkpoints="
                    f"{cfg.train.keep_checkpoints} while training, the final one, and the aggregate's "
                    f"{costs['aggregate'].writes / 2**20:,.0f} MB); {where} has {free / 2**20:,.0f} MB free",
                    "free space, cache_dir= a larger disk, or train.keep_checkpoints=1")]


TRACKING_TIMEOUT_S = 5.0  # an MLflow server that does not answer this fast is reported before launch


def _tracking_problems(cfg: DictConfig) -> list[Problem]:
    """The MLflow store can be created or opened, or the server answers (MLflow itself would retry a dead server
    for minutes before saying anything)."""
    t = cfg.tracking
    if t.name != "mlflow":
        return []
    uri, fix = t.uri, "tracking=none, or a local store: tracking.uri=sqlite:///runs/mlflow.db"
    if uri.startswith("sqlite:///"):
        db = Path(uri[len("sqlite:///"):])
        if not db.exists():
            why = _unwritable(str(db.parent))
            return [Problem("tracking.uri", uri, f"the sqlite store cannot be created: {why}", fix)] if why else []
        import sqlite3

        try:
            with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=TRACKING_TIMEOUT_S) as con:
                con.execute("SELECT count(*) FROM sqlite_master").fetchone()
        except sqlite3.Error as e:
            return [Problem("tracking.uri", uri, f"{db} cannot be read as an MLflow store ({e})",
                            f"move the file aside (MLflow creates a new store), or {fix}")]
    elif uri.startswith(("http://", "https://")):
        import urllib.error
        import urllib.request

        try:
            urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=TRACKING_TIMEOUT_S).close()
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            return [Problem("tracking.uri", uri, f"no MLflow server answers there within {TRACKING_TIMEOUT_S:.0f} s "
                            f"({reason})", f"start it (mlflow server --host ... --port ...), or {fix}")]
    return []


def ort_install_problems(python: tuple[int, int] = tuple(sys.version_info[:2])) -> list[Problem]:
    """engine=ort needs ONNX Runtime's training build; say which package to install, or why none can be."""
    from plugins.engines.ort.install import LAST_PYTHON_WITH_WHEEL, ort_install

    found = ort_install()
    if found.can_train:
        return []
    this = ".".join(map(str, python))
    last = ".".join(map(str, LAST_PYTHON_WITH_WHEEL))
    no_wheel = python > LAST_PYTHON_WITH_WHEEL
    install = "pip install -e '.[ort]' (onnxruntime-training 1.19.2)"
    fix = (f"engine=torch, or a Python {last} environment with {install}" if no_wheel
           else f"{install}, or engine=torch")
    why_no_wheel = (f"; onnxruntime-training publishes no wheel for Python {this} (its last release has wheels up to "
                    f"Python {last})" if no_wheel else "")
    if not found.installed:
        rule = f"engine=ort trains with ONNX Runtime's training build, package onnxruntime-training, which is not installed{why_no_wheel}"
    elif found.import_error:
        rule = f"engine=ort needs onnxruntime-training, but the installed onnxruntime does not import: {found.import_error}"
    else:
        rule = (f"the installed onnxruntime {found.version} is an inference-only build (package onnxruntime or "
                f"onnxruntime-gpu): it lacks the training API engine=ort uses ({', '.join(found.missing_api)})"
                f"{why_no_wheel}")
        fix = f"pip uninstall onnxruntime onnxruntime-gpu, then {fix}" if not no_wheel else fix
    return [Problem("engine", "ort", rule, fix)]


def _gpu_count_problems(cfg: DictConfig) -> list[Problem]:
    """On a CUDA machine the local cluster gives each rank a GPU of its own: NCCL refuses two ranks on one."""
    p = cfg.parallel
    world = p.dp * p.hp * p.pp
    if cfg.cluster.name != "local" or world == 1 or not _has_cuda():
        return []
    gpus = _cuda_devices()
    if world <= gpus:
        return []
    return [Problem("parallel", f"dp{p.dp} hp{p.hp} pp{p.pp}", f"cluster=local runs each of the layout's {world} "
                    f"ranks (dp*hp*pp) on a CUDA GPU of its own, and this machine shows {gpus} "
                    "(NCCL cannot put two ranks on one GPU)", f"a layout of at most {gpus} rank(s) (parallel=single "
                    "for one), cluster=slurm cluster.gpus_per_task=1 to spread the ranks over more GPUs, or "
                    f"CUDA_VISIBLE_DEVICES= to run the {world} ranks on the CPU")]


def _has_cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count()


def _cuda_bf16() -> bool:
    import torch

    return torch.cuda.is_bf16_supported()


def _ort_has_cuda() -> bool:
    import onnxruntime

    return "CUDAExecutionProvider" in onnxruntime.get_available_providers()


def _ort_has_triton() -> bool:
    import importlib.util

    try:
        import onnxruntime
        return "CUDAExecutionProvider" in onnxruntime.get_available_providers() and \
            importlib.util.find_spec("triton") is not None
    except ImportError:
        return False
