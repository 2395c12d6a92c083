"""The planning pass: once per experiment point, the partition plan, the memory estimate per train rank and per
stage, what a rank and a one-process stage may use, the bytes written, and the objective with its reference model.
Validation refuses what the plan says cannot fit; the printed plan shows the same figures. They are computed once a
point, by plan_of: validation makes the Plan and returns it, and the orchestrator passes that one to the printout,
the stages' timing, tune and the run.

The lines on time are planning/plan_time.py's: they measure this machine's matmul rate and disk speed, which only
a run needs."""
from __future__ import annotations

import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

from common.problem import Found, Problem
from planning.estimate import STAGE_RUNTIME, Estimate, StageCost, available_bytes, host_bytes, estimate, stage_costs
from plugins.data.tokenize_cost import DataRead, memory_problem, tokenize_tasks
from plugins.data.registry import get_source, source_names
from plugins.objectives import ObjectiveSpec, objective_of
from plugins.objectives.reference import Reference, reference_taken
from runtime.threads import usable_cores

GB = 2**30


@dataclass(frozen=True)
class Plan:
    partition: dict                  # planning.partition.build_plan: every parameter's shape, shard and owner
    rank: Estimate                   # a train rank's peak
    rank_limit: int                  # what a rank may use (0: unknown) ...
    rank_limit_where: str            # ... and where that figure comes from
    stages: dict[str, StageCost]     # export, checkpoint, aggregate: one process each
    aggregate_without_onnx: StageCost
    host_limit: int                  # what a one-process stage may use (0: unknown) ...
    host_limit_where: str
    objective: ObjectiveSpec         # what the train stage minimises (plugins/objectives: sft's where none is named)
    reference: Optional[Reference]   # the reference model it scores rows with; None: it takes none

    @property
    def n_parameters(self) -> int:
        return self.partition["n_parameters"]

    @property
    def parameters(self) -> dict:
        return self.partition["parameters"]


def partition_plan(cfg) -> dict:
    """The layout's partition plan (built on the meta device: no memory)."""
    from planning.partition import build_plan

    return build_plan(cfg.model, cfg.parallel, cfg.peft)


class EstimatesFailed(Exception):
    """The plan's estimates stopped (the exception is the cause) once its partition plan was made, which it carries
    for the checks that read the partition alone (train.init_from's)."""

    @property
    def partition(self) -> dict:
        return self.args[0]


def plan_of(cfg) -> Plan:
    """The plan of this experiment point. Validation computes it (orchestrator/config/validate.py) and returns it; the
    printout, tune and the run read that one. Raises what building the partition plan raised, or EstimatesFailed."""
    partition = partition_plan(cfg)
    try:
        objective = objective_of(cfg)
        reference = reference_taken(cfg, objective)  # a continued checkpoint's manifest read here, once a point
        return Plan(partition, estimate(cfg, partition), *available_bytes(cfg), stage_costs(cfg, partition),
                    stage_costs(cfg, partition, onnx=False)["aggregate"], *host_bytes(cfg), objective, reference)
    except Exception as e:  # noqa: BLE001 (said by validation as the plan check's; the partition goes with it)
        raise EstimatesFailed(partition) from e


def memory_line(p: Plan, orchestrator: int = 0) -> str:
    """The plan's lines on memory: a train rank's estimate against what it may use, then what the stages around
    training need (one process each) and write; `orchestrator`: what the process printing the plan holds."""
    of = f" of {p.rank_limit / GB:,.1f} GB ({p.rank_limit_where})" if p.rank_limit else f" ({p.rank_limit_where})"
    stages = "; ".join(f"{name} {c.peak / GB:,.2f} GB ({c.what})" for name, c in p.stages.items())
    host = f", of {p.host_limit / GB:,.1f} GB ({p.host_limit_where})" if p.host_limit else f" ({p.host_limit_where})"
    itself = f"; the orchestrator itself {orchestrator / GB:,.2f} GB" if orchestrator else ""
    return (f"memory: {p.rank.describe()}{of}\n  one process each: {stages}{host}{itself}\n  disk: checkpoints "
            f"{_size(p.stages['checkpoint'].writes)} each, the aggregate's files {_size(p.stages['aggregate'].writes)}")


def _size(n: int) -> str:
    """GB to two places, under 1 GB in MB (a small model's 0.00 GB said nothing)."""
    return f"{n / GB:,.2f} GB" if n >= GB else f"{n / 2**20:,.1f} MB"


