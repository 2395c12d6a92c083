"""Every rule a config must meet, checked before anything starts; all problems reported at once."""
from __future__ import annotations

import dataclasses
import shutil
from typing import Iterable

from omegaconf import DictConfig, OmegaConf

from orchestrator.errors import ConfigError, Problem, unknown_key_problem

# What each pipeline schedule needs: (chunks rule, minimum microbatches as a function of pp and chunks)
SCHEDULES = {
    "gpipe": ("== 1", lambda pp, c: pp),
    "1f1b": ("== 1", lambda pp, c: pp),
    "interleaved_1f1b": (">= 2", lambda pp, c: pp),
    "looped_bfs": (">= 2", lambda pp, c: pp),
    "interleaved_zb": (">= 2", lambda pp, c: pp),
    "zbv": ("== 2", lambda pp, c: pp),
}


def validate(cfg: DictConfig, overrides: Iterable[str] = ()) -> None:
    problems = schema_problems(cfg, list(overrides)) + layout_problems(cfg) + training_problems(cfg) \
        + machine_problems(cfg)
    if problems:
        raise ConfigError(problems)


# -- the schema: known keys, choices, bounds ---------------------------------------------------------------

def schema_problems(cfg: DictConfig, overrides: list[str]) -> list[Problem]:
    problems: list[Problem] = []

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
    if meta.get("choices") and value not in meta["choices"]:
        return [Problem(full, value, f"{full} must be one of {', '.join(map(str, meta['choices']))} ({meta['help']})",
                        f"{full}={meta['choices'][0]}")]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        lo, hi = meta.get("min"), meta.get("max")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            span = f"between {lo} and {hi}" if lo is not None and hi is not None else \
                f">= {lo}" if lo is not None else f"<= {hi}"
            return [Problem(full, value, f"{full} must be {span} ({meta['help']})",
                            f"{full}={lo if lo is not None and value < lo else hi}")]
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
    sizes = {"model.n_heads": m.n_heads, "model.d_model": m.d_model, "model.d_ff": m.d_ff,
             "model.vocab_size": m.vocab_size}
    bad = {k: v for k, v in sizes.items() if v % p.hp}
    if bad:
        ok = [d for d in _divisors(min(sizes.values())) if all(v % d == 0 for v in sizes.values()) and d <= 16]
        problems.append(Problem("parallel.hp", p.hp, " and ".join(f"{k}={v}" for k, v in bad.items())
                                + f" not divisible by parallel.hp={p.hp} (each hp rank holds an equal share of heads, "
                                "hidden units and vocabulary rows)",
                                f"choose parallel.hp in {{{', '.join(map(str, ok))}}}"))
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
    from orchestrator.schema import STAGE_TIMES_MIN

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
    if t.seq_len > m.max_seq_len:
        problems.append(Problem("train.seq_len", t.seq_len, f"sequences cannot be longer than model.max_seq_len="
                                f"{m.max_seq_len}", f"train.seq_len={m.max_seq_len}"))
    try:
        need = get_source(d.name).vocab_size
    except KeyError:
        need = None
    if need is not None and need > m.vocab_size:
        problems.append(Problem("model.vocab_size", m.vocab_size, f"data={d.name} produces token ids up to {need - 1}",
                                f"model.vocab_size={need} or more (a multiple of 64 is fastest)"))
    problems += _init_from_problems(cfg)
    if d.name == "text" and not d.paths:
        problems.append(Problem("data.paths", "[]", "data=text needs files or folders to read",
                                "data.paths='[/path/to/corpus]'"))
    return problems


def _init_from_problems(cfg: DictConfig) -> list[Problem]:
    """train.init_from names a complete checkpoint of a model with this model's parameters (any layout)."""
    from pathlib import Path

    from plugins.checkpoint import MANIFEST
    from plugins.fsio import read_json
    from plugins.partition import build_plan

    path = cfg.train.init_from
    if not path:
        return []
    manifest_path = Path(path) / MANIFEST
    if not manifest_path.is_file():
        return [Problem("train.init_from", path, f"must be a complete checkpoint folder (with {MANIFEST}), e.g. "
                        "runs/cache/checkpoint/<key> or the checkpoint/ folder of a train stage's output",
                        "point it at a checkpoint folder, or remove it (train.init_from=null)")]
    manifest = read_json(manifest_path)
    theirs = {n: q["shape"] for n, q in manifest.get("partition_plan", {}).get("parameters", {}).items()}
    ours = {n: q["shape"] for n, q in build_plan(cfg.model, cfg.parallel)["parameters"].items()}
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


# -- what this machine can run -------------------------------------------------------------------------------------

def machine_problems(cfg: DictConfig) -> list[Problem]:
    import importlib.util

    problems = []
    ort, triton = cfg.engine.name == "ort", cfg.triton.enabled
    if ort and triton and not (_has_cuda() and _ort_has_triton()):
        missing = "no CUDA device" if not _has_cuda() else "an onnxruntime-training build without CUDA and Triton"
        problems.append(Problem("triton.enabled", True, "engine=ort with triton=on runs ONNX Runtime's Triton "
                                f"kernels, which need a CUDA GPU and ORT's Triton build; this machine has {missing}",
                                "triton=off (engine=ort runs ORT's CPU kernels), or engine=torch triton=on "
                                "(torch.compile generates C++ on CPU)"))
    if ort and cfg.parallel.sequence_parallel:
        problems.append(Problem("parallel.sequence_parallel", True, "engine=ort runs each unit (LayerNorm through the "
                                "row-parallel matmul) as one graph, but sequence parallelism needs a collective "
                                "between the LayerNorm and the matmuls", "parallel.sequence_parallel=false, or "
                                "engine=torch"))
    if ort and importlib.util.find_spec("onnxruntime") is None:
        problems.append(Problem("engine", "ort", "engine=ort needs onnxruntime-training",
                                "pip install -e . (it installs onnxruntime-training==1.19.2), or engine=torch"))
    if cfg.cluster.name == "slurm" and not (shutil.which("sbatch") and shutil.which("sacct")):
        problems.append(Problem("cluster", "slurm", "cluster=slurm submits with sbatch and follows jobs with sacct "
                                "(SLURM accounting); they are not on this machine's PATH",
                                "run on a SLURM login node, or start the bundled single-node cluster "
                                "(sudo scripts/slurm_cluster.sh start), or cluster=local"))
    if triton and not _has_cuda() and not (shutil.which("g++") or shutil.which("c++")):
        problems.append(Problem("triton.enabled", True, "on CPU, torch.compile generates C++ and needs a C++ compiler; "
                                "none found on PATH (g++ or c++)", "install g++, or triton=off"))
    return problems


def _has_cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


def _ort_has_triton() -> bool:
    import importlib.util

    try:
        import onnxruntime
        return "CUDAExecutionProvider" in onnxruntime.get_available_providers() and \
            importlib.util.find_spec("triton") is not None
    except ImportError:
        return False