def peft_line(peft, params: dict) -> list[str]:
    """peft=lora: what trains, and what stays frozen (no gradient, no optimizer state, not in the checkpoints);
    params: the partition plan's parameters, which hold the adapters where the model has them (a group of
    peft.targets names Linears a family may not have: GPT has no fc3), so the line names those."""
    if peft.name != "lora":
        return []
    trained = sum(math.prod(p["shape"]) for p in params.values() if p.get("trainable", True) and not p["tied_to"])
    total = sum(math.prod(p["shape"]) for p in params.values() if not p["tied_to"])
    adapted = ", ".join(sorted({name.rsplit(".", 2)[-2] for name in params if name.endswith(".lora_A")}))
    return [f"peft: LoRA r={peft.rank} alpha={peft.alpha:g} on {adapted}: {trained:,} of {total:,} parameters train "
            f"({100 * trained / max(total, 1):.2f}%), the rest frozen"]


def objective_line(cfg, p: Plan) -> list[str]:
    """An objective other than the default's: what it minimises (its spec's words), and where the reference model's
    log-probabilities come from, at what cost (from the point's plan, p), where it takes them."""
    spec, reference, o = p.objective, p.reference, cfg.get("objective")
    if spec.loss is None:
        return []  # next-token cross-entropy: the compute line says how
    loss = f"objective: {spec.describe(o)}"
    if reference is None:
        return [loss]
    mismatched = " and of its mismatched rows, which the policy scores too (no gradient)" if spec.mismatched(o) \
        else ""
    from planning.estimate import reference_bytes
    from plugins.parallel import world_size

    model = (f"{reference.model}'s weights" + (": LoRA's base, the adapters off" if cfg.peft.name == "lora" else "")) \
        if reference.model else f"train.seed={cfg.train.seed}'s initialisation"
    weights = reference_bytes(cfg, p.partition)
    if reference.where == "online" and reference.is_the_policy:  # LoRA training nothing else: no second model
        return [f"{loss}; the reference model ({model}) online: the policy with its adapters off, one more "
                f"forward of every batch's rows{mismatched} (no second model)"]
    if reference.where == "online":
        return [f"{loss}; the reference model ({model}) online: a frozen copy beside the policy on every "
                f"rank ({_size(weights)}, in the memory line), one more forward of every batch's rows{mismatched}"]
    rank = weights + p.rank.activations + p.rank.runtime
    return [f"{loss}; the reference stage scores every pair of both splits once with the reference model ({model}), "
            f"as {world_size(cfg.parallel)} rank(s) of at most {_size(rank)} each (its weights "
            f"{_size(weights)} and a forward's activations: no "
            f"gradients or optimizer state); a sweep over objective."
            f"{'/'.join(k for k in o if k not in ('name', 'reference'))}, the learning rate or LoRA's rank reuses it"]


def compute_line(cfg) -> str:
    """The plan's line on what the step computes that the loss would throw away: label sparsity's head, and where
    padded rows lose their padding (runtime/step.py)."""
    from plugins.engines import get_engine
    from runtime.step import padding_kept

    t = cfg.train
    head = (f"compute: the head and the loss on the labelled positions only, {t.loss_chunk:,} at a time "
            "(train.label_sparsity)") if t.label_sparsity else \
        "compute: the head and the loss over every position (train.label_sparsity=false)"
    if cfg.data.packing:
        return f"{head}; rows are packed, with no padding to leave out"
    why = padding_kept(cfg, get_engine(cfg.engine.name).one_shape)
    from plugins.objectives import objective_of

    kept = objective_of(cfg).loss is not None  # an objective of rows: each row stays one example
    rows = "padded rows keep their padding: " + why if why else \
        "a batch's rows are cut after their longest real run (each row stays one example)" if kept else \
        "padded rows reach the blocks as their real tokens only (each rank packs them into fewer rows)"
    return f"{head}; {rows}"


def check(cfg, p: Plan, read: Optional[DataRead] = None, disk: bool = True) -> list[Problem]:
    """What the point's plan (p) knows cannot fit: a train rank, a one-process stage (the tokenize tasks from the
    corpus as the data's check read it, `read`; None: it read none, the data refused), the disk (disk=False where the
    folders themselves are refused)."""
    disk_found = _disk_problems(cfg, p) if disk else []
    ranks = [] if cfg.plan.trace else _rank_problems(cfg, p)  # traced, the trace's peak decides (run_plan._traced)
    if cfg.dry_run:  # a plan, perhaps for a cluster's disk (cluster.device): this machine's shortfall is said, and
        # refuses the run that writes (the Problem's words in a warning line: its facts, which validation says)
        return Found(ranks + _stage_problems(cfg, p, read),
                     facts=[f"warning: {q.rule}: a run from here would be refused (fix: {q.fix})" for q in disk_found])
    return ranks + _stage_problems(cfg, p, read) + disk_found


def _rank_problems(cfg, plan: Plan) -> list[Problem]:
    """A layout whose estimated peak exceeds what a rank may use is refused, with the numbers and the fixes."""
    if not plan.rank_limit or plan.rank.total <= plan.rank_limit:
        return []
    p, fixes = cfg.parallel, layout_fixes(cfg, plan, plan.rank.total)
    m = cfg.model
    model = f"model.n_layers={m.n_layers}, model.d_model={m.d_model}, model.d_ff={m.d_ff}, " \
            f"model.vocab_size={m.vocab_size}"
    positions = sum(math.prod(q["shape"]) for q in plan.parameters.values()  # learned ones: a row per position
                    if m.max_seq_len not in (m.d_model, m.d_ff, m.vocab_size) and m.max_seq_len in q["shape"])
    if positions >= 0.1 * plan.n_parameters:  # a tenth of the model or more: worth naming
        model += f", model.max_seq_len={m.max_seq_len}"
        fixes.append("a smaller model.max_seq_len (its learned position embedding holds a row per position)")
    return [Problem("parallel", f"dp{p.dp} hp{p.hp} pp{p.pp}", f"the estimated peak per rank ({model}), "
                    f"{plan.rank.describe()}, "
                    f"exceeds the {plan.rank_limit / GB:,.1f} GB a rank may use ({plan.rank_limit_where})",
                    "; ".join(fixes))]


def layout_fixes(cfg, plan: Plan, need: int) -> list[str]:
    """What lowers a rank's peak of `need` bytes below what it may use: the fixes of a refusal by the estimate or by
    the trace (orchestrator/tracing.py)."""
    p = cfg.parallel
    fixes = [f"parallel.hp={p.hp * 2} or parallel.pp={p.pp * 2} (each rank holds less)"]
    if p.dp > 1 and p.dp_mode != "shard":
        fixes.append("parallel.dp_mode=shard (parameters, gradients and optimizer state split over dp)")
    if cfg.memory.level == 0:
        fixes.append("memory=level1 (recompute activations)")
    fixes.append(f"a smaller train.batch_size (now {cfg.train.batch_size}) or more parallel.microbatches")
    if cfg.cluster.get("device") is not None:  # a plan for a declared device: the one that holds it, if any
        from planning.devices import DEVICES

        holds = sorted((d.memory_gib, name) for name, d in DEVICES.items() if d.memory_gib * 2**30 >= need)
        fixes += [f"cluster.device={holds[0][1]} ({holds[0][0]:g} GiB)"] if holds else []
    lora = _lora_fits(cfg, plan.rank_limit)
    if lora:
        fixes.insert(0, lora)
    return fixes


def _lora_fits(cfg, limit: int) -> str:
    """A full fine-tune of an imported model that does not fit a rank: whether LoRA's (peft=lora's defaults) does,
    its frozen base holding no gradient and no optimizer state."""
    if cfg.peft.name != "none" or not (cfg.train.init_from or "").startswith("hf:"):
        return ""
    lora = OmegaConf.merge(cfg, {"peft": {"name": "lora"}})
    need = estimate(lora, partition_plan(lora)).total  # the rank's estimate of that other point's plan
    return f"peft=lora (a LoRA fine-tune of this model needs about {need / GB:,.1f} GB a rank: the frozen weights " \
           "have no gradients and no optimizer state)" if need <= limit else ""


def _stage_problems(cfg, plan: Plan, read: Optional[DataRead]) -> list[Problem]:
    """A stage around training whose one process cannot fit the memory it may use is refused before training
    starts, not found out after the GPU hours are spent."""
    avail, where = plan.host_limit, plan.host_limit_where
    if not avail:
        return []
    more = "a node with more memory (cluster.mem_per_task_gb on SLURM)"
    problems = []
    tokenize = _tokenize_problem(cfg, read, avail, where)
    if tokenize:
        problems.append(Problem(*tokenize))
    problems += _example_problems(cfg, avail, where)
    export, agg, without = plan.stages["export"], plan.stages["aggregate"], plan.aggregate_without_onnx
    if export.peak > avail:
        problems.append(Problem("model", cfg.model.name, f"the export stage needs about {export.peak / GB:,.1f} GB "
                                f"({export.what}), more than the {avail / GB:,.1f} GB it may use ({where})", more))
    if agg.peak > avail and cfg.aggregate.onnx and without.peak <= avail:
        problems.append(Problem("aggregate.onnx", True, f"the aggregate stage's ONNX check needs about "
                                f"{agg.peak / GB:,.1f} GB ({agg.what}), more than the {avail / GB:,.1f} GB it may use "
                                f"({where})", f"aggregate.onnx=false (the safetensors files then need "
                                f"{without.peak / GB:,.1f} GB), or a node with more memory"))
    elif agg.peak > avail:
        problems.append(Problem("model", cfg.model.name, f"the aggregate stage needs about {agg.peak / GB:,.1f} GB "
                                f"({agg.what}), more than the {avail / GB:,.1f} GB it may use ({where})", more))
    evaluate = plan.stages.get("evaluate")
    if evaluate is not None and evaluate.peak > avail:
        problems.append(Problem("evaluate.batch_size", cfg.evaluate.batch_size, f"the evaluate stage needs about "
                                f"{evaluate.peak / GB:,.1f} GB ({evaluate.what}), more than the {avail / GB:,.1f} GB "
                                f"it may use ({where})",
                                f"a smaller evaluate.batch_size, evaluate.onnx=false, or {more}"))
    return problems


def _example_problems(cfg, avail: int, where: str) -> list[Problem]:
    """Inputs a stage makes whole in memory, against what it may use: the export check's example batch, and the
    synthetic source's token stream (8 bytes a token, twice while it is drawn)."""
    from plugins.onnx.rules import example_bytes

    problems = []
    room = avail - STAGE_RUNTIME
    need = example_bytes(cfg)
    if need > room:
        fits = max(room // 2 // example_bytes(cfg, batch=1) - 1, 0)  # half the room: what is free moves between runs
        problems.append(Problem("export.sample_batch", cfg.export.sample_batch, f"the export's check runs "
                                f"export.sample_batch+1 example sequences through torch and ONNX Runtime: about "
                                f"{need / GB:,.1f} GB, more than the {avail / GB:,.1f} GB it may use ({where})",
                                f"export.sample_batch={fits}" if fits >= 1 else "a smaller export.sample_seq"))
    if cfg.data.name in source_names() and get_source(cfg.data.name).drawn_bytes(cfg.data) > room:  # the fix
        # offers half the room: what is free moves between runs, and a fix sized to the byte would be refused in turn
        problems.append(Problem("data.synthetic_tokens", cfg.data.synthetic_tokens, f"the synthetic stream is drawn "
                                f"in memory, 16 bytes a token: {16 * cfg.data.synthetic_tokens / GB:,.1f} GB, more "
                                f"than the {avail / GB:,.1f} GB it may use ({where})",
                                f"data.synthetic_tokens={max(room // 32, 2):,}".replace(",", "")))
    return problems


def _tokenize_problem(cfg, read: Optional[DataRead], avail: int, where: str):
    """The tokenize tasks against the memory they may use, from the corpus the data's check read (a source or a corpus
    the data's own rules refuse is theirs to name: then there is no `read`)."""
    if read is None or get_source(cfg.data.name).tokens is not None:
        return None
    return memory_problem(cfg, tokenize_tasks(cfg, read.layouts, usable_cores()), avail, where)


def checkpoint_saves(train) -> int:
    """The checkpoints a run writes: every train.checkpoint_every steps and the last step's (a baseline's, at
    train.steps=0, too)."""
    return max(-(-train.steps // train.checkpoint_every) if train.checkpoint_every else 1, 1)


def checkpoints_on_disk(train, keep: int) -> int:
    """The most checkpoints on disk at once: `keep` and the one just written, before the oldest is pruned; never
    more than the run writes (keeping "all" on a short run is a few checkpoints, not `keep`)."""
    return min(keep + 1, checkpoint_saves(train))


def _disk_problems(cfg, plan: Plan) -> list[Problem]:
    """Room for the checkpoints (fp32 weights and optimizer state): as many as are on disk at once (the checkpoint
    stage links the published one, no copy on the same disk), and the aggregate's files (the checkpoint's bytes
    again, as safetensors: the weights once, in hf/, and the optimizer state; and the ONNX model's weights)."""
    where = Path(cfg.cache_dir).expanduser().absolute()
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    per_checkpoint = int(plan.stages["checkpoint"].writes * 1.1) + 4 * 2**20  # + DCP's metadata
    aggregate = plan.stages["aggregate"].writes
    t = cfg.train
    at_once = checkpoints_on_disk(t, t.keep_checkpoints)
    needed = per_checkpoint * at_once + aggregate
    if free >= needed:
        return []
    mb = 2**20
    fits_with_one = per_checkpoint * checkpoints_on_disk(t, 1) + aggregate <= free  # offered only where it fits
    fewer = ", or train.keep_checkpoints=1" if fits_with_one else ""
    return [Problem("cache_dir", cfg.cache_dir, f"the checkpoints of this model need about {needed / mb:,.0f} MB "
                    f"({per_checkpoint / mb:,.0f} MB each, fp32 weights and optimizer state, {at_once} on disk at "
                    f"once: train.keep_checkpoints={t.keep_checkpoints} of the {checkpoint_saves(t)} this run "
                    f"writes and the one being written; and the aggregate's {aggregate / mb:,.0f} MB); {where} has "
                    f"{free / mb:,.0f} MB free", f"free space{'' if fewer else ' or'} cache_dir= a larger disk{fewer}")]
